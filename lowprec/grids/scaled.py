"""Scaled formats: element grids under per-block or per-tensor scales.

A scaled format rounds each block of `B` consecutive elements along one axis
onto `scale * G_E`, the grid of an element format `E` times that block's
scale. The names:

| name          | elements        | block | block scale | scale rule     |
|---------------|-----------------|-------|-------------|----------------|
| `mxfp8_e4m3`  | `float8_e4m3fn` | 32    | E8M0        | `ocp` (default) |
| `mxfp8_e5m2`  | `float8_e5m2`   | 32    | E8M0        | `ocp`          |
| `mxfp6_e3m2`  | `float6_e3m2fn` | 32    | E8M0        | `ocp`          |
| `mxfp6_e2m3`  | `float6_e2m3fn` | 32    | E8M0        | `ocp`          |
| `mxfp4_e2m1`  | `float4_e2m1fn` | 32    | E8M0        | `ocp`          |
| `nvfp4`       | `float4_e2m1fn` | 16    | E4M3 * fp32 | `nvfp4`        |
| `<fp8>:tensor`| that format     | whole | float32     | `amax`         |

where `<fp8>` is `float8_e4m3fn` or `float8_e5m2`. Scale rules, with
`amax` the largest finite `|x|` of the block:

* `ocp` (OCP MX v1.0): `scale = 2^(floor(log2 amax) - emax_E)`; the block
  maximum may exceed `max_E * scale` and then saturates to `max_E`.
* `noclip`: the smallest power of two with `amax / scale <= max_E`,
  `2^ceil(log2(amax / max_E))`; nothing saturates (Qwix's MX rule).
* `nvfp4`: `s_t = amax_tensor / (6 * 448)`, `s_b = e4m3(amax_block /
  (6 s_t))` (nearest, saturating at 448), values `e2m1(x / (s_b s_t)) s_b
  s_t`, all in float32 arithmetic.
* `amax` (per tensor, current scaling): `s = amax / max_E` in float32,
  values `Q(x / s) * s`. Delayed scaling passes the amax of a history to
  `scales_from_amax` instead.

Edge cases, by rule:

* A block of zeros (amax 0) has all-zero elements (of the input's sign)
  and scale 1 (E8M0 code 127; per tensor `s = 1`); under NVFP4 its E4M3
  scale is 0 and, for an all-zero tensor, `s_t = 1`.
* Power-of-two scales are applied on bit patterns, exactly, so subnormal
  inputs and outputs are exact on every backend (XLA on CPU flushes float32
  subnormals in arithmetic). E8M0 holds `2^-127 .. 2^127`; float32 inputs
  never need more than `2^126`, and a block whose rule asks for less than
  `2^-127` (amax below about `2^-119`) uses `2^-127`: a documented
  saturation of the scale, whose elements then lose precision or round to
  zero. `amax` and `nvfp4` scales are float32 arithmetic: `s` is at least
  `2^-126` and `s_t` at least `2^-117`, so `s_b s_t` is normal; subnormal
  inputs there follow the backend (zero on XLA:CPU).
* An E4M3 block scale past 448 (only with a tensor scale given by hand)
  saturates at 448, and its block's elements then saturate at 6. A block
  whose E4M3 scale rounds to zero (amax below `6 * 2^-10 * s_t`) stores
  zeros.
* Non-finite inputs never spread: `amax` ignores NaN and infinities, a NaN
  element stays NaN (every other element of its block is rounded as
  usual), and an infinite element saturates to `+-max_E * scale` (or, with
  `overflow="ieee"`, becomes what the element format's cast gives: inf, or
  NaN without inf). The OCP specification instead marks the whole block
  NaN; Qwix's scales become inf or NaN.

Stochastic rounding of the elements uses `lowprec.round_with_bits` with 32
counter-based random bits per element (`lowprec.rng`), keyed by the global
index in `x`'s shape. Given its scale the element rounding is exactly
unbiased for power-of-two scales (`x / scale` is exact); for `amax` and
`nvfp4` it is unbiased for the float32 quotient `x / s`, within a float32
rounding (`2^-24` relative) of `x / s`.

The formats themselves (`ScaledFormat`, the registry `SCALED`,
`get_scaled_format`, `is_scaled`, `SCALE_RULES`) are data of
`lowprec.formats`, documented there and importable from here too; this
module computes scales and rounds onto them. Its public functions take a
name or a `ScaledFormat` and check their choices once; the functions with
a leading underscore take a resolved `ScaledFormat` and checked choices
(`lowprec.engine.codec`, whose `Codec` holds both, calls them too).

Example:
  >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)
  >>> q = quantize(x, "mxfp8_e4m3")
  >>> q.elements.dtype, q.scales.block.dtype, q.scales.block.shape
  (dtype(float8_e4m3fn), dtype(float8_e8m0fnu), (2, 1))
  >>> v = fake_quantize(x, "mxfp8_e4m3")
  >>> bool(jnp.all(dequantize(q, "mxfp8_e4m3") == v))
  True
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.grids import choices
from lowprec.grids import rng as rng_lib
from lowprec.grids.formats import NAMED

# The scaled formats' data, re-exported: `lowprec.scaled.ScaledFormat` is
# `lowprec.grids.formats.ScaledFormat`.
from lowprec.grids.formats import SCALE_RULES as SCALE_RULES
from lowprec.grids.formats import SCALED as SCALED
from lowprec.grids.formats import ScaledFormat as ScaledFormat
from lowprec.grids.formats import get_scaled_format as get_scaled_format
from lowprec.grids.formats import is_scaled as is_scaled
from lowprec.grids.rounding import (
  OVERFLOW_MODES,
  _round_and_flag,
  _round_nearest,
  _round_scaled_code,
)

MODES = ("nearest", "stochastic")
_RULES = (*SCALE_RULES, "nvfp4", "amax")

E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
NVFP4_TENSOR_SCALE_MIN = 2.0**-117  # keeps s_b * s_t a normal float32
TENSOR_SCALE_MIN = 2.0**-126
_E4M3 = NAMED["float8_e4m3fn"]


class Scales(NamedTuple):
  """The scales of a quantized tensor.

  `block` has `x`'s shape with the block axis divided by the block size
  (float8_e8m0fnu for MX, float8_e4m3fn for NVFP4), or is a float32 scalar
  for per-tensor formats; `tensor` is NVFP4's float32 scalar, else None.
  """

  block: jax.Array
  tensor: jax.Array | None = None


class Quantized(NamedTuple):
  """Elements and scales: `x ~= elements * scales` block by block."""

  elements: jax.Array  # x's shape; ScaledFormat.element_dtype
  scales: Scales


# ---- blocks ---------------------------------------------------------------


def _axis(shape, fmt: ScaledFormat) -> int:
  if not shape:
    raise ValueError(f"{fmt.name} needs an array with an axis, got a scalar")
  if not -len(shape) <= fmt.axis < len(shape):
    raise ValueError(
      f"{fmt.name}: block axis {fmt.axis} is out of range for shape "
      f"{tuple(shape)}; pass axis= to get_scaled_format"
    )
  return fmt.axis % len(shape)


def _to_blocks(x, fmt: ScaledFormat):
  """`x` as `(..., blocks, B)` with the block axis last (or `(1, n)`
  for a per-tensor format)."""
  if fmt.block is None:
    return x.reshape(1, -1)
  axis = _axis(x.shape, fmt)
  n, b = x.shape[axis], fmt.block
  if n % b:
    fix = -(-n // b) * b
    raise ValueError(
      f"{fmt.name}: axis {axis} of shape {x.shape} has {n} elements, not a "
      f"multiple of the block size {b}. Pad it to {fix} (e.g. jnp.pad with "
      "zeros, which leave every block's scale unchanged), block another "
      "axis with get_scaled_format(..., axis=k), or choose a block size "
      "that divides it"
    )
  xm = jnp.moveaxis(x, axis, -1)
  return xm.reshape(*xm.shape[:-1], n // b, b)


def _from_blocks(y, shape, fmt: ScaledFormat):
  if fmt.block is None:
    return y.reshape(shape)
  axis = _axis(shape, fmt)
  moved = list(shape)
  moved.append(moved.pop(axis))
  return jnp.moveaxis(y.reshape(moved), -1, axis)


def _scale_layout(s, fmt: ScaledFormat, ndim: int):
  """Per-block scales `(..., blocks)` in `x`'s axis order."""
  if fmt.block is None:
    return s.reshape(())
  return jnp.moveaxis(s, -1, fmt.axis % ndim)


def _scale_blocks(s, fmt: ScaledFormat):
  if fmt.block is None:
    return s.reshape(1, 1)
  return jnp.moveaxis(s, fmt.axis % s.ndim, -1)[..., None]


# ---- bit-exact helpers ----------------------------------------------------


def abs_bits(x) -> jax.Array:
  """uint32 bits of `|x|` for float32 `x`, 0 for NaN and infinities.

  On nonnegative floats integer order is float order, so a maximum over
  these bits is the exact amax on every backend, subnormals included.
  """
  a = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  return jnp.where(a < jnp.uint32(0x7F800000), a, jnp.uint32(0))


def _log2_parts(a):
  """`(floor(log2 v), 23-bit fraction)` of positive finite float32 bits
  `a`, subnormals normalised exactly."""
  biased = (a >> 23).astype(jnp.int32)
  af = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)
  sub = biased == 0  # v = a * 2^-149, and a < 2^23 converts exactly
  e = jnp.where(sub, (af >> 23).astype(jnp.int32) - 276, biased - 127)
  frac = jnp.where(sub, af & jnp.uint32(0x7FFFFF), a & jnp.uint32(0x7FFFFF))
  return e, frac


def pow2_exponent(
  amax, top: float, rule: str, lo: int = E8M0_MIN_EXP, hi: int = E8M0_MAX_EXP
) -> jax.Array:
  """int32 `k` of the power-of-two scale `2^k` of each `amax`.

  `ocp`: `floor(log2 amax) - emax`, `emax` the exponent of `top`;
  `noclip`: the smallest `k` with `amax <= top * 2^k`. Exact (computed on
  bit patterns), clipped to `[lo, hi]`; 0 where `amax` is 0 or not finite.

  Args:
    amax: float32 array of nonnegative values.
    top: the element format's largest value.
    rule: "ocp" or "noclip".
    lo: the smallest exponent of the scale type (E8M0's by default).
    hi: the largest exponent of the scale type.
  """
  choices.check_choice("scale rule", rule, SCALE_RULES)
  return _pow2_exponent(amax, top, rule, lo, hi)


def _pow2_exponent(amax, top: float, rule: str, lo: int, hi: int):
  """`pow2_exponent` of a checked `rule`."""
  a = abs_bits(jnp.asarray(amax, jnp.float32))
  e, frac = _log2_parts(jnp.maximum(a, jnp.uint32(1)))
  t = np.array(top, np.float32).view(np.uint32)
  e_top, f_top = int(t >> 23) - 127, int(t & 0x7FFFFF)
  if rule == "ocp":
    k = e - e_top
  else:
    k = e - e_top + (frac > jnp.uint32(f_top)).astype(jnp.int32)
  return jnp.where(a > 0, jnp.clip(k, lo, hi), 0).astype(jnp.int32)


def ldexp(x, k) -> jax.Array:
  """`x * 2^k` for float32 `x` and int32 `k`, on bit patterns.

  Exact whenever the result is representable (subnormal results included);
  a subnormal result that is not is truncated toward zero. Overflow gives
  inf; zero, inf and NaN pass through. Unlike float multiplication this does
  not depend on the backend's treatment of subnormals.
  """
  u32 = jnp.uint32
  b = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), u32)
  sign = b & u32(0x80000000)
  a = b & u32(0x7FFFFFFF)
  e, frac = _log2_parts(jnp.maximum(a, u32(1)))
  ne = e + 127 + jnp.asarray(k, jnp.int32)  # the result's biased exponent
  normal = (jnp.clip(ne, 1, 254).astype(u32) << 23) | frac
  shift = jnp.clip(1 - ne, 0, 31).astype(u32)
  sub = jnp.where(1 - ne < 24, (frac | u32(0x800000)) >> shift, u32(0))
  mag = jnp.where(ne >= 1, normal, sub)
  mag = jnp.where(ne > 254, u32(0x7F800000), mag)
  mag = jnp.where((a == 0) | (a >= u32(0x7F800000)), a, mag)
  return jax.lax.bitcast_convert_type(mag | sign, jnp.float32)


# ---- scales ---------------------------------------------------------------


def block_amax(x, fmt) -> jax.Array:
  """The largest finite `|x|` of each block (float32, the scales' shape)."""
  return _block_amax(x, get_scaled_format(fmt))


def _block_amax(x, fmt: ScaledFormat):
  x = _float32(x)
  a = jnp.max(abs_bits(_to_blocks(x, fmt)), axis=-1, initial=0)
  amax = jax.lax.bitcast_convert_type(a, jnp.float32)
  return _scale_layout(amax, fmt, x.ndim)


def scales_from_amax(amax, fmt, *, tensor_amax=None) -> Scales:
  """The scales of blocks with largest magnitudes `amax`, by `fmt`'s rule.

  Args:
    amax: float32, the scales' shape (`block_amax`), or a scalar for a
      per-tensor format. Delayed scaling passes the maximum of an amax
      history here.
    fmt: a scaled format (name or `ScaledFormat`).
    tensor_amax: NVFP4 only: the amax behind `s_t` (default the largest
      `amax`); `6 * 448` gives `s_t = 1`, the block-only NVFP4 of Qwix.
  """
  return _scales_from_amax(amax, get_scaled_format(fmt), tensor_amax)


def _scales_from_amax(amax, fmt: ScaledFormat, tensor_amax=None) -> Scales:
  amax = jnp.asarray(amax, jnp.float32)
  amax = jnp.where(jnp.isfinite(amax), jnp.abs(amax), 0.0)
  top = fmt.max_finite
  if fmt.scale_type == "e8m0":
    k = _pow2_exponent(amax, top, fmt.rule, E8M0_MIN_EXP, E8M0_MAX_EXP)
    code = (k + 127).astype(jnp.uint8)
    return Scales(jax.lax.bitcast_convert_type(code, jnp.float8_e8m0fnu))
  if fmt.rule == "amax":
    s = jnp.maximum(amax / _opaque(top), np.float32(TENSOR_SCALE_MIN))
    return Scales(jnp.where(amax > 0, s, 1.0).reshape(()))
  t = jnp.max(amax, initial=0.0) if tensor_amax is None else tensor_amax
  t = jnp.asarray(t, jnp.float32)
  s_t = jnp.maximum(t / _opaque(6 * 448), np.float32(NVFP4_TENSOR_SCALE_MIN))
  s_t = jnp.where(t > 0, s_t, jnp.float32(1.0))
  s_b = _round_nearest(amax / (np.float32(6) * s_t), _E4M3, dtype=_E4M3.native)
  return Scales(s_b, s_t)


def _opaque(c):
  """A float32 constant XLA cannot fold into a division: under jit it
  turns `a / c` into `a * (1 / c)`, which is not correctly rounded."""
  return jax.lax.optimization_barrier(jnp.float32(c))


def compute_scales(x, fmt) -> Scales:
  """`scales_from_amax(block_amax(x, fmt), fmt)`: current scaling."""
  return _compute_scales(x, get_scaled_format(fmt))


def _compute_scales(x, fmt: ScaledFormat) -> Scales:
  return _scales_from_amax(_block_amax(x, fmt), fmt)


def _per_block(scales: Scales, fmt: ScaledFormat):
  """int32 exponents (E8M0) or float32 scales, shaped `(..., blocks, 1)`."""
  if fmt.scale_type == "e8m0":
    code = jax.lax.bitcast_convert_type(scales.block, jnp.uint8)
    return _scale_blocks(code.astype(jnp.int32) - 127, fmt)
  s = scales.block.astype(jnp.float32)
  if scales.tensor is not None:
    s = s * scales.tensor
  return _scale_blocks(s, fmt)


# ---- rounding -------------------------------------------------------------


def _float32(x):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f"expected a floating-point array, got dtype {x.dtype}; convert it "
      "with x.astype(jnp.float32) first"
    )
  return x.astype(jnp.float32)


def _divide(x, s):
  """`x / s`; zero (of `x`'s sign) where `s` is 0, non-finite `x` kept."""
  ok = s > 0
  y = x / jnp.where(ok, s, 1.0)
  zero = jnp.where(jnp.signbit(x), -0.0, 0.0).astype(jnp.float32)
  return jnp.where(ok | ~jnp.isfinite(x), y, zero)


def _round_blocks(x, fmt, mode, key, overflow, scales, bits=None):
  """`(q, overflowed, per, scales)`: element grid values in blocks, where
  they overflowed, the per-block scales and the `Scales`."""
  xb, bits, per, scales = _blocks(x, fmt, mode, key, overflow, scales, bits)
  if fmt.scale_type == "e8m0":
    y = ldexp(xb, -per)
  else:
    y = _divide(xb, per)
  q, over = _round_and_flag(y, fmt.element, bits, overflow)
  return q, over, per, scales


def _blocks(x, fmt, mode, key, overflow, scales, bits):
  """`(x, bits, per, scales)`: `x` and its random bits (None for nearest)
  in blocks, the per-block scales (`_per_block`) and the `Scales`."""
  x = _float32(x)
  if mode == "nearest":
    bits = None
  elif bits is not None:
    bits = _to_blocks(jnp.asarray(bits, jnp.uint32), fmt)
  else:
    if key is None:
      raise ValueError(
        f"stochastic rounding to {fmt.name} draws random bits and needs a "
        "PRNG key: pass key=jax.random.key(seed)"
      )
    bits = _to_blocks(rng_lib.random_bits(key, x.shape), fmt)
  xb = _to_blocks(x, fmt)
  if scales is None:
    scales = _compute_scales(x, fmt)
  return xb, bits, _per_block(scales, fmt), scales


def _once_per_block(k):
  """`k` (an integer array) itself, computed once per block: XLA:CPU
  would otherwise fuse the exponent's computation from the block amax
  into the elements' loop and repeat it for each of the block's elements.
  It does not repeat an integer division (an expensive op), here by a 1
  it cannot see."""
  one = jax.lax.optimization_barrier(jnp.ones((), k.dtype))
  return jax.lax.div(k, one)


def _scale_back(q, per, fmt: ScaledFormat):
  return ldexp(q, per) if fmt.scale_type == "e8m0" else q * per


def _resolved(fmt, mode: str, overflow: str) -> ScaledFormat:
  """`fmt` as a `ScaledFormat`, once `mode` and `overflow` are checked."""
  fmt = get_scaled_format(fmt)
  choices.check_choice("rounding mode", mode, MODES)
  choices.check_choice("overflow mode", overflow, OVERFLOW_MODES)
  return fmt


def quantize(
  x,
  fmt,
  mode: str = "nearest",
  key=None,
  *,
  overflow: str = "saturate",
  scales: Scales | None = None,
) -> Quantized:
  """Quantizes `x` into a scaled format: elements and scales.

  Per block, `elements = Q_E(x / scale)` with `scale` from `fmt`'s rule
  (module docstring) and `Q_E` nearest (ties to even) or stochastic
  rounding into the element format.

  Args:
    x: float array; the block axis length must be a multiple of the block.
    fmt: a scaled format name or `ScaledFormat`.
    mode: "nearest" or "stochastic".
    key: a JAX PRNG key, required by "stochastic".
    overflow: for elements past `max_E`: "saturate" (default) or "ieee".
    scales: use these scales instead of computing them from `x` (delayed
      scaling, or keeping a previous step's scales).

  Returns:
    `Quantized(elements, scales)`: elements in `fmt.element_dtype`, scales
      as in `Scales`.

  Raises:
    ValueError: an unknown format or mode, a missing key, or a block axis
      not divisible by the block size (the message says how to pad).

  Example:
    >>> q = quantize(jnp.ones((4, 32)), "mxfp4_e2m1")
    >>> float(q.scales.block.astype(jnp.float32)[0, 0])  # 2^(0 - 2)
    0.25
  """
  fmt = _resolved(fmt, mode, overflow)
  return _quantize(x, fmt, mode, key, overflow, scales)


# Jitted with the format static: one compiled program per format and shape
# rather than one dispatch per operation when called eagerly.
@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _quantize(x, fmt, mode, key, overflow, scales):
  dtype = fmt.element_dtype
  if dtype != np.float32 and fmt.scale_type == "e8m0":
    # One-byte codes straight from x's bits and the block exponents: the
    # codes of rounding ldexp(x, -k) without forming it (on XLA:CPU the
    # ldexp cost more than the rest of the rounding).
    xb, bits, per, scales = _blocks(x, fmt, mode, key, overflow, scales, None)
    k = _once_per_block(per)
    q = _round_scaled_code(xb, k, fmt.element, bits, overflow, dtype)
    if q is not None:
      return Quantized(_from_blocks(q, x.shape, fmt), scales)
  q, _, _, scales = _round_blocks(x, fmt, mode, key, overflow, scales)
  q = _from_blocks(q, x.shape, fmt)
  if dtype != np.float32:
    q = _round_nearest(q, fmt.element, "ieee", dtype)
  return Quantized(q, scales)


def dequantize(q: Quantized, fmt) -> jax.Array:
  """The float32 values `elements * scale` of a `Quantized` (exact for
  power-of-two scales; float32 products otherwise)."""
  return _dequantize(q, get_scaled_format(fmt))


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q, fmt):
  e = q.elements.astype(jnp.float32)
  v = _scale_back(_to_blocks(e, fmt), _per_block(q.scales, fmt), fmt)
  return _from_blocks(v, e.shape, fmt)


def fake_quantize(
  x,
  fmt,
  mode: str = "nearest",
  key=None,
  *,
  overflow: str = "saturate",
  scales: Scales | None = None,
) -> jax.Array:
  """`dequantize(quantize(x, ...))` in one pass: float32 values of `x`'s
  shape on the scaled grid. Arguments as in `quantize`.

  Example:
    >>> x = jnp.array([[3.0, 7.0, 30.0, 100.0] * 4])
    >>> fake_quantize(x, "nvfp4")[0, :4]  # s_t s_b = 100 / 6
    Array([  0.      ,   8.333333,  33.333332, 100.      ], dtype=float32)
  """
  fmt = _resolved(fmt, mode, overflow)
  return _fake_quantize(x, fmt, mode, key, overflow, scales)[0]


def fake_quantize_and_scales(
  x,
  fmt,
  mode="nearest",
  key=None,
  *,
  overflow="saturate",
  scales=None,
  bits=None,
) -> tuple[jax.Array, jax.Array, Scales]:
  """`(values, overflowed, scales)`: `fake_quantize`'s values, a mask of
  the elements (finite or infinite) that saturated (or overflowed under
  "ieee"), and the scales used. `bits` (uint32, `x`'s shape) replaces the
  key's random bits for stochastic rounding, as in
  `lowprec.grids.rounding.round_with_bits`."""
  fmt = _resolved(fmt, mode, overflow)
  return _fake_quantize(x, fmt, mode, key, overflow, scales, bits)


@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _fake_quantize(
  x,
  fmt: ScaledFormat,
  mode="nearest",
  key=None,
  overflow="saturate",
  scales=None,
  bits=None,
):
  """`fake_quantize_and_scales` of a resolved `fmt` and checked choices."""
  q, over, per, scales = _round_blocks(
    x, fmt, mode, key, overflow, scales, bits
  )
  v = _from_blocks(_scale_back(q, per, fmt), x.shape, fmt)
  return v, _from_blocks(over, x.shape, fmt), scales


def move_probability(w, x, fmt) -> jax.Array:
  """P(stochastic write-back of `x` moves the grid value `w`), per element.

  The grid is that of the block scales computed from `x` (a write-back
  that recomputes its scales). Where `w` is on it, with `gap` the element
  format's gap at `w / scale` in the direction of `x`:

    P = min(1, |x - w| / (scale * gap))

  (0 where `x == w`, 0 past the top, where stochastic rounding
  saturates), computed in element units, exactly scaled; where the new
  scale put `w` off the grid, every outcome moves it and `P = 1`. Only
  power-of-two (MX) scales.

  Args:
    w: float32 values on the scaled grid of their own scales.
    x: float32, `w`'s shape: the values to be written (`w + u`).
    fmt: an MX scaled format (name or `ScaledFormat`).

  Raises:
    ValueError: a format whose scales are not powers of two.
  """
  fmt = get_scaled_format(fmt)
  if fmt.scale_type != "e8m0":
    raise ValueError(
      f"move_probability needs power-of-two (MX) scales, not {fmt.name}'s"
    )
  return _move_probability(_float32(w), _float32(x), fmt)


@functools.partial(jax.jit, static_argnums=2)
def _move_probability(w, x, fmt):
  per = _per_block(_compute_scales(x, fmt), fmt)
  wb, xb = ldexp(_to_blocks(w, fmt), -per), ldexp(_to_blocks(x, fmt), -per)
  e = fmt.element
  on_grid = _round_nearest(wb, e) == wb
  gap = jnp.where(xb > wb, e.gap_up(wb), e.gap_down(wb))
  p = jnp.minimum(jnp.abs(xb - wb) / gap, 1.0)
  p = jnp.where(xb == wb, 0.0, jnp.where(on_grid, p, 1.0))
  return _from_blocks(p.astype(jnp.float32), w.shape, fmt)

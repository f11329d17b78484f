"""Rounding onto a format's grid: nearest and stochastic.

Both functions take float32 (or float64 under x64; narrower floats are widened
to float32) and return an array of the same shape and carrier dtype holding
grid values exactly. They work on integer bit patterns, so they are exact for
subnormals on every backend and XLA cannot optimise them away under jit.

The public functions take a format name or a `Format` and check their
choices; each then calls a twin with a leading underscore (`_round_nearest`,
`_round_to`, `_round_and_flag`, `_round_scaled_code`) that takes a resolved
`Format` and checked choices. `lowprec.grids.scaled` and
`lowprec.engine.codec`, which hold resolved formats already, call the twins.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.grids import _bits, choices
from lowprec.grids import rng as rng_lib
from lowprec.grids.formats import Format, get_format

OVERFLOW_MODES = ("saturate", "ieee")
# How a write-back rounds w + u (lowprec.writeback, lowprec.freeze targets).
ROUNDINGS = ("nearest", "stochastic", "deadzone")


def _check_overflow(overflow: str) -> None:
  choices.check_choice("overflow mode", overflow, OVERFLOW_MODES)


def _emit(q: jax.Array, fmt: Format, dtype) -> jax.Array:
  """`q` (grid values in the carrier) as `dtype`: the carrier (None), or
  the format's native dtype, which holds every grid value exactly."""
  if dtype is None:
    return q
  dtype = jnp.dtype(dtype)
  if dtype == q.dtype:
    return q
  if fmt.native_dtype is None or dtype != fmt.native_dtype:
    native = fmt.native_dtype.name if fmt.native_dtype is not None else None
    valid = ", ".join(n for n in (q.dtype.name, native) if n)
    raise ValueError(
      f"dtype={dtype.name} does not hold the {fmt} grid exactly; valid: "
      f"{valid} (or None for {q.dtype.name})"
    )
  # q is on the grid (saturated or inf/NaN by `overflow` already), so the
  # cast is exact; building the code from q's bits is exact too and lets
  # XLA write the narrow value in the same pass as the rounding.
  if q.dtype == jnp.float32 and fmt.bits == 8 * dtype.itemsize:
    return _native_code(q, fmt, dtype)
  return q.astype(dtype)


def _native_code(q: jax.Array, fmt: Format, dtype) -> jax.Array:
  """The native code of float32 grid values `q`, built from their bits."""
  m, width = fmt.man_bits, fmt.bits
  code_t = jnp.uint8 if width == 8 else jnp.uint16
  b = jax.lax.bitcast_convert_type(q, jnp.uint32)
  a = b & jnp.uint32(0x7FFFFFFF)
  if fmt.exp_bits == 8:  # the target's exponent range is float32's
    mag = a >> jnp.uint32(23 - m)
  else:
    e = (a >> jnp.uint32(23)).astype(jnp.int32) - 127
    normal = ((e - fmt.emin + 1).astype(jnp.uint32) << jnp.uint32(m)) | (
      (a & jnp.uint32(0x7FFFFF)) >> jnp.uint32(23 - m)
    )
    # Below the smallest normal the code counts steps of 2**(emin - m):
    # an exact power-of-two scaling of a value far above float32's
    # subnormals.
    steps = (jnp.abs(q) * np.float32(2.0 ** (m - fmt.emin))).astype(jnp.uint32)
    mag = jnp.where(e >= fmt.emin, normal, steps)
  sign = (b >> jnp.uint32(31)) << jnp.uint32(width - 1)
  code = (mag | sign).astype(code_t)
  if fmt.has_inf:
    inf = np.array(np.inf, dtype).view(code_t)
    code = jnp.where(jnp.isinf(q), code_t(inf) | sign.astype(code_t), code)
  if fmt.has_nan:
    nan = np.array(np.nan, dtype).view(code_t)
    code = jnp.where(jnp.isnan(q), code_t(nan), code)
  return jax.lax.bitcast_convert_type(code, dtype)


def _direct(fmt: Format, carrier, dtype) -> bool:
  """Whether `_code_direct` emits `dtype` for `fmt`: a one-byte float code
  with a mantissa and NaN, from float32."""
  return (
    carrier == jnp.float32
    and fmt.is_float
    and fmt.native_dtype is not None
    and dtype == fmt.native_dtype
    and fmt.bits == 8 == 8 * dtype.itemsize
    and 1 <= fmt.man_bits
    and fmt.exp_bits < 8
    and fmt.has_nan
  )


def _code_direct(
  x: jax.Array, fmt: Format, bits, overflow: str, dtype, exp_shift=None
):
  """Rounds float32 `x` straight to the one-byte code of `dtype`.

  The same values as `round_and_flag` followed by `_native_code`, bit for
  bit, in fewer operations: the significand `sig` of |x| (implicit bit
  included) holds the target's code in its top bits once the `s`
  discarded bits are dropped, `s` being `23 - m` in the target's normal
  range and more below it. Rounding adds to `sig` what carries into the
  kept bits exactly when the rounding goes up: for nearest, half a step
  less one, plus one if the kept part is odd (ties to even); for
  stochastic, `2**s - 1 - (bits >> (32 - s))`, which carries iff
  `bits < frac` for the fixed-point fraction `frac` of the discarded part
  (its low `32 - s` bits are zero). Where 32 or more bits are discarded
  the code is 0 or, for stochastic rounding, 1 with `bits < frac`.

  `exp_shift` (int32, broadcasting against `x`) rounds `x * 2**-exp_shift`
  instead, exactly, by moving the target's exponent (subnormal `x`
  normalised first): the scaled value is never formed, so it neither
  overflows nor loses subnormal bits (see `round_scaled_code`).
  Non-finite `x` is not shifted.
  """
  m = fmt.man_bits
  u32 = jnp.uint32
  b = jax.lax.bitcast_convert_type(x, u32)
  a = b & u32(0x7FFFFFFF)
  biased = (a >> u32(23)).astype(jnp.int32)
  if exp_shift is not None:
    exp_shift = jnp.where(biased < 255, exp_shift, 0)
    # A float32 subnormal `a * 2**-149` is the normal float `a` shifted by
    # 149 more (the shift may bring it into the target's normal range,
    # where the code needs the implicit bit); `a < 2**23` converts exactly.
    sub = biased == 0
    an = a.astype(jnp.int32).astype(jnp.float32)
    a = jnp.where(sub, jax.lax.bitcast_convert_type(an, u32), a)
    exp_shift = exp_shift + jnp.where(sub, 149, 0)
    biased = (a >> u32(23)).astype(jnp.int32)
  sig = (a & u32(0x7FFFFF)) | jnp.where(biased != 0, u32(1 << 23), u32(0))
  t = jnp.maximum(biased, 1) - (127 - fmt.bias)  # the target's biased exp.
  if exp_shift is not None:
    t = t - exp_shift
  s = (23 - m) + jnp.maximum(1 - t, 0)
  # Shifts by 32 or more give 0 (XLA's semantics); those lanes take `deep`.
  sk = s.astype(u32)
  if bits is None:
    carry = (u32(0x7FFFFFFF) >> (u32(32) - sk)) + ((sig >> sk) & u32(1))
    deep = jnp.zeros_like(sig)
  else:
    bits = bits.astype(u32)
    # 2**s - 1 - (bits >> (32 - s)), in one shift.
    carry = ~bits >> (u32(32) - sk)
    deep = (bits < (sig >> (s - 32).astype(u32))).astype(u32)
  k = jnp.where(s < 32, (sig + carry) >> sk, deep)
  code = ((jnp.maximum(t, 1) - 1).astype(u32) << u32(m)) + k

  def code_of(value) -> int:
    return int(np.array(value, np.float32).astype(dtype).view(np.uint8))

  max_code = code_of(fmt.max_finite)
  nan_code = code_of(np.nan)
  over = code > u32(max_code)
  to_nan = overflow == "ieee" and not fmt.has_inf
  if overflow == "ieee" and fmt.has_inf:
    code = jnp.where(over, u32(code_of(np.inf)), code)
  else:
    code = jnp.minimum(code, u32(max_code))
  sign = (b >> u32(31)) << u32(7)
  if not fmt.has_negative_zero:
    sign = jnp.where(code == 0, u32(0), sign)
  code = code | sign
  nan = jnp.isnan(x) | over if to_nan else jnp.isnan(x)
  code = jnp.where(nan, u32(nan_code), code)
  return jax.lax.bitcast_convert_type(code.astype(jnp.uint8), dtype)


def round_scaled_code(
  x, exp_shift, fmt, bits=None, *, overflow: str = "saturate", dtype
) -> jax.Array | None:
  """`round_with_bits(ldexp(x, -exp_shift), fmt, bits, dtype=dtype)` in one
  pass, for a one-byte float `dtype` (None where that path does not apply).

  Nearest rounding when `bits` is None. The same codes, bit for bit, as
  scaling `x` by the power of two first wherever that scaling is exact; a
  scaled value below float32's normal range rounds to a signed zero either
  way (it is more than 32 bits below the smallest subnormal of every
  one-byte format). Cheaper: the scaled value is never formed.
  """
  fmt = get_format(fmt)
  _check_overflow(overflow)
  return _round_scaled_code(x, exp_shift, fmt, bits, overflow, dtype)


def _round_scaled_code(x, exp_shift, fmt: Format, bits, overflow: str, dtype):
  """`round_scaled_code` of a resolved `fmt` and a checked `overflow`."""
  dtype = jnp.dtype(dtype)
  if x.dtype != jnp.float32 or not _direct(fmt, x.dtype, dtype):
    return None
  return _code_direct(x, fmt, bits, overflow, dtype, exp_shift)


def round_nearest(
  x, fmt, *, overflow: str = "saturate", dtype=None
) -> jax.Array:
  """Rounds to the nearest grid value, ties to even.

  For named formats this equals the `ml_dtypes` cast bit for bit on every
  finite input when `overflow="ieee"`.

  Args:
    x: float array (float32, or float64 with x64 enabled).
    fmt: a format name or `Format`.
    overflow: "saturate" clips values beyond the largest finite value (and
      infinities) to +-max; "ieee" does what a cast does: inf, or NaN where
      the format has no inf (formats with neither saturate, as their casts
      do). NaN stays NaN in both modes.
    dtype: the output dtype: None (the carrier, float32 or float64) or the
      format's native dtype (e.g. `jnp.float8_e4m3fn`), so that nothing
      wider than the stored value is written.

  Returns:
    An array of `x`'s shape holding grid values, in the carrier dtype or
      `dtype`.

  Raises:
    TypeError: non-float input.
    ValueError: unknown format or overflow mode.

  Example:
    ```python
    round_nearest(jnp.array([1.06, 1.07, 500.0]), "float8_e4m3fn")
    # Array([  1.  ,   1.125, 448.  ], dtype=float32)
    ```
  """
  fmt = get_format(fmt)
  _check_overflow(overflow)
  return _round_nearest(x, fmt, overflow, dtype)


def _round_nearest(x, fmt: Format, overflow: str = "saturate", dtype=None):
  """`round_nearest` of a resolved `fmt` and a checked `overflow`."""
  return _round_to(x, fmt, None, overflow, dtype)


def round_stochastic(
  x, fmt, key, *, overflow: str = "saturate", rng: str = "hash", dtype=None
) -> jax.Array:
  """Rounds up or down at random, unbiased: `E[round_stochastic(x)] = x`.

  Between grid neighbours `lo < x < hi` the result is `hi` with probability
  `(x - lo) / (hi - lo)` and `lo` otherwise; grid values stay put.

  Random bits: 32 per element (64 for float64 input), from a counter-based
  hash of (`key`, global element index), so the result is the same eager or
  jitted and sharded or not. The up-probability is compared in 32-bit fixed
  point against the exact discarded bits of `x`: for float32 input whose
  discarded part fits in 32 bits (every normal of the target and the upper
  subnormals) the probability is exact, so the rounding is exactly unbiased;
  deeper in the subnormal range it is truncated to a multiple of `2**-32`, a
  bias of at most `2**-32 * (hi - lo)` toward zero. For `intK` the fraction
  is computed in float32 and compared with 24 random bits: bias at most
  `2**-24 * scale` plus float32 error in `x / scale`.

  Args:
    x: float array (float32, or float64 with x64 enabled).
    fmt: a format name or `Format`.
    key: a JAX PRNG key; reuse it only where you want the same draw.
    overflow: as in `round_nearest`; a round up past the largest finite value
      saturates or overflows by the same rule.
    rng: "hash" (default) or "threefry" (`jax.random.bits`, slower, and not
      sharding-invariant in general).
    dtype: the output dtype, as in `round_nearest`.

  Example:
    ```python
    key = jax.random.key(0)
    x = jnp.full((100_000,), 1.03125)  # a quarter of the way to 1.125
    float(round_stochastic(x, "float8_e4m3fn", key).mean())  # ~1.03125
    ```
  """
  fmt = get_format(fmt)
  _check_overflow(overflow)
  x, lay = _bits.carrier(x)
  bits = rng_lib.random_bits(key, x.shape, rng=rng, width=lay.width)
  return _round_to(x, fmt, bits, overflow, dtype)


def round_with_bits(
  x, fmt, bits, *, overflow: str = "saturate", dtype=None
) -> jax.Array:
  """Stochastic rounding with caller-supplied uniform bits.

  Rounds up iff `bits < frac`, where `frac` is the position of |x| between its
  neighbours as a fixed-point fraction of the carrier width. Useful to inject
  known bits (tests, reproducing another library's draw). `dtype` as in
  `round_nearest`.
  """
  fmt = get_format(fmt)
  _check_overflow(overflow)
  return _round_to(x, fmt, bits, overflow, dtype)


def _round_to(x, fmt: Format, bits, overflow: str, dtype) -> jax.Array:
  """Nearest (`bits` None) or stochastic rounding, emitted as `dtype`."""
  x, _ = _bits.carrier(x)
  if dtype is not None and _direct(fmt, x.dtype, dtype := jnp.dtype(dtype)):
    return _code_direct(x, fmt, bits, overflow, dtype)
  return _emit(_round_and_flag(x, fmt, bits, overflow)[0], fmt, dtype)


def round_and_flag(
  x, fmt, bits=None, *, overflow: str = "saturate"
) -> tuple[jax.Array, jax.Array]:
  """Rounds (nearest if `bits` is None, else stochastic with `bits`).

  Returns:
    `(rounded, overflowed)`: the rounded array and a boolean mask of the
      finite-or-infinite inputs whose rounding went past the largest finite
      value (and was saturated or turned into inf/NaN by `overflow`).
  """
  fmt = get_format(fmt)
  _check_overflow(overflow)
  return _round_and_flag(x, fmt, bits, overflow)


def _round_and_flag(x, fmt: Format, bits, overflow: str):
  """`round_and_flag` of a resolved `fmt` and a checked `overflow`."""
  x, lay = _bits.carrier(x)
  if not fmt.is_float:
    k = x / jnp.asarray(fmt.scale, x.dtype)
    if bits is None:
      k = jnp.round(k)
    else:
      lo = jnp.floor(k)
      r24 = (bits >> (lay.width - 24)).astype(x.dtype) * 2.0**-24
      k = lo + (r24 < k - lo).astype(x.dtype)
    return _finish_int(x, k, fmt)
  b = _bits.to_bits(x, lay)
  a = b & _bits.u(lay.sign_mask - 1, lay)
  br = _bits.bracket(a, fmt, lay)
  if bits is None:
    half = _bits.u(1 << (lay.width - 1), lay)
    up = (br.frac > half) | ((br.frac == half) & br.odd)
  else:
    up = bits.astype(lay.uint) < br.frac
  return _finish(x, b, jnp.where(up, br.hi, br.lo), fmt, lay, overflow)


def _finish(x, b, mag, fmt: Format, lay, overflow: str) -> jax.Array:
  """Applies overflow, the format's zero sign, and NaN passthrough."""
  max_bits = _bits.u(lay.bits_of(fmt.max_finite), lay)
  over = mag > max_bits
  if overflow == "saturate" or not (fmt.has_inf or fmt.has_nan):
    over_val = max_bits
  elif fmt.has_inf:
    over_val = _bits.u(lay.inf_bits, lay)
  else:
    over_val = _bits.u(lay.inf_bits | (1 << (lay.man - 1)), lay)
  mag = jnp.where(over, over_val, mag)
  sign = b & _bits.u(lay.sign_mask, lay)
  if not fmt.has_negative_zero:
    sign = jnp.where(mag == 0, jnp.zeros_like(sign), sign)
  out = _bits.from_bits(mag | sign, lay)
  nan = jnp.isnan(x)
  return jnp.where(nan, x, out), over & ~nan


def _finish_int(x, k, fmt: Format):
  over = jnp.abs(k) > fmt.int_max
  k = jnp.clip(k, -fmt.int_max, fmt.int_max)
  out = k * jnp.asarray(fmt.scale, x.dtype)
  nan = jnp.isnan(x)
  return jnp.where(nan, x, out), over & ~nan

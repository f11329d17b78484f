"""The store step: a float32 value onto a low-precision grid, with counts.

Every quantity lowprec keeps on a grid between optimizer steps (a weight,
a Kahan buffer, a two-component error term, a stored moment) goes through
the same step: a float32 value `x` is rounded onto the grid that a `Codec`
describes, given the value `old` the store held before and, for a random
rounding, 32 random bits per element. The transforms differ only in what
they feed it (`w + u`, a residual, Adam's new moment) and what they keep
(the rounded weight as a float32 delta, the code and its scales).

A `Codec` is what one leaf is stored as: a format (`Format`, an MX
`ScaledFormat`, or a `lowprec.grids.codemaps.CodeMap`), a rounding (`nearest`,
`stochastic`, `deadzone`), a scale (none, one per tensor or per block of
the last axis) with its rule (`pow2`, a power of two; `amax`, the block's
largest magnitude over the format's) and its dtype (float32, float16),
the overflow mode and the carrier (the format's own dtype where it has
one, `native`, or float32 holding grid values). `encode` rounds, `decode`
reads back, `stored_dtype` and `nbytes` give the storage; `pack` and
`unpack` put 4-bit codes two to a byte and back.

`land` turns a rounded weight into the float32 delta that
`optax.apply_updates` lands exactly (weights are kept by their optimizer,
not by us); `tally` counts masks in one reduction (`lowprec.counting`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.engine.counting import count as tally
from lowprec.grids import _ieee, choices, scaled
from lowprec.grids.codemaps import CodeMap
from lowprec.grids.formats import Format
from lowprec.grids.rounding import OVERFLOW_MODES, ROUNDINGS, _round_and_flag
from lowprec.grids.scaled import ScaledFormat

__all__ = [
  "Codec",
  "Encoded",
  "decode",
  "encode",
  "land",
  "pack",
  "tally",
  "unpack",
]

CARRIERS = ("native", "float32")
SCALE_RULES = ("pow2", "amax")
SCALE_DTYPES = ("float32", "float16")
_F16_MAX = 65504.0


def stored_dtype(fmt: Format, carrier: str = "native") -> np.dtype:
  """The dtype a leaf on `fmt` is kept in: the format's own where it has
  one of its width and `carrier` is "native", else float32."""
  native = getattr(fmt, "native_dtype", None)
  if carrier == "native" and native is not None:
    if fmt.bits == 8 * np.dtype(native).itemsize:
      return np.dtype(native)
  return np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Codec:
  """What one leaf is stored as (hashable: static under jit).

  Attributes:
    fmt: the grid, a `Format` or an MX `ScaledFormat` (whose block scales
      follow the value, `lowprec.scaled`), or a `CodeMap` (codes under
      the block's largest magnitude, `lowprec.codemaps`).
    rounding: "nearest", "stochastic" or "deadzone" (stochastic only where
      nearest would leave the stored value as it was).
    scale: None, "tensor" (one scale per tensor) or a block size (one per
      block of that many elements along the last axis). Not with a
      `ScaledFormat`, which scales itself; required by a `CodeMap`.
    overflow: "saturate" or "ieee" (`lowprec.grids.rounding`).
    carrier: "native" (the format's dtype where it has one) or "float32".
    keep_scales: a `ScaledFormat` rounds onto the block scales of `old`
      rather than of the new value (`writeback(scales="keep")`).
    scale_rule: "pow2" (default): the smallest power of two `p` with
      `amax / p <= max_E`, applied by float division; "amax": `amax /
      max_E` (float32 division; at least 2^-126, 1 for a block of zeros),
      so the block's largest value lands on `max_E`. A `CodeMap` is
      normalized by `amax` itself (`max_E = 1`; 0 for a block of zeros).
    scale_dtype: "float32" or "float16" (amax only): a float16 scale is
      `amax / max_E` rounded up to a float16 (at least 2^-24, at most
      65504, past which the block saturates), and the block is divided by
      the scale it is stored with.
  """

  fmt: Format | ScaledFormat | CodeMap
  rounding: str = "nearest"
  scale: str | int | None = None
  overflow: str = "saturate"
  carrier: str = "native"
  keep_scales: bool = False
  scale_rule: str = "pow2"
  scale_dtype: str = "float32"

  def __post_init__(self):
    choices.check_choice("rounding", self.rounding, ROUNDINGS)
    choices.check_choice("overflow mode", self.overflow, OVERFLOW_MODES)
    choices.check_choice("carrier", self.carrier, CARRIERS)
    choices.check_choice("scale rule", self.scale_rule, SCALE_RULES)
    choices.check_choice("scale dtype", self.scale_dtype, SCALE_DTYPES)
    if self.mapped and (self.scale is None or self.scale_rule != "amax"):
      raise ValueError(
        f"code map {self.fmt.name!r} is normalized by the largest magnitude "
        "of a block or tensor: Codec(map, scale=256 or 'tensor', "
        "scale_rule='amax')"
      )
    if self.scale_rule == "amax" and self.scale is None:
      raise ValueError("scale_rule='amax' needs a scale: 'tensor' or a block")
    if self.scale_dtype == "float16" and self.scale_rule != "amax":
      raise ValueError(
        "float16 scales are rounded-up amax scales: scale_rule='amax' "
        "(power-of-two scales are float32)"
      )

  @property
  def random(self) -> bool:
    """Whether `encode` needs random bits."""
    return self.rounding != "nearest"

  @property
  def scaled(self) -> bool:
    """Whether the grid is an MX scaled format."""
    return isinstance(self.fmt, ScaledFormat)

  @property
  def mapped(self) -> bool:
    """Whether the leaf is stored as the codes of a `CodeMap`."""
    return isinstance(self.fmt, CodeMap)

  def dtype(self) -> np.dtype:
    """The dtype of the stored code."""
    if self.scaled:
      return np.dtype(np.float32)
    if self.carrier == "float32":
      return np.dtype(np.float32)
    if self.mapped:
      return np.dtype(self.fmt.code_dtype)
    if self.scale_rule == "amax" and not self.fmt.is_float:
      return np.dtype(np.int8)  # intK codes under an amax scale
    return stored_dtype(self.fmt, self.carrier)

  @property
  def packed(self) -> bool:
    """Whether two codes share a byte when stored (`pack`): 4-bit code
    maps (`dynamic4`, `uint4nz`) and 4-bit integers under an amax scale."""
    if self.scaled or self.carrier == "float32":
      return False
    if self.mapped:
      return self.fmt.bits == 4
    return self.dtype() == np.int8 and self.fmt.bits <= 4

  def nbytes(self, shape) -> int:
    """Bytes of a leaf of `shape` as stored: its code (two to a byte where
    `packed`) and its scales."""
    shape = tuple(int(d) for d in shape)
    stored = packed_shape(shape) if self.packed else shape
    n = int(np.prod(stored, dtype=np.int64))
    per_scale = np.dtype(self.scale_dtype).itemsize
    return n * self.dtype().itemsize + per_scale * _scale_count(
      shape, self.scale
    )


def packed_shape(shape) -> tuple[int, ...]:
  """The shape `pack` stores a code array of `shape` in: the last axis
  halved, rounded up (a scalar as one byte)."""
  shape = tuple(shape)
  if not shape:
    return (1,)
  return (*shape[:-1], -(-shape[-1] // 2))


def pack(codec: Codec, code):
  """`code` as stored: where `codec.packed`, two 4-bit codes to a uint8
  byte along the last axis, as PyTorch's 4-bit optimizers keep them:
  element `2k` of a row in the low nibble of byte `k`, `2k + 1` in the
  high one (a zero nibble after an odd last element); else `code`.

  Each pair is read as one uint16 (a bitcast, little-endian: element
  `2k` is its low byte), so the pairing is arithmetic on whole words:
  XLA:CPU fuses it into the encoding at full vector width, where
  slicing or interleaving the row made the fused loop 3x slower."""
  if not codec.packed:
    return code
  c = jnp.atleast_1d(jnp.asarray(code)).astype(jnp.uint8) & jnp.uint8(0xF)
  if c.shape[-1] % 2:
    c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, 1)])
  pairs = c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2)
  word = jax.lax.bitcast_convert_type(pairs, jnp.uint16)
  packed = (word & jnp.uint16(0x000F)) | ((word >> 4) & jnp.uint16(0x00F0))
  return packed.astype(jnp.uint8)


def unpack(codec: Codec, stored, shape):
  """The codes `pack` stored, of `shape`, in `codec.dtype()`."""
  if not codec.packed:
    return stored
  b = jnp.asarray(stored).astype(jnp.uint8)
  # Stacked nibbles: a store's several readers of a moment then share
  # one pass that writes the codes (measured faster on XLA:CPU than
  # unpacking 16-bit words inside each reader's loop).
  pairs = jnp.stack([b & jnp.uint8(0xF), b >> jnp.uint8(4)], axis=-1)
  c = pairs.reshape(*b.shape[:-1], 2 * b.shape[-1])
  shape = tuple(shape)
  c = c[..., : shape[-1]] if shape else c[..., 0]
  if codec.dtype() == np.int8:  # signed nibbles
    c = jnp.where(c >= 8, c.astype(jnp.int32) - 16, c.astype(jnp.int32))
  return c.astype(codec.dtype())


class Encoded(NamedTuple):
  """One leaf after `encode`."""

  code: jax.Array  # what is stored, in `Codec.dtype()`
  scales: jax.Array | None  # `Codec.scale_dtype` scales, else None
  value: jax.Array  # float32: what the code stands for, `decode(code)`
  over: jax.Array  # bool: the rounding went past the format's largest value
  block_scales: scaled.Scales | None = None  # a ScaledFormat's, else None


def encode(codec: Codec, x, old=None, bits=None) -> Encoded:
  """Rounds float32 `x` onto `codec`'s grid.

  `old` is the float32 value the store held (None at the first store):
  dead-zone rounding is stochastic exactly where nearest would give `old`
  back while `x != old`, and `keep_scales` reads `old`'s block scales.
  `bits` are 32 random bits per element, for a random rounding.
  """
  x = jnp.asarray(x, jnp.float32)
  if codec.scaled:
    return _encode_scaled(codec, x, old, bits)
  if codec.mapped:
    return _encode_mapped(codec, x, old, bits)
  scales = None
  if codec.scale is not None:
    scales = (_pow2_scales if codec.scale_rule == "pow2" else _amax_scales)(
      x, codec
    )
  per = None if scales is None else _spread(scales, x.shape, codec.scale)
  if codec.scale_rule == "amax":
    per = per.astype(jnp.float32)
  y = x if per is None else _quotient(codec, x, per)
  q, over, v = rounded(codec, x, y, per, old, bits)
  return Encoded(q.astype(codec.dtype()), scales, v, over)


def rounded(codec: Codec, x, y, per, old, bits):
  """`(q, over, v)`: `y = x / per` rounded onto the format by `codec`'s
  rounding (dead zone: stochastic where nearest gives `old` back), its
  overflow flag and its value under the scale `per` (None: none). Shared
  with a kernel that computes `y` and `per` its own way."""
  sr = bits if codec.rounding == "stochastic" else None
  q, over = _round_and_flag(y, codec.fmt, sr, codec.overflow)
  v = q if per is None else _product(codec, q, per)
  if codec.rounding == "deadzone" and old is not None:
    q_sr, over_sr = _round_and_flag(y, codec.fmt, bits, codec.overflow)
    stuck = (v == old) & (x != old)
    q = jnp.where(stuck, q_sr, q)
    over = jnp.where(stuck, over_sr, over)
    v = q if per is None else _product(codec, q, per)
  return q, over, v


def _quotient(codec: Codec, x, per):
  """`x / per`, correctly rounded.

  A power of two divides exactly however XLA computes it. A product with
  its reciprocal (one a block, made on the scale's bits) gives the same
  quotient wherever the reciprocal is a normal float32, and fuses into
  the encoding where the division is a fusion of its own; but it let
  XLA:CPU recompute Adam's new second moment in more than one fusion,
  and on 8 devices one copy contracted a product into an FMA that the
  single device's did not: one parameter an ulp off after three steps
  (tests/state_storage_test.py's eight-device test, e5m2 blocks of 32).
  So the division stays."""
  if codec.scale_rule == "pow2":
    return _ieee.div(x, per)
  return _divide(x, per)


def _product(codec: Codec, q, per):
  # A power of two multiplies exactly, so an FMA with it changes nothing.
  return q * per if codec.scale_rule == "pow2" else _kept(q * per)


def _divide(a, b):
  """IEEE `a / b`. XLA rewrites a division by a broadcast (of a constant,
  or of a scale per tensor, or per block where a device holds part of
  one) as a product with the rounded reciprocal: 1 ulp off for half the
  quotients by 448, and on some shardings but not others. A select in
  between (which returns every value, NaN as NaN) makes a runtime
  divisor no broadcast, and unlike an optimization barrier it still
  fuses. In a kernel traced for Triton (`lowprec.grids._ieee.ptx`), PTX's
  correctly rounded division."""
  if _ieee.active():
    return _ieee.div(a, b)
  if isinstance(b, int | float | np.ndarray | np.generic):
    # XLA folds a select of a constant: keep a constant opaque with a
    # barrier (small arrays: the per-block scales).
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), jnp.shape(a))
    return a / jax.lax.optimization_barrier(b)
  b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), jnp.shape(a))
  return a / jnp.where(jnp.isnan(b), jnp.float32(jnp.nan), b)


def _kept(v):
  """`v` through the select of `decode` (no FMA contracts its product)."""
  return jnp.where(jnp.isnan(v), jnp.float32(jnp.nan), v)


def decode(codec: Codec, code, scales=None) -> jax.Array:
  """The float32 values a stored code stands for.

  The scale's product is read through a select (which returns every
  value, NaN as NaN): XLA:CPU contracts a multiply that feeds an add in
  the same fusion into an FMA, and a reader such as Adam's `b2 * nu +
  (1 - b2) g^2` would otherwise contract one product or the other
  depending on the fusion, hence on the sharding.
  """
  if codec.mapped:
    per = jnp.asarray(scales, jnp.float32)
    per = _spread(per, jnp.shape(code), codec.scale)
    return _kept(codec.fmt.value(codec.fmt.index_of(code), per))
  v = jnp.asarray(code).astype(jnp.float32)
  if scales is None:
    return v
  v = v * _spread(jnp.asarray(scales, jnp.float32), v.shape, codec.scale)
  return _kept(v)


def _encode_scaled(codec: Codec, x, old, bits) -> Encoded:
  """`x` onto the MX grid of scales from `x` itself, or from `old` under
  `keep_scales`."""
  fmt = codec.fmt
  kept = scaled._compute_scales(old, fmt) if codec.keep_scales else None
  mode = "nearest" if codec.rounding == "nearest" else "stochastic"
  sr_bits = None if mode == "nearest" else bits
  q, over, sc = scaled._fake_quantize(
    x, fmt, mode, overflow=codec.overflow, bits=sr_bits, scales=kept
  )
  if codec.rounding == "deadzone":
    q_rn, over_rn, _ = scaled._fake_quantize(
      x, fmt, overflow=codec.overflow, scales=kept
    )
    erased = q_rn == old
    q = jnp.where(erased, q, q_rn)
    over = jnp.where(erased, over, over_rn)
  if codec.keep_scales and fmt.rule == "ocp":
    # Only a block whose maximum fell to the top of the binade below
    # its scale's is off the grid of its own (halved) scale; putting it
    # there saturates that maximum. The identity on every other block.
    q, over_own, _ = scaled._fake_quantize(q, fmt, overflow=codec.overflow)
    over = over | over_own
  return Encoded(q, None, q, over, sc)


def _scale_count(shape, how) -> int:
  if how is None:
    return 0
  if how == "tensor" or not len(shape):
    return 1
  rows = int(np.prod(shape[:-1], dtype=np.int64))
  return rows * -(-int(shape[-1]) // int(how))


def _spread(scale, shape, how):
  """Per-element scales from per-block or per-tensor ones."""
  if how == "tensor" or not shape:
    return scale
  return jnp.repeat(scale, how, axis=-1)[..., : shape[-1]]


def _block_max(a, how):
  """The largest of 0 and the entries of `a` per block of the last axis
  (or of the tensor): a maximum, exact in any order and on any
  sharding."""
  if how == "tensor" or not a.shape:
    return jnp.max(a, initial=0.0)
  n = a.shape[-1]
  full = n // how
  lead = a.shape[:-1]
  # The whole blocks as a reshape and a ragged last block apart: padding
  # the array instead copies it, and a maximum over the padded copy ran
  # 2.7x slower on XLA:CPU (2000 x 10000, blocks of 256).
  parts = []
  if full:
    whole = a[..., : full * how].reshape(*lead, full, how)
    parts.append(jnp.max(whole, axis=-1, initial=0.0))
  if n % how:
    tail = a[..., full * how :]
    parts.append(jnp.max(tail, axis=-1, keepdims=True, initial=0.0))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _window(x, how: int, *ops):
  """Each of `ops` (`lax.max`, `lax.min`) of 0 and each block of `how`
  entries of the last axis, as one windowed reduction (one pass over `x`
  for all of them): a ragged last block is padded inside the reduction,
  with no copy of `x`."""
  ones = (1,) * (x.ndim - 1)
  pad = [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % how)]

  def each(a, b):
    return tuple(op(p, q) for op, p, q in zip(ops, a, b, strict=True))

  zeros = (np.float32(0),) * len(ops)
  return jax.lax.reduce_window(
    (x,) * len(ops), zeros, each, (*ones, how), (*ones, how), pad
  )


def _finite_amax(x, how, then, bad=None, clean=True, pre=None):
  """`then(amax, flagged)` (the scales) of the largest finite `|pre(x)|`
  per block (or of the tensor), 0 if none, and, with `bad` (a function
  giving a per-element mask), whether each block holds a `bad` element
  (else None, as where the conditional below has found none). `then`
  runs on the blocks inside each branch of the conditional below (or,
  without one, through `_once_a_block`), so that its result (the scales)
  is computed once per block and written out, not again for every
  element that reads it. `pre` (None: the identity) is a nondecreasing
  map onto nonnegative values, such as an unsigned code map's
  (`CodeMap.pre`): its block maximum is `pre` of the block's maximum, so
  the reductions read `x` and `pre(x)` is never written out.

  Written as a maximum of `where(isfinite(x), |x|, 0)`, the select is a
  pass of its own on XLA:CPU (its reductions take no fused producer),
  which cost a block-scaled moment about a fifth of its step. On CPU the
  maximum and minimum of `x` itself are taken instead, `max(max x, -min
  x)`: the same value wherever every entry is finite, which those
  maxima and minima say (NaN or infinite where an entry is). Where
  it is not, or where the scalar `clean` (which the caller makes true
  only where `bad` holds nowhere it cannot see through them) is
  false, the select runs. The conditional costs compile time (about
  13 ms a leaf) and a launch, which pay only on a tensor of
  `_RAW_MIN_SIZE` entries or more, and only for blocks of more than 32:
  XLA:CPU fuses the select into a reduction over 32 entries or fewer
  when its YNNPACK reductions are off (as `experiments.xla_flags` sets
  them), and the select ran 7x faster there; over a whole tensor the
  select was as fast or faster. Other backends fuse the select into the
  reduction and keep it. Every branch is a maximum, so the bits do not
  depend on the order or the sharding."""

  def select(once=False):
    if pre is None:
      amax = _block_max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), how)
    else:
      # pre of the block's maximum, as in `raw`: NaN and inf (which pre
      # keeps, and the select drops) and -inf (which pre maps to 0) all
      # count as 0 either way.
      finite = jnp.where(jnp.isfinite(x), x, 0.0)
      amax = jnp.abs(pre(_block_max(finite, how)))
    flagged = None
    if bad is not None:
      flagged = _block_max(bad().astype(jnp.float32), how) > 0
    out = then(amax, flagged)
    return _once_a_block(out) if once else out

  def raw():
    # XLA's maximum and minimum propagate NaN, so a block's are finite
    # exactly where its entries are. `pre` of a finite maximum is
    # finite and maps a -inf entry to 0, which the minimum would see.
    if pre is None:
      hi, lo = _window(x, how, jax.lax.max, jax.lax.min)
      fast = jnp.maximum(hi, -lo)
      finite = jnp.isfinite(hi) & jnp.isfinite(lo)
    else:
      (hi,) = _window(x, how, jax.lax.max)
      fast, finite = pre(hi), jnp.isfinite(hi)
    fast = jnp.abs(fast)  # no -0
    return jax.lax.cond(
      jnp.all(finite) & clean, lambda: then(fast, None), select
    )

  if not x.shape or x.size < _RAW_MIN_SIZE:
    return select()
  if how == "tensor" or how <= 32:
    return jax.lax.platform_dependent(cpu=lambda: select(True), default=select)
  return jax.lax.platform_dependent(cpu=raw, default=select)


def _once_a_block(a):
  """Float scales `a` themselves, written out once: without a conditional
  around them, XLA:CPU fuses the scales' arithmetic into the encoding's
  loop and repeats it for every element of a block. Their bits go
  through `lowprec.grids.scaled`'s integer division by an unseen 1,
  which it does not repeat. Used on CPU for tensors of `_RAW_MIN_SIZE`
  entries or more, where it was measured to pay (companded8/sqrt8
  moments); a small tensor would pay a fusion of its own for little
  arithmetic, and other backends are bound by memory, not by the
  repeated arithmetic."""
  if not jnp.shape(a):
    return a
  ints = {2: jnp.int16, 4: jnp.int32}[jnp.dtype(a.dtype).itemsize]
  k = scaled._once_per_block(jax.lax.bitcast_convert_type(a, ints))
  return jax.lax.bitcast_convert_type(k, a.dtype)


# The size from which `_finite_amax` reads the entries' maximum and
# minimum on CPU (a 256 x 256 matrix).
_RAW_MIN_SIZE = 1 << 16


def _pow2_scales(s, codec: Codec):
  """float32 powers of two `p`, smallest with `amax / p <= max_E`."""
  return _finite_amax(s, codec.scale, _pow2_of(codec))


def _pow2_of(codec: Codec):
  """The `then` of `_pow2_scales`: a block's scale from its largest
  finite magnitude `amax` (the second argument, a flag, unused)."""

  def scales(amax, _):
    # The no-clip rule of lowprec.scaled, within float32's normal range.
    top = codec.fmt.max_finite
    k = scaled._pow2_exponent(amax, top, "noclip", -126, 127)
    return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)

  return scales


def _amax_scales(x, codec: Codec, bad=None, clean=True, pre=None):
  """`amax / max_E` per block in `codec.scale_dtype` (module docstring of
  `Codec`), the amax of `pre(x)`; NaN for a block where the mask `bad()`
  holds (`clean` and `pre`: see `_finite_amax`)."""
  return _finite_amax(x, codec.scale, _scales_of(codec), bad, clean, pre)


def _scales_of(codec: Codec):
  """The `then` of `_amax_scales`: a block's scale from its largest
  finite magnitude `amax` and whether it holds a bad element (`flagged`,
  or None)."""

  def scales(amax, flagged):
    top = np.float32(codec.fmt.max_finite)
    s = amax if top == 1 else _quotient_by_constant(amax, top)
    if codec.scale_dtype == "float16":
      s = _ceil_float16(s)
    elif top != 1:  # a scale that XLA:CPU would flush to 0 stays normal
      s = jnp.maximum(s, np.float32(2.0**-126))
    zero = 0.0 if codec.mapped else 1.0
    s = jnp.where(amax > 0, s.astype(jnp.float32), zero)
    if flagged is not None:
      s = jnp.where(flagged, jnp.nan, s)
    return s.astype(codec.scale_dtype)

  return scales


def _ceil_float16(s):
  """The smallest float16 at or above float32 `s > 0`, within [2^-24,
  65504], as float32 values. Computed on float32 bit patterns: a
  conversion to float16 and back, compared with `s`, is what XLA:GPU
  simplifies away (lowprec.contract)."""
  s = jnp.maximum(s, np.float32(2.0**-24))
  # float16's normal range keeps 10 of float32's 23 fraction bits: round
  # the 13 others up (a carry into the exponent is the next binade).
  bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
  low = jnp.uint32(0x1FFF)
  up = jnp.where(bits & low, (bits | low) + jnp.uint32(1), bits)
  normal = jax.lax.bitcast_convert_type(up, jnp.float32)
  # Below 2^-14 float16 is a grid of step 2^-24: exact in float32.
  sub = jnp.ceil(s * np.float32(2.0**24)) * np.float32(2.0**-24)
  h = jnp.where(s < np.float32(2.0**-14), sub, normal)
  return jnp.minimum(h, np.float32(_F16_MAX))


def _quotient_by_constant(a, c: np.float32):
  """`a / c`, correctly rounded, for float32 `a >= 0` and a constant
  `c >= 1`, on integer bit patterns: the same bits on every backend
  (XLA:GPU turns a division by a constant into a product with its rounded
  reciprocal, 1 ulp off for some quotients, even through an optimization
  barrier). A quotient below float32's normal range is 0 (the scales clamp
  it up to 2^-126 after)."""
  c = np.float32(c)
  cm, ce = np.frexp(np.float64(c))  # c = cm 2^ce, cm in [0.5, 1)
  mc = int(cm * 2**24)  # 24-bit significand of c
  ec = int(ce) - 24  # c = mc 2^ec
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
  exp = (bits >> 23).astype(jnp.int32)
  ma = (bits & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000)  # normal a
  # a = ma 2^(exp - 150); long division of ma 2^25 by mc, one bit a step
  # (the remainder stays below 2^25).
  q = ma // jnp.uint32(mc)
  r = ma - q * jnp.uint32(mc)
  for _ in range(25):
    r = r << 1
    bit = (r >= jnp.uint32(mc)).astype(jnp.uint32)
    r = r - bit * jnp.uint32(mc)
    q = (q << 1) | bit
  # q = floor(ma 2^25 / mc), in [2^24, 2^26): 24 significant bits, a
  # guard bit and a sticky bit, rounded to nearest, ties to even.
  wide = q >= jnp.uint32(1 << 25)
  sig = jnp.where(wide, q >> 2, q >> 1)
  guard = jnp.where(wide, (q >> 1) & 1, q & 1)
  sticky = jnp.where(wide, (q & 1) | (r != 0), (r != 0).astype(jnp.uint32))
  sig = sig + (guard & (sticky | (sig & 1)))
  # The quotient is sig 2^(e - 23) with e its unbiased exponent.
  e = exp - 127 - ec - 24 + 1 + jnp.where(wide, 0, -1)
  carry = sig >= jnp.uint32(1 << 24)
  sig = jnp.where(carry, sig >> 1, sig)
  e = e + carry.astype(jnp.int32)
  biased = e + 127
  out = (biased.astype(jnp.uint32) << 23) | (sig & jnp.uint32(0x7FFFFF))
  value = jax.lax.bitcast_convert_type(out, jnp.float32)
  ok = (exp > 0) & (biased > 0)
  return jnp.where(ok, value, jnp.float32(0.0))


def _encode_mapped(codec: Codec, x, old, bits) -> Encoded:
  """`x` as the codes of a `CodeMap` under its block's largest magnitude
  (`lowprec.codemaps`)."""
  m = codec.fmt

  def bad():
    # A map has no NaN (nor, under "ieee", inf or, unsigned, a negative
    # value): such an element makes its block's scale NaN.
    b = jnp.isnan(x)
    if codec.overflow == "ieee":
      b = b | jnp.isinf(x) | ((x < 0) if not m.signed else False)
    return b

  # The scales take the maximum of `x`, and `pre` of it, so that
  # `pre(x)` is not a pass of its own. The block maxima see NaN and inf,
  # not the negative values of an unsigned map, which `pre` maps to 0.
  ieee_unsigned = codec.overflow == "ieee" and not m.signed
  clean = jnp.min(x, initial=0.0) >= 0 if ieee_unsigned else True
  scales = _amax_scales(x, codec, bad, clean, None if m.signed else m.pre)
  u = m.pre(x)
  per = _spread(scales.astype(jnp.float32), x.shape, codec.scale)
  raw = jnp.where(per > 0, _divide(u, per), 0.0)
  lo = -1.0 if m.signed else 0.0
  over = (jnp.abs(raw) > 1) | ((x < 0) if not m.signed else False)
  index = m.nearest_index(jnp.clip(raw, lo, 1.0))
  v = _kept(m.value(index, per))
  value = lambda i: _kept(m.value(i, per))  # noqa: E731
  index, v = map_rounded(codec, x, index, v, value, old, bits)
  code = m.code_of(index).astype(codec.dtype())
  return Encoded(code, scales, v, over & ~jnp.isnan(per))


def map_rounded(codec: Codec, x, index, v, value, old, bits):
  """`(index, v)` of a map's code for `x` by `codec`'s rounding, from
  the nearest code's index and value: as they are for nearest rounding
  (or without `bits`), else stochastic (dead zone: where nearest gives
  `old` back). `value(i)` reads an index back under the block's scale
  (as `decode` does), which a kernel computes its own way."""
  if not (codec.random and bits is not None):
    return index, v
  sr, v_sr = _map_stochastic(codec.fmt, x, index, v, value, bits)
  if codec.rounding == "stochastic":
    return sr, v_sr
  if old is None:
    return index, v
  stuck = (v == old) & (x != old)  # dead zone
  return jnp.where(stuck, sr, index), jnp.where(stuck, v_sr, v)


def _map_stochastic(m, x, index, v, value, bits):
  """Between the two map values around `x`, up with probability `(x -
  lo) / (hi - lo)` (24 of the 32 random bits): unbiased in the value
  `x`, not in the code. `index` and `v` are the nearest code's index and
  value; `value(i)` reads an index back (`map_rounded`)."""
  top = len(m.table()) - 1
  lo = jnp.clip(jnp.where(v > x, index - 1, index), 0, top)
  hi = jnp.minimum(lo + 1, top)
  v_lo, v_hi = value(lo), value(hi)
  width = v_hi - v_lo
  p = _ieee.div(x - v_lo, jnp.where(width > 0, width, 1))
  p = jnp.where(width > 0, p, 0.0)
  u = (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
  up = u < jnp.clip(p, 0.0, 1.0)
  return jnp.where(up, hi, lo), jnp.where(up, v_hi, v_lo)


# ---- weights: the float32 delta that lands exactly ---------------------------


def land(w, q, fmt):
  """The float32 delta that takes w to q, or to q's neighbour toward w.

  Rarely q is out of reach of float32 addition to w (see
  `lowprec.writeback`): take the grid neighbour of q toward w if that
  lands, else stay. This is elementwise, not a `lax.cond`, so that XLA
  fuses the whole write-back into the optimizer's update and
  `apply_updates`. Returns the delta and where q itself landed.
  """
  delta, lands = _delta(w, q)
  q2 = _toward_zero(q, fmt)
  delta2, lands2 = _delta(w, q2)
  toward_w = (q > w) == (q > 0)  # toward zero is toward w, not past it
  detour = ~lands & lands2 & toward_w
  delta = jnp.where(lands, delta, jnp.where(detour, delta2, -0.0))
  return delta, lands


def _toward_zero(q, fmt):
  """The grid value next to q toward zero, where q is normal above the
  smallest normal; elsewhere (and for intK) q itself, which never lands
  where q did not."""
  if isinstance(fmt, ScaledFormat) or not fmt.is_float:
    return q
  b = jax.lax.bitcast_convert_type(q, jnp.uint32)
  # Grid values of a normal binade are float32 patterns whose low 23 - m
  # mantissa bits are zero, so one step down is one unit of 2**(23 - m).
  ok = (b & 0x7FFFFFFF) > np.float32(fmt.min_normal).view(np.uint32)
  ok &= (b & 0x7FFFFFFF) < 0x7F800000
  step = jnp.uint32(1 << (23 - fmt.man_bits))
  return jnp.where(ok, jax.lax.bitcast_convert_type(b - step, jnp.float32), q)


def _delta(w, q):
  """A float32 `d` with `w + d == q` in float32, and where that holds.

  `q - w` rounded is the answer unless its rounding error pushes `w + d`
  off `q`; then the float32 neighbour of `d` toward the error is the only
  other candidate: every float that lands lies on one side of `q - w`, and
  the nearest float there is `d` or that neighbour.
  """
  d = q - w
  r = w + d
  # One float32 step of d: +1 on the bit pattern grows |d|, -1 shrinks it.
  grow = (q > r) == (d > 0)
  b = jax.lax.bitcast_convert_type(d, jnp.uint32)
  step = jnp.where(grow, jnp.uint32(1), jnp.uint32(0xFFFFFFFF))
  nudged = jax.lax.bitcast_convert_type(b + step, jnp.float32)
  d = jnp.where(r == q, d, nudged)
  # Adding -0 keeps every w bit for bit (+0 + -0 = +0, -0 + -0 = -0).
  d = jnp.where(q == w, jnp.float32(-0.0), d)
  return d, (w + d == q) | jnp.isnan(q)

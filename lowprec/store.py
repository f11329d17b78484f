"""The store step: a float32 value onto a low-precision grid, with counts.

Every quantity lowprec keeps on a grid between optimizer steps (a weight,
a Kahan buffer, a two-component error term, a stored moment) goes through
the same step: a float32 value `x` is rounded onto the grid that a `Codec`
describes, given the value `old` the store held before and, for a random
rounding, 32 random bits per element. The transforms differ only in what
they feed it (`w + u`, a residual, Adam's new moment) and what they keep
(the rounded weight as a float32 delta, the code and its scales).

A `Codec` is what one leaf is stored as: a format (`Format` or an MX
`ScaledFormat`), a rounding (`nearest`, `stochastic`, `deadzone`), a scale
(none, one float32 power of two per tensor or per block of the last
axis), the overflow mode and the carrier (the format's own dtype where it
has one, `native`, or float32 holding grid values). `encode` rounds,
`decode` reads back, `stored_dtype` and `nbytes` give the storage.

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

from lowprec import names, scaled
from lowprec.counting import count as tally
from lowprec.formats import Format
from lowprec.rounding import OVERFLOW_MODES, ROUNDINGS, round_and_flag
from lowprec.scaled import ScaledFormat

__all__ = ["Codec", "Encoded", "decode", "encode", "land", "tally"]

CARRIERS = ("native", "float32")


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
      follow the value, `lowprec.scaled`).
    rounding: "nearest", "stochastic" or "deadzone" (stochastic only where
      nearest would leave the stored value as it was).
    scale: None, "tensor" (one float32 power of two per tensor) or a block
      size (one per block of that many elements along the last axis): the
      smallest power of two `p` with `amax / p <= max_E`, applied by float
      division. Not with a `ScaledFormat`, which scales itself.
    overflow: "saturate" or "ieee" (`lowprec.rounding`).
    carrier: "native" (the format's dtype where it has one) or "float32".
    keep_scales: a `ScaledFormat` rounds onto the block scales of `old`
      rather than of the new value (`writeback(scales="keep")`).
  """

  fmt: Format | ScaledFormat
  rounding: str = "nearest"
  scale: str | int | None = None
  overflow: str = "saturate"
  carrier: str = "native"
  keep_scales: bool = False

  def __post_init__(self):
    names.check_choice("rounding", self.rounding, ROUNDINGS)
    names.check_choice("overflow mode", self.overflow, OVERFLOW_MODES)
    names.check_choice("carrier", self.carrier, CARRIERS)

  @property
  def random(self) -> bool:
    """Whether `encode` needs random bits."""
    return self.rounding != "nearest"

  @property
  def scaled(self) -> bool:
    """Whether the grid is an MX scaled format."""
    return isinstance(self.fmt, ScaledFormat)

  def dtype(self) -> np.dtype:
    """The dtype of the stored code."""
    if self.scaled:
      return np.dtype(np.float32)
    return stored_dtype(self.fmt, self.carrier)

  def nbytes(self, shape) -> int:
    """Bytes of a leaf of `shape`: its code and its float32 scales."""
    n = int(np.prod(shape, dtype=np.int64))
    return n * self.dtype().itemsize + 4 * _scale_count(shape, self.scale)


class Encoded(NamedTuple):
  """One leaf after `encode`."""

  code: jax.Array  # what is stored, in `Codec.dtype()`
  scales: jax.Array | None  # float32 scales (`Codec.scale`), else None
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
  scales = None if codec.scale is None else _pow2_scales(x, codec)
  per = None if scales is None else _spread(scales, x.shape, codec.scale)
  y = x if per is None else x / per
  sr = bits if codec.rounding == "stochastic" else None
  q, over = round_and_flag(y, codec.fmt, sr, overflow=codec.overflow)
  v = q if per is None else q * per
  if codec.rounding == "deadzone" and old is not None:
    q_sr, over_sr = round_and_flag(y, codec.fmt, bits, overflow=codec.overflow)
    stuck = (v == old) & (x != old)
    q = jnp.where(stuck, q_sr, q)
    over = jnp.where(stuck, over_sr, over)
    v = q if per is None else q * per
  return Encoded(q.astype(codec.dtype()), scales, v, over)


def decode(codec: Codec, code, scales=None) -> jax.Array:
  """The float32 values a stored code stands for.

  The scale's product is read through a select (which returns every
  value, NaN as NaN): XLA:CPU contracts a multiply that feeds an add in
  the same fusion into an FMA, and a reader such as Adam's `b2 * nu +
  (1 - b2) g^2` would otherwise contract one product or the other
  depending on the fusion, hence on the sharding.
  """
  v = jnp.asarray(code).astype(jnp.float32)
  if scales is None:
    return v
  v = v * _spread(scales, v.shape, codec.scale)
  return jnp.where(jnp.isnan(v), jnp.float32(jnp.nan), v)


def _encode_scaled(codec: Codec, x, old, bits) -> Encoded:
  """`x` onto the MX grid of scales from `x` itself, or from `old` under
  `keep_scales`."""
  fmt = codec.fmt
  kept = scaled.compute_scales(old, fmt) if codec.keep_scales else None
  mode = "nearest" if codec.rounding == "nearest" else "stochastic"
  sr_bits = None if mode == "nearest" else bits
  q, over, sc = scaled.fake_quantize_and_scales(
    x, fmt, mode, overflow=codec.overflow, bits=sr_bits, scales=kept
  )
  if codec.rounding == "deadzone":
    q_rn, over_rn, _ = scaled.fake_quantize_and_scales(
      x, fmt, overflow=codec.overflow, scales=kept
    )
    erased = q_rn == old
    q = jnp.where(erased, q, q_rn)
    over = jnp.where(erased, over, over_rn)
  if codec.keep_scales and fmt.rule == "ocp":
    # Only a block whose maximum fell to the top of the binade below
    # its scale's is off the grid of its own (halved) scale; putting it
    # there saturates that maximum. The identity on every other block.
    q, over_own, _ = scaled.fake_quantize_and_scales(
      q, fmt, overflow=codec.overflow
    )
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


def _pow2_scales(s, codec: Codec):
  """float32 powers of two `p`, smallest with `amax / p <= max_E`."""
  how = codec.scale
  a = jnp.where(jnp.isfinite(s), jnp.abs(s), 0.0)
  if how == "tensor" or not s.shape:
    amax = jnp.max(a, initial=0.0)
  else:
    n = s.shape[-1]
    blocks = -(-n // how)
    pad = [(0, 0)] * (s.ndim - 1) + [(0, blocks * how - n)]
    a = jnp.pad(a, pad).reshape(*s.shape[:-1], blocks, how)
    amax = jnp.max(a, axis=-1, initial=0.0)
  # The no-clip rule of lowprec.scaled, within float32's normal range.
  k = scaled.pow2_exponent(
    amax, codec.fmt.max_finite, "noclip", lo=-126, hi=127
  )
  return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


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

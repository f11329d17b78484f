"""Bit-level helpers shared by formats and rounding.

Everything here works on the integer bit pattern of the float input, never on
float arithmetic near zero: JAX on CPU flushes float32 subnormals to zero in
arithmetic, and XLA may delete a narrowing convert pair under jit. Integer
selects and shifts are exact on every backend and cannot be elided.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """Bit layout of a binary IEEE carrier dtype (float32 or float64)."""

  dtype: np.dtype
  uint: np.dtype
  width: int  # total bits
  man: int  # explicit mantissa bits
  bias: int

  @property
  def emin(self) -> int:
    return 1 - self.bias

  @property
  def sign_mask(self) -> int:
    return 1 << (self.width - 1)

  @property
  def inf_bits(self) -> int:
    return ((1 << (self.width - 1 - self.man)) - 1) << self.man

  def bits_of(self, value: float) -> int:
    """Bit pattern of a Python float in this carrier (exact for grid values)."""
    return int(np.array(value, self.dtype).view(self.uint))


F32 = Layout(np.dtype(np.float32), np.dtype(np.uint32), 32, 23, 127)
F64 = Layout(np.dtype(np.float64), np.dtype(np.uint64), 64, 52, 1023)


def layout_for(dtype) -> Layout:
  dtype = np.dtype(dtype)
  if dtype == np.float64:
    return F64
  return F32


def carrier(x: jax.Array) -> tuple[jax.Array, Layout]:
  """Upcasts `x` to float32 (or keeps float64) and returns its layout.

  Raises:
    TypeError: for integer, boolean or complex input.
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f"expected a floating-point array, got dtype {x.dtype}; convert it "
      "with x.astype(jnp.float32) first"
    )
  if x.dtype == jnp.float64:
    return x, F64
  return x.astype(jnp.float32), F32


def to_bits(x: jax.Array, lay: Layout) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, lay.uint)


def from_bits(b: jax.Array, lay: Layout) -> jax.Array:
  return jax.lax.bitcast_convert_type(b, lay.dtype)


def u(value: int, lay: Layout) -> jax.Array:
  """An unsigned scalar constant of the carrier's width."""
  return jnp.asarray(value, lay.uint)


def shl(a: jax.Array, s, lay: Layout) -> jax.Array:
  return jax.lax.shift_left(a, jnp.asarray(s, lay.uint))


def shr(a: jax.Array, s, lay: Layout) -> jax.Array:
  return jax.lax.shift_right_logical(a, jnp.asarray(s, lay.uint))


def pow2_bits(k: jax.Array, lay: Layout) -> jax.Array:
  """Bits of 2**k for integer k in the carrier's range, subnormals included."""
  k = k.astype(jnp.int32)
  normal = shl(
    (jnp.maximum(k, lay.emin) + lay.bias).astype(lay.uint), lay.man, lay
  )
  sub = shl(
    u(1, lay),
    jnp.clip(k - lay.emin + lay.man, 0, lay.man).astype(lay.uint),
    lay,
  )
  return jnp.where(k >= lay.emin, normal, sub)


def exponent(a: jax.Array, lay: Layout) -> jax.Array:
  """Unbiased exponent of a nonnegative value given by its bits (int32).

  Carrier subnormals and zero report the carrier's minimum exponent.
  """
  biased = shr(a, lay.man, lay).astype(jnp.int32)
  return jnp.maximum(biased, 1) - lay.bias


@dataclasses.dataclass(frozen=True)
class Bracket:
  """The two grid neighbours of |x| and where |x| lies between them.

  `lo` and `hi` are carrier bit patterns of nonnegative grid values of an
  unbounded-exponent version of the format (so `hi` may exceed the maximum).
  `frac` is (|x| - lo) / (hi - lo) as a fixed-point fraction of the carrier's
  width: exact whenever the discarded part fits in that many bits, and
  truncated (so below one half) otherwise. `odd` says the last kept digit of
  `lo` is odd, for ties to even.
  """

  lo: jax.Array
  hi: jax.Array
  frac: jax.Array
  odd: jax.Array


def bracket(a: jax.Array, fmt, lay: Layout) -> Bracket:
  """Brackets the nonnegative value with bits `a` (finite) by `fmt`'s grid."""
  m, w = fmt.man_bits, lay.width
  d = lay.man - m
  one = u(1, lay)
  if d == 0:
    zero = jnp.zeros_like(a)
    out = Bracket(a, a + one, zero, (a & one).astype(bool))
  else:
    low_mask = u((1 << d) - 1, lay)
    # The complement made in Python (Pallas's Triton backend has no `~`
    # of a constant).
    lo = a & u(((1 << w) - 1) ^ ((1 << d) - 1), lay)
    out = Bracket(
      lo=lo,
      hi=lo + u(1 << d, lay),
      frac=shl(a & low_mask, w - d, lay),
      odd=(shr(lo, d, lay) & one).astype(bool),
    )
  if fmt.emin == lay.emin:
    # The target's subnormals are the carrier's: one shift serves all values.
    return out
  # Below the target's smallest normal the grid step is q = 2**(emin - m):
  # count whole steps in the significand and rebuild the value from the count.
  biased = shr(a, lay.man, lay)
  sig = (a & u((1 << lay.man) - 1, lay)) | shl(
    (biased != 0).astype(lay.uint), lay.man, lay
  )
  e = jnp.maximum(biased.astype(jnp.int32), 1) - lay.bias
  s = (fmt.emin - m) - (e - lay.man)  # > d here
  s = jnp.clip(s, 0, 2 * w - 1)
  s_in = jnp.minimum(s, w - 1).astype(lay.uint)
  k = jnp.where(s < w, shr(sig, s_in, lay), jnp.zeros_like(sig))
  rem_mask = shl(one, s_in, lay) - one
  frac = jnp.where(
    s < w,
    shl(sig & rem_mask, (w - jnp.minimum(s, w)).astype(lay.uint) % w, lay),
    shr(sig, jnp.minimum(s - w, w - 1).astype(lay.uint), lay),
  )
  frac = jnp.where(s == 0, jnp.zeros_like(frac), frac)
  q_shift = (fmt.emin - m) << lay.man

  def count_to_bits(n):
    nf = n.astype(lay.dtype)  # exact: n <= 2**m + 1
    return jnp.where(
      n == 0, jnp.zeros_like(n), to_bits(nf, lay) + u(q_shift % (1 << w), lay)
    )

  sub = a < u(lay.bits_of(fmt.min_normal), lay)
  return Bracket(
    lo=jnp.where(sub, count_to_bits(k), out.lo),
    hi=jnp.where(sub, count_to_bits(k + one), out.hi),
    frac=jnp.where(sub, frac, out.frac),
    odd=jnp.where(sub, (k & one).astype(bool), out.odd),
  )

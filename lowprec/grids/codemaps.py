"""Code maps: a block of optimizer state as 8- or 4-bit codes and one scale.

A *code map* keeps a float32 value `x` as a small integer code and one
scale `s` per block (or tensor): the block's largest magnitude of `u =
pre(x)`, so that `y = u / s` lies in the map's range, and the code is the
map's entry for `y`. It reads back as

  value = post(T[code] * s),

`T` the map's table of normalized values (float32). `pre` and `post` are
the identity except for `sqrt8`, which maps `sqrt(x)` and squares on the
way back. The maps, each the choice of a PyTorch optimizer:

  dynamic8    bitsandbytes' dynamic map, signed (torchao's AdamW8bit,
              `create_dynamic_map(signed=True)`): 0, 1 and, for
              i = 0..6, the 2^i midpoints of `linspace(0.1, 1, 2^i + 1)`
              times `10^(i - 6)`, both signs. 256 entries in [-0.993, 1],
              the smallest nonzero `5.5e-7`; uint8 codes (the index into
              the sorted table), float32 scales (Dettmers et al. 2022).
  dynamic8u   its unsigned form, `create_dynamic_map(signed=False)`, for
              nonnegative values (torchao's AdamW8bit stores Adam's second
              moment with it): 0, 1 and, for i = 0..6, the 2^(i + 1)
              midpoints of `linspace(0.1, 1, 2^(i + 1) + 1)` times
              `10^(i - 6)`; the smallest nonzero `3.25e-7`.
  dynamic4    the same construction with 4 bits, i = 0..2 and `10^(i - 2)`
              (Li, Chen, Zhu 2023's first-moment map, `create_dynamic_map
              (True, 3, 4)`): 16 entries, the smallest nonzero `0.0055`.
  companded8  FlashOptim's first moments: `phi(y) = 2y / (1 + |y|)`, code
              `floor(127 phi(y) + 0.5)` in int8 (-127..127), read back
              as `z / (2 - |z|)` with `z = code / 127`; float16 scales.
  sqrt8       FlashOptim's second moments: `u = sqrt(x)`, code
              `floor(255 y + 0.5)` in uint8, read back as
              `(code / 255 * s)^2`; float16 scales. For nonnegative x.
  uint4nz     Li, Chen, Zhu 2023's second moments: the linear map without
              zero, `T = (k + 1) / 16` for k = 0..15 (a stored zero would
              make Adam's `1 / sqrt(nu)` explode); uint8 codes 0..15. For
              nonnegative x: a value below `s / 32` reads back as `s / 16`.

Nearest rounding of the table maps (`dynamic8`, `dynamic8u`, `dynamic4`,
`uint4nz`) takes the entry nearest to `y`, ties to the larger one
(torchao's rule); `companded8` and `sqrt8` round as FlashOptim computes
them, `floor(v + 0.5)` of the float32 product `v`. Each table entry is the
float32 nearest to its exact value (bitsandbytes builds its table in
float32 arithmetic, so one of its entries may be a float32 ulp away); the
tables of `companded8` and `sqrt8` are their float32 formulas, evaluated
as written.

Zero blocks have scale 0 (a map may have no zero entry: the scale makes
the block read back as zeros). `store_state` keeps the 4-bit codes two to
a byte (`lowprec.engine.codec.pack`).
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.grids import _ieee, choices

__all__ = ["MAPS", "CodeMap", "get_map", "is_map"]


@dataclasses.dataclass(frozen=True)
class CodeMap:
  """A code map (hashable: static under jit). Build one with `get_map`.

  Attributes:
    name: "dynamic8", "dynamic8u", "dynamic4", "companded8", "sqrt8" or
      "uint4nz".
    bits: bits of information per code (an 8-bit code is kept in a byte,
      two 4-bit codes share one).
    signed: whether the map holds negative values.
    code_dtype: "uint8" or "int8".
    scale_dtype: the default dtype of its scales, "float32" or "float16".
    ref: where it comes from.
  """

  name: str
  bits: int
  signed: bool
  code_dtype: str
  scale_dtype: str
  ref: str

  @property
  def max_finite(self) -> float:
    """The largest normalized magnitude: 1 (the block's absmax)."""
    return 1.0

  def table(self) -> np.ndarray:
    """float32 normalized values by index (ascending)."""
    return _TABLES[self.name]()

  @property
  def offset(self) -> int:
    """Code plus offset is the index into `table()`."""
    return 127 if self.name == "companded8" else 0

  def pre(self, x):
    """The value the scale and the code are taken of: `x`, 0 in place of
    a negative `x` for an unsigned map, its square root for `sqrt8`."""
    if not self.signed:
      x = jnp.maximum(x, 0.0)
    return _ieee.sqrt(x) if self.name == "sqrt8" else x

  def value(self, index, per, tables=None):
    """float32 `post(T[index] * per)`: what a code reads back as.
    `tables`: see `nearest_index`."""
    table = self.table()
    if len(table) <= _SMALL:
      v = _select(table, jnp.clip(index, 0, len(table) - 1)) * per
    elif tables is not None:
      v = tables["table"][index] * per  # an index in range: a code's
    else:
      v = jnp.take(jnp.asarray(table), index, mode="clip") * per
    return v * v if self.name == "sqrt8" else v

  def tables(self) -> dict[str, np.ndarray]:
    """The arrays `value` and `nearest_index` read by index, by name:
    `table` (the values) and, for the maps of 256 entries read by a
    first guess, `first` and `up` (`_Buckets`)."""
    if len(self.table()) <= _SMALL or self.name in ("companded8", "sqrt8"):
      return {}
    g = _buckets(self.name)
    return {"table": self.table(), "first": g.first, "up": g.up}

  def nearest_index(self, y, tables=None):
    """The index of the code of normalized `y` (finite, in range).

    `tables`: `self.tables()`'s arrays by name, as anything indexed by an
    integer array (a Pallas kernel's refs); None: the map's own."""
    if self.name == "companded8":
      phi = _ieee.div(2.0 * y, 1.0 + jnp.abs(y))
      return _round_half_up(phi * np.float32(127)) + 127
    if self.name == "sqrt8":
      return _round_half_up(y * np.float32(255))
    if len(self.table()) <= _SMALL:
      # A 4-bit map: the number of thresholds at or below y, counted
      # (15 vector comparisons beat two table lookups, which XLA:CPU
      # runs as scalar loads).
      up = _thresholds(self.name)[1:]
      index = sum((y >= t).astype(jnp.int32) for t in up)
      return jnp.where(jnp.isnan(y), 0, index)
    # The number of thresholds at or below y (threshold k the float32 at
    # or above the midpoint of entries k-1, k): a first guess read from
    # y's bucket (its sign, exponent and leading fraction bits), then at
    # most `extra` comparisons (`_Buckets`).
    g = _buckets(self.name)
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    mag = jnp.maximum(bits & np.int32(0x7FFFFFFF), g.floor) - g.floor
    mag = jnp.minimum(mag >> g.shift, g.top)
    bucket = jnp.where(bits < 0, g.top - mag, g.top + 1 + mag)
    if tables is None:
      tables = {
        n: functools.partial(jnp.take, jnp.asarray(a))
        for n, a in self.tables().items()
      }
      read = lambda name, i: tables[name](i)  # noqa: E731
    else:
      read = lambda name, i: tables[name][i]  # noqa: E731
    index = read("first", bucket).astype(jnp.int32)
    for j in range(1, g.extra + 1):
      index = index + (y >= read("up", index + j)).astype(jnp.int32)
    return jnp.where(jnp.isnan(y), 0, index)

  def search_index(self, y):
    """`nearest_index` by a branchless binary search over the thresholds
    (8 dependent steps for 256 entries): the reference the bucketed
    guess is tested against."""
    up = jnp.asarray(_thresholds(self.name))
    index = jnp.zeros(jnp.shape(y), jnp.int32)
    step = len(self.table()) // 2
    while step:
      index = jnp.where(y >= jnp.take(up, index + step), index + step, index)
      step //= 2
    return index

  def index_of(self, code):
    """int32 table index of a stored code (any integer or float carrier)."""
    return jnp.asarray(code).astype(jnp.int32) + self.offset

  def code_of(self, index):
    """int32 code of a table index."""
    return index - self.offset


# Maps of at most this many entries read their table by selects.
_SMALL = 16


def _select(table: np.ndarray, index):
  """`table[index]` for an int32 `index` in range, as a tree of selects
  on its bits (vectorizes, where a gather runs element by element)."""
  values = [jnp.float32(v) for v in table]
  bit = 0
  while len(values) > 1:
    on = (index >> bit) & 1 == 1
    pairs = zip(values[0::2], values[1::2], strict=False)
    nxt = [jnp.where(on, hi, lo) for lo, hi in pairs]
    if len(values) % 2:
      nxt.append(values[-1])
    values, bit = nxt, bit + 1
  return jnp.broadcast_to(values[0], jnp.shape(index))


def _round_half_up(v):
  """int32 `floor(v + 0.5)` of the float32 product `v`, rounded before the
  add (the select keeps XLA:CPU from contracting the two into an FMA)."""
  v = jnp.where(jnp.isnan(v), jnp.float32(jnp.nan), v)
  return jnp.floor(v + np.float32(0.5)).astype(jnp.int32)


_REFS = {
  "dynamic8": "bitsandbytes / torchao AdamW8bit (Dettmers et al. 2022)",
  "dynamic8u": "bitsandbytes / torchao AdamW8bit, second moments",
  "dynamic4": "Li, Chen, Zhu 2023, first moments",
  "companded8": "FlashOptim (Gonzalez Ortiz et al. 2026), first moments",
  "sqrt8": "FlashOptim (Gonzalez Ortiz et al. 2026), second moments",
  "uint4nz": "Li, Chen, Zhu 2023, second moments",
}

MAPS = {
  "dynamic8": CodeMap(
    "dynamic8", 8, True, "uint8", "float32", _REFS["dynamic8"]
  ),
  "dynamic8u": CodeMap(
    "dynamic8u", 8, False, "uint8", "float32", _REFS["dynamic8u"]
  ),
  "dynamic4": CodeMap(
    "dynamic4", 4, True, "uint8", "float32", _REFS["dynamic4"]
  ),
  "companded8": CodeMap(
    "companded8", 8, True, "int8", "float16", _REFS["companded8"]
  ),
  "sqrt8": CodeMap("sqrt8", 8, False, "uint8", "float16", _REFS["sqrt8"]),
  "uint4nz": CodeMap("uint4nz", 4, False, "uint8", "float32", _REFS["uint4nz"]),
}


def is_map(name) -> bool:
  """Whether `name` is a code map (or a map name)."""
  return isinstance(name, CodeMap) or (isinstance(name, str) and name in MAPS)


def get_map(name) -> CodeMap:
  """The `CodeMap` of a name (a `CodeMap` passes through).

  Raises:
    ValueError: an unknown name, with the valid ones and the closest.
  """
  if isinstance(name, CodeMap):
    return name
  choices.check_choice("code map", name, MAPS)
  return MAPS[name]


def _f32(exact: Fraction) -> np.float32:
  """The float32 nearest to an exact rational (no double rounding)."""
  f = np.float32(float(exact))
  for g in (np.nextafter(f, np.float32(-2)), np.nextafter(f, np.float32(2))):
    if abs(Fraction(float(g)) - exact) < abs(Fraction(float(f)) - exact):
      f = g
  return f


def _dynamic(bits: int, signed: bool = True) -> np.ndarray:
  """bitsandbytes' dynamic map of `bits` bits, exact then float32."""
  top = bits - 2
  exact = [Fraction(0), Fraction(1)]
  for i in range(top + 1):
    n = 2**i if signed else 2 ** (i + 1)
    for k in range(n):
      # The midpoint of linspace(0.1, 1, n + 1)'s k-th interval.
      mid = Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * k + 1, 2 * n)
      v = Fraction(10) ** (i - top) * mid
      exact += [v, -v] if signed else [v]
  out = np.array(sorted(_f32(v) for v in exact), np.float32)
  assert len(out) == 2**bits
  return out


def _companded() -> np.ndarray:
  z = np.arange(-127, 128).astype(np.float32) / np.float32(127)
  return z / (np.float32(2) - np.abs(z))


def _sqrt8() -> np.ndarray:
  return np.arange(256).astype(np.float32) / np.float32(255)


def _uint4nz() -> np.ndarray:
  return (np.arange(16) + 1).astype(np.float32) / np.float32(16)


_TABLES = {
  "dynamic8": functools.cache(lambda: _dynamic(8)),
  "dynamic8u": functools.cache(lambda: _dynamic(8, signed=False)),
  "dynamic4": functools.cache(lambda: _dynamic(4)),
  "companded8": functools.cache(_companded),
  "sqrt8": functools.cache(_sqrt8),
  "uint4nz": functools.cache(_uint4nz),
}


@functools.cache
def _thresholds(name: str) -> np.ndarray:
  """`up[k]`, k >= 1: the smallest float32 at or above the exact midpoint
  of entries k-1 and k (so `y >= up[k]` iff y is at or past it); up[0]
  is never read."""
  t = _TABLES[name]().astype(np.float64)
  mid = (t[:-1] + t[1:]) / 2  # exact: float32 sums fit a float64
  up = mid.astype(np.float32)
  low = up.astype(np.float64) < mid
  up[low] = np.nextafter(up[low], np.float32(np.inf))
  return np.concatenate([[np.float32(-np.inf)], up]).astype(np.float32)


class _Buckets(NamedTuple):
  """A table map's first guess: the float32 `y` in [-1, 1] falls in
  bucket `top - m` (y < 0, or -0.0) or `top + 1 + m`, where `m` is its
  magnitude's bit pattern above `floor` (0 below it), shifted right by
  `shift`; `first[bucket]` is the number of thresholds at or below the
  bucket's smallest value, and at most `extra` more lie within it. `up`
  is `_thresholds` padded with `extra` infinities."""

  floor: int
  shift: int
  top: int
  first: np.ndarray
  extra: int
  up: np.ndarray


@functools.cache
def _buckets(name: str, max_extra: int = 1) -> _Buckets:
  """The widest buckets with at most `max_extra` thresholds inside each."""
  up = _thresholds(name)
  inner = up[1:].astype(np.float64)
  # Below the smallest threshold magnitude the count does not change.
  small = np.min(np.abs(inner[inner != 0]))
  floor = int(np.float32(2.0 ** np.floor(np.log2(small))).view(np.int32))
  one = int(np.float32(1).view(np.int32))
  for shift in range(23, -1, -1):  # the widest buckets that keep max_extra
    top = (one - floor) >> shift
    lo, hi = _bucket_counts(up, floor, shift, top)
    if np.max(hi - lo) <= max_extra:
      break
  extra = int(np.max(hi - lo))
  pad = np.full(extra, np.inf, np.float32)
  up = np.concatenate([up, pad])
  return _Buckets(floor, shift, top, lo.astype(np.uint8), extra, up)


def _bucket_counts(up, floor: int, shift: int, top: int):
  """The threshold counts at the smallest and largest value of each
  bucket (the count grows with the value, so it lies between them)."""
  m = np.arange(top + 1, dtype=np.int64)
  small = np.where(m == 0, 0, floor + (m << shift))  # least magnitude
  large = np.minimum(floor + ((m + 1) << shift) - 1, 0x7F7FFFFF)
  mags = lambda b: b.astype(np.int32).view(np.float32)
  count = lambda v: np.searchsorted(up[1:], v, side="right")
  neg_lo, neg_hi = count(-mags(large)), count(-mags(small))
  pos_lo, pos_hi = count(mags(small)), count(mags(large))
  lo = np.concatenate([neg_lo[::-1], pos_lo])
  hi = np.concatenate([neg_hi[::-1], pos_hi])
  return lo, hi

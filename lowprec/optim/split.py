"""Split weights: a bfloat16 weight and a narrow correction of its value.

The model computes with a bfloat16 weight `w`; the optimizer state keeps a
signed k-bit integer `rho` (int8 for k = 8, int16 for k = 16) that
corrects it, in units of half the weight's ulp. The pair stands for a
float32 value `v`; each step adds the proposal to `v` in float32 and
splits the sum again into the nearest bfloat16 weight and the code of
what is left. With `K = 2^(k-1) - 1` (127 or 32767):

  v   = RN32(w + rho / K * ulp(w) / 2)                 (rebuild)
  v'  = RN32(v + u)
  w'  = RN_bf16(v')                      (saturating at +-max bfloat16)
  e   = v' - w'
  rho' = RNE(clip(e / (ulp(w') / 2), -1, 1) * K)        (split)

**ulp.** `ulp(w) = 2^(E - 7)`, where `E` is the exponent of `|w|` as a
bfloat16 (`2^E <= |w| < 2^(E+1)`) and `E = -126` for zero and subnormal
`w`: the gap from `|w|` to the next bfloat16 above it (`gap_up(|w|)` of
`lowprec.formats`). At a power of two it is the gap above (the one below
is half as wide); at zero and among subnormals it is `2^-133`, their
spacing. This is FlashOptim's definition: its kernels take the exponent of
the bfloat16 weight, with subnormals and zero at the smallest normal
exponent. With it, the nearest split always has `|e| <= ulp(w') / 2`
(`<= ulp / 4` where `v'` lies just below a power of two that `w'` rounded
up to), so the clip binds only where the weight saturated at the largest
bfloat16; and `w' = 0` only where `v' = 0`, whose correction is 0.

**What is exact.** `e` is exact (`v'` and `w'` share a binade or two, and
`e` is a multiple of `2^(E'-24)` below `2^(E'-8)`), and the code is the
correctly rounded `K e / (ulp / 2)`, ties to even, computed on integers
(ties occur only at `e = +-ulp / 4`, where ties away from zero, as in
FlashOptim's kernels, give the same code). The rebuild rounds the exact
rational `w + rho / K * ulp / 2` once to float32, computed on integers
(products, shifts and comparisons; no division by `K`); `v + u` is one
float32 addition, the proposal rounded to float32 as the optimizer
emitted it. So a run is the same bits on every backend.

**Subnormals.** Float32 values below `2^-126` in magnitude are zero here:
a proposal or a value there is read as zero and a sum there is flushed to
zero, as XLA on CPU does in its arithmetic (GPUs keep float32
subnormals by default; the flush is explicit so they give the same bits).
A bfloat16 weight below `2^-126` has the value zero (and float32 addition
on CPU, `optax.apply_updates`'s included, reads it as zero too).

The state holds one code per weight: 3 bytes per parameter with the weight
at k = 8 (about 16 significant bits: the code's step is `ulp / 254`, about
`2^-8` of the weight's ulp), 4 bytes at k = 16 (step `ulp / 65534`, within
`1 + 2^-15` of float32's own spacing), against `remainder_writeback`'s 4
bytes for an exact float32 master. `rebuild` and `split_value` give the
value of a split pair and the split of a float32 value, e.g. to start a run
from a float32 checkpoint.

Reference: Ortiz et al., "FlashOptim: Optimizers for Memory Efficient
Training" (Databricks, 2026), master weight splitting.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import counting, leafwise, record
from lowprec.engine.codec import Codec, encode, land, tally
from lowprec.engine.counting import mass
from lowprec.engine.rules import format_lookup, map_spec, path_name
from lowprec.grids import choices, scaled
from lowprec.grids.formats import Format, get_format
from lowprec.optim.writeback import NONFINITE_MODES

__all__ = ["SplitState", "rebuild", "split_value", "split_writeback"]

CORRECTION_BITS = (8, 16)
# bits -> (stored dtype, K = 2^(bits-1) - 1)
_CODES = {8: (np.dtype(np.int8), 127), 16: (np.dtype(np.int16), 32767)}
_BF16 = get_format("bfloat16")
_COUNTS = ("proposals", "erased", "moved", "nonfinite", "lost")
_MASSES = ("carried", "lost_mass")
_FIELDS = _COUNTS + _MASSES
# e in units of 2^(E - 24), where ulp(w) / 2 = 2^(E - 8) is 2^16 units.
_HALF_ULP_UNITS = 1 << 16


class SplitState(NamedTuple):
  """State of `split_writeback`: the corrections and the last update's counts.

  `correction` maps each parameter path that has a format to its code
  `rho`, shaped like the parameter, int8 (k = 8) or int16 (k = 16), zero at
  `init` (the value starts at the weight). Counts are dicts from path to
  int32 scalars and masses to float32 scalars, for the last update; None
  with `telemetry=False`.
  """

  count: jax.Array  # int32 []: updates applied so far.
  correction: dict[str, jax.Array]  # per path: like the param; int8/int16.
  proposals: dict[str, jax.Array] | None  # int32 [] per path: finite u != 0.
  erased: dict[str, jax.Array] | None  # int32 []: u != 0 and w' == w.
  moved: dict[str, jax.Array] | None  # int32 [] per path: w' != w.
  nonfinite: dict[str, jax.Array] | None  # int32 []: u or w not finite.
  lost: dict[str, jax.Array] | None  # int32 []: the code could not hold e.
  carried: dict[str, jax.Array] | None  # float32 []: sum |v - w| after.
  lost_mass: dict[str, jax.Array] | None  # float32 []: sum |v' - v|.
  # Static (no arrays): the correction's bits, checked at every update.
  recipe: record.Recipe | None = None

  def arrays(self) -> dict[str, jax.Array]:
    """`report()`'s keys as arrays (under jit, scan and vmap): int32
    counts, float32 masses summed over tensors, and a float32
    `erased_fraction`, NaN at a step without proposals."""
    return counting.of_state(self, _COUNTS, masses=_MASSES, host=False)

  def report(self) -> dict[str, int | float]:
    """The telemetry as plain numbers: totals, then `<word>/<path>`.

    Keys: `steps`; `proposals` (finite `u != 0`); `erased` (from the
    weight: `u != 0` and `w' == w`; the proposal may still sit in the
    correction); `moved` (`w' != w`); `nonfinite` (a NaN or infinite `u`
    or weight: never a proposal); `lost` (the code could not hold `e`:
    `rho'` saturated, or rounded a nonzero `e` to 0); `carried` (sum of
    `|v - w|` after the update: the decoded corrections); `lost_mass`
    (sum of `|e - decoded correction|`, i.e. `|v' - rebuilt v'|`: what
    the split dropped from the value); `erased_fraction`; and each per
    parameter path. Counts are exact integers, masses and fractions floats.
    """
    return counting.of_state(
      jax.device_get(self._replace(correction={})),
      _COUNTS,
      masses=_MASSES,
      host=True,
    )


def split_writeback(
  fmt="bfloat16",
  correction_bits: int = 8,
  *,
  nonfinite: str = "keep",
  telemetry: bool = True,
) -> optax.GradientTransformation:
  """A bfloat16 weight and a k-bit correction, split again at every step.

  For each parameter `w` (bfloat16 values, stored as bfloat16 or as
  float32 holding them) with its code `rho` and proposal `u`, with
  `K = 2^(k-1) - 1` and `ulp(w) = 2^(E-7)` (`E` the bfloat16 exponent of
  `|w|`, -126 for zero and subnormals; the module docstring has the
  details):

    v = RN32(w + rho / K * ulp(w) / 2),    v' = RN32(v + u),
    w' = RN_bf16(v'),    rho' = RNE(clip((v' - w') / (ulp(w') / 2),
    -1, 1) * K).

  The emitted delta `w' - w` lands exactly through `optax.apply_updates`,
  as in `writeback`. A proposal below half a gap of the weight is erased
  from the weight but kept in the code, down to half a code step
  (`ulp / (4 K)`); the code's rounding error is counted as `lost`
  where it drops `e` entirely. Where `u` is zero the weight and its code
  keep their bits. Non-finite `u` or weights follow `nonfinite`: "keep"
  leaves weight and code as they were and counts them; "propagate" writes
  `RN_bf16(v + u)` (NaN stays NaN, infinities saturate) with code 0.

  Telemetry (`lowprec.telemetry`): `proposals`, `erased` (from the
  weight), `moved`, `nonfinite`, `lost`, `lost_mass`, `carried`,
  `erased_fraction`, in total and per parameter path; see
  `SplitState.report`.

  Args:
    fmt: "bfloat16" (default) for every parameter, or a format
      specification (pytree or rules) whose formats are bfloat16 or None
      (None passes the update through).
    correction_bits: 8 (an int8 code: 3 bytes per parameter with the
      weight) or 16 (an int16 code: 4 bytes).
    nonfinite: "keep" (default) or "propagate".
    telemetry: keep the counts in the state.

  Returns:
    An `optax.GradientTransformation` whose state is a `SplitState`
      holding one code per parameter with a format, zero at `init`.

  Raises:
    ValueError: as `writeback`; also, when the transform is built,
      `correction_bits` other than 8 or 16, and a weight format other than
      bfloat16 (scaled formats included), naming the fix.

  Example:
    ```python
    params = lowprec.to_grid(params, "bfloat16", storage="native")
    opt = optax.chain(
        lowprec.in_float32(optax.adamw(1e-3)),
        lowprec.split_writeback("bfloat16", correction_bits=8),
    )
    updates, state = opt.update(grads, opt.init(params), params)
    params = optax.apply_updates(params, updates)
    lowprec.telemetry(state)["lost"]
    ```

  Reference: Ortiz et al., "FlashOptim: Optimizers for Memory Efficient
  Training" (Databricks, 2026).
  """
  if correction_bits not in CORRECTION_BITS:
    raise ValueError(
      f"split_writeback: correction_bits={correction_bits!r}; valid: 8 "
      "(an int8 correction, 3 bytes per parameter with the bfloat16 "
      "weight) or 16 (int16, 4 bytes)"
    )
  choices.check_choice("nonfinite mode", nonfinite, NONFINITE_MODES)
  map_spec(fmt, _bfloat16_only)
  lookup = format_lookup(fmt)
  dtype, top = _CODES[correction_bits]
  recipe = record.Recipe(
    "split_writeback", (("correction_bits", str(correction_bits)),)
  )

  def init_fn(params):
    codes = {
      name: jnp.zeros_like(w, dtype)  # takes a concrete param's sharding
      for name, (_, _, w) in leafwise.weights(lookup, params, fmt).items()
    }
    zeros = dict.fromkeys(_FIELDS)
    if telemetry:
      i32, f32 = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32)
      zeros = {f: dict.fromkeys(codes, i32) for f in _COUNTS}
      zeros.update({f: dict.fromkeys(codes, f32) for f in _MASSES})
    return SplitState(
      count=jnp.zeros([], jnp.int32), correction=codes, **zeros, recipe=recipe
    )

  def update_fn(updates, state, params=None):
    record.check(
      state.recipe,
      recipe,
      "Continue it with the recorded correction_bits, or start a new state "
      "with init",
    )

    def leaf(path, w, u, f, bits):
      del bits
      rho = state.correction[path_name(path)]
      st = _split_step(w, u, rho.astype(jnp.int32), f, top, nonfinite)
      counts = _counts(st) if telemetry else None
      return st.delta, (st.rho.astype(rho.dtype), counts)

    deltas, _, kept = leafwise.step(
      "split_writeback", lookup, updates, params, None, leaf
    )
    per = {n: k[1] for n, k in kept.items()}
    counts = counting.by_field(per, _FIELDS, telemetry)
    new_state = SplitState(
      count=optax.safe_increment(state.count),
      correction={n: k[0] for n, k in kept.items()},
      **counts,
      recipe=recipe,
    )
    return deltas, new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _bfloat16_only(f):
  if f is None:
    return None
  if scaled.is_scaled(f):
    fmt = scaled.get_scaled_format(f)
    raise ValueError(
      f"split_writeback: {fmt.name!r} is a scaled format; a split weight "
      "is a bfloat16 value plus a correction in units of its own ulp, and "
      "a block scale that moves with the block's maximum would move every "
      "value of the block under its correction. Use lowprec.writeback("
      f"{fmt.name!r}, rounding='stochastic', key=...) for a scaled grid, "
      "or split_writeback('bfloat16')"
    )
  fmt = f if isinstance(f, Format) else get_format(f)
  if (fmt.kind, fmt.exp_bits, fmt.man_bits) != ("float", 8, 7):
    raise ValueError(
      f"split_writeback: the weight format is {fmt}, but the split keeps a "
      "bfloat16 weight and a correction in units of the bfloat16 ulp. Give "
      "the parameters 'bfloat16' (or None to leave them alone), or use "
      "kahan_writeback(fmt, buffer='bfloat16') for other grids"
    )
  return fmt


# ---- one tensor ------------------------------------------------------------


class _Step(NamedTuple):
  delta: jax.Array  # float32: lands w on w'
  rho: jax.Array  # int32: the new code
  proposed: jax.Array  # bool: finite u != 0
  written: jax.Array  # bool: where the pair was split again
  finite: jax.Array  # bool: u and w finite
  lost: jax.Array  # bool: the code could not hold e
  carried: jax.Array  # float32: |v - w| after the update
  dropped: jax.Array  # float32: |v' - rebuilt v'| where written


def _split_step(w, u, rho, fmt: Format, top: int, nonfinite: str) -> _Step:
  """One tensor: float32 `w` (bfloat16 values), float32 `u`, int32 `rho`."""
  # _ftz also keeps u as the optimizer emitted it: XLA:CPU would contract
  # AdamW's last multiply and `v + u` into an FMA, but not through a select.
  u = _ftz(u)
  finite = jnp.isfinite(u) & jnp.isfinite(w)
  written = (u != 0) & finite
  if nonfinite == "propagate":
    written = written | ~finite
  v = jnp.where(jnp.isfinite(w), _rebuild(w, rho, top), w)
  vp = _ftz(v + u)
  enc = encode(Codec(fmt, "nearest", overflow="saturate"), vp)
  q = jnp.where(written & (enc.value != w), enc.value, w)
  delta, lands = land(w, q, fmt)
  # The weight that landed (rarely not q: see lowprec.engine.codec.land); the
  # code is taken against it, so the pair always rebuilds what it holds.
  new_w = jnp.where(lands, q, w + delta)
  code, clipped, units = _code(vp, new_w, top)
  ok = written & jnp.isfinite(vp)
  new_rho = jnp.where(written, jnp.where(ok, code, 0), rho)
  lost = written & finite & (clipped | ((units != 0) & (code == 0)))
  new_v = _rebuild(new_w, new_rho, top)
  held = jnp.where(jnp.isfinite(new_w), _ftz(new_v - new_w), 0.0)
  dropped = jnp.where(ok, _ftz(vp - new_v), 0.0)
  proposed = (u != 0) & finite
  return _Step(delta, new_rho, proposed, written, finite, lost, held, dropped)


def _counts(st: _Step) -> tuple:
  moved = st.written & (st.delta != 0)
  erased = st.proposed & (st.delta == 0)
  counts = tally(st.proposed, erased, moved, ~st.finite, st.lost)
  return counts + (mass(st.carried), mass(st.dropped))


# ---- the arithmetic, on bit patterns ----------------------------------------


def _ftz(x):
  """`x` with float32 subnormals flushed to zero (sign kept)."""
  b = jax.lax.bitcast_convert_type(x, jnp.uint32)
  tiny = (b & jnp.uint32(0x7F800000)) == 0
  b = jnp.where(tiny, b & jnp.uint32(0x80000000), b)
  return jax.lax.bitcast_convert_type(b, jnp.float32)


def _bf16_parts(x):
  """Of float32 `x` on the bfloat16 grid: `E` (int32, -126 for zero and
  subnormals) and the signed significand `m` (int32, |m| < 256) with
  `x = m * 2^(E - 7)`."""
  b = jax.lax.bitcast_convert_type(x, jnp.uint32)
  field = ((b >> 23) & 0xFF).astype(jnp.int32)
  m = ((b >> 16) & 0x7F).astype(jnp.int32) | jnp.where(field > 0, 0x80, 0)
  m = jnp.where((b >> 31) == 1, -m, m)
  return jnp.maximum(field, 1) - 127, m


def _rebuild(w, rho, top: int):
  """float32 nearest to `w + rho / top * ulp(w) / 2`, zero below 2^-126.

  With `x = w / 2^(E-8) + rho / top = n / top` (`n` an integer below 2^24
  in magnitude), `x` is rounded to 24 significant bits from the quotient
  and remainder of `|n| 2^16` by `top` (`_quotient`), then scaled by
  `2^(E-8)` on its exponent field.
  """
  big_e, m = _bf16_parts(w)
  n = 2 * m * top + rho
  f, r1 = _quotient(m, rho, n, top)
  k = jnp.uint32(top)
  # 24 significant bits: f itself for x in [128, 256), f >> 1 above.
  wide = f >= (1 << 24)
  drop = wide.astype(jnp.uint32)
  sig = f >> drop
  # Ties cannot occur with an odd `top` (n / top is never an odd multiple
  # of half a unit), but rounding to even costs nothing.
  half_up = ((f & 1) == 1) & ((r1 != 0) | ((sig & 1) == 1))
  sig = sig + jnp.where(wide, half_up, 2 * r1 > k).astype(jnp.uint32)
  carry = sig >= (1 << 24)
  sig = jnp.where(carry, sig >> 1, sig)
  ex = 7 + drop.astype(jnp.int32) + carry.astype(jnp.int32)
  biased = ex + big_e - 8 + 127
  normal = (f >= (1 << 23)) & (biased >= 1)
  sign = jnp.where(n < 0, jnp.uint32(0x80000000), jnp.uint32(0))
  mag = (jnp.maximum(biased, 0).astype(jnp.uint32) << 23) | (sig & 0x7FFFFF)
  bits = sign | jnp.where(normal, mag, jnp.uint32(0))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _quotient(m, rho, n, top: int):
  """`floor(|n| 2^16 / top)` and its remainder (uint32), for `n = 2 m top +
  rho` with `m` a bfloat16 significand and `rho` any int8 (int16) code,
  `|rho| <= top + 1`, without an integer division: x86 has no vector one,
  so XLA:CPU would divide element by element.

  `|n| = 2 |m| top + t` with `t` the code signed as `n` (a nonzero `m`
  gives `n` its sign, `2 top > |rho|`), so `|n| = q0 top + r0` with `q0 =
  2 |m| + s`, `s = floor(t / top)` (-2, -1, 0 or 1 for `t` from `-top - 1`
  to `top + 1`) and `r0 = t - s top` in `[0, top)`. With the constants
  `2^16 = Q top + R`, `r0 2^16 = (Q r0) top + R r0` where `R r0 < R top`:
  the quotient is `Q r0` plus the number of multiples `i top` (`0 < i <
  R`) at or below `R r0`. These are integer identities, so the bits are
  those of the division (tests/split_test.py compares the two on every
  `m` and every code).
  """
  t = jnp.where(n < 0, -rho, rho)
  s = (t >= top).astype(jnp.int32) - (t < 0) - (t < -top)
  q0 = 2 * jnp.abs(m) + s
  r0 = t - s * top
  big_q, big_r = divmod(1 << 16, top)  # 516, 4 (K = 127); 2, 2 (32767)
  more = sum((big_r * r0 >= i * top).astype(jnp.int32) for i in range(1, big_r))
  f = (q0 << 16) + big_q * r0 + more
  r1 = big_r * r0 - more * top
  return f.astype(jnp.uint32), r1.astype(jnp.uint32)


def _code(vp, new_w, top: int):
  """The code of `e = vp - new_w` and where it was clipped, and `e` in
  units of `2^(E'-24)` (2^16 units are half the ulp of `new_w`), exact
  where it is within the clip."""
  big_e, m = _bf16_parts(new_w)
  b = jax.lax.bitcast_convert_type(vp, jnp.uint32)
  field = ((b >> 23) & 0xFF).astype(jnp.int32)
  sig = (b & 0x7FFFFF).astype(jnp.int32) | jnp.where(field > 0, 1 << 23, 0)
  # vp in units of 2^(E'-24): its significand shifted by its exponent
  # relative to E' - 1. Only shifts of 0 or 1 (and vp == 0) can be within
  # the clip; anything else is far outside it.
  shift = field - 127 - big_e + 1
  near = (field == 0) | (shift == 0) | (shift == 1)
  vu = jnp.where(shift == 1, sig << 1, sig)
  vu = jnp.where((b >> 31) == 1, -vu, vu)
  units = jnp.where(near, vu - m * (1 << 17), 0)
  far = jnp.where(vp > new_w, 2 * _HALF_ULP_UNITS, -2 * _HALF_ULP_UNITS)
  units = jnp.where(near, units, far)
  clipped = jnp.abs(units) > _HALF_ULP_UNITS
  p = jnp.clip(units, -_HALF_ULP_UNITS, _HALF_ULP_UNITS) * top
  a = jnp.abs(p).astype(jnp.uint32)
  q = a >> 16
  rem = a & 0xFFFF
  up = (rem > 0x8000) | ((rem == 0x8000) & ((q & 1) == 1))
  code = (q + up.astype(jnp.uint32)).astype(jnp.int32)
  return jnp.where(p < 0, -code, code), clipped, units


# ---- values of split pairs ---------------------------------------------------


def rebuild(w, rho) -> jax.Array:
  """The float32 values of split pairs: `RN32(w + rho / K * ulp(w) / 2)`.

  Args:
    w: bfloat16 weights (or float32 holding bfloat16 values).
    rho: their codes, int8 (K = 127) or int16 (K = 32767), as a
      `SplitState` holds them.

  Returns:
    float32 values, shaped like `w`; zero below `2^-126`, and the weight
      itself where it is not finite.

  Raises:
    ValueError: `rho` is not int8 or int16.

  Example:
    >>> w = jnp.bfloat16([1.0])
    >>> rho = jnp.int8([64])  # w + 64/127 2^-8
    >>> float(lowprec.optim.split.rebuild(w, rho)[0])
    1.001968502998352
  """
  rho = jnp.asarray(rho)
  top = {d: t for d, t in _CODES.values()}.get(np.dtype(rho.dtype))
  if top is None:
    raise ValueError(
      f"rebuild: the codes are {rho.dtype}; a split_writeback correction "
      "is int8 (correction_bits=8) or int16 (correction_bits=16)"
    )
  w = jnp.asarray(w).astype(jnp.float32)
  v = _rebuild(w, rho.astype(jnp.int32), top)
  return jnp.where(jnp.isfinite(w), v, w)


def split_value(v, correction_bits: int = 8) -> tuple[jax.Array, jax.Array]:
  """The nearest split of float32 values: `(w, rho)`.

  `w = RN_bf16(v)` (saturating) as bfloat16 and `rho` its code, as
  `split_writeback` keeps them: to start a run from float32 weights, put
  `w` in the params and `rho` in the state's `correction`.

  Args:
    v: float32 values (float32 subnormals are read as zero).
    correction_bits: 8 (int8 codes) or 16 (int16).

  Returns:
    `(w, rho)`: bfloat16 weights and int8 or int16 codes, shaped like `v`;
      the code is 0 where `v` is not finite.

  Raises:
    ValueError: `correction_bits` other than 8 or 16.

  Example:
    >>> w, rho = lowprec.optim.split.split_value(jnp.float32([1 + 2**-9]))
    >>> float(w[0]), int(rho[0])  # a quarter ulp: 63.5, to even
    (1.0, 64)
  """
  if correction_bits not in CORRECTION_BITS:
    raise ValueError(
      f"split_value: correction_bits={correction_bits!r}; valid: 8 or 16"
    )
  dtype, top = _CODES[correction_bits]
  v = _ftz(jnp.asarray(v, jnp.float32))
  w = encode(Codec(_BF16, "nearest", overflow="saturate"), v).value
  code, _, _ = _code(v, w, top)
  rho = jnp.where(jnp.isfinite(v), code, 0).astype(dtype)
  return w.astype(jnp.bfloat16), rho

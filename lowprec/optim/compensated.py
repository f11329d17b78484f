"""Compensated write-back: low-precision weights that keep what rounding drops.

`lowprec.writeback` writes `w' = Q(w + u)` and a proposal below half a gap
is erased for good. The three transforms here keep the part of `y` that the
weight's rounding drops in a small per-coordinate buffer held in the
optimizer state, natively in a narrow dtype, and feed it back at the next
step. None of them keeps a float32 copy of the weights:

* `kahan_writeback`: weight `w` on its grid `G`, buffer `c` on a grid `G_c`
  (bfloat16 by default, float8 allowed):
  `y = u + c`, `w' = Q(w + y)`, `c' = Q_c(y - (w' - w))`.
  Bytes per parameter: `G` + `G_c` (2 + 2 for bf16 weights and buffer).
* `two_component_writeback` (Collage-style): value `a` (the weight the model
  uses) and error `e`, both on `G`, represent `a + e`; the exact two-sum of
  `a` and `y = u + e` is formed in float32 and both parts are rounded back
  to `G`, so the pair carries about twice `G`'s precision. Bytes: 2 `G`.
* `remainder_writeback` (bfloat16 only): the 32 bits of a float32 master
  are split into the bfloat16 weight the model uses (the top 16 bits, i.e.
  the master truncated toward zero) and a uint16 remainder (the low 16
  bits). Each step rebuilds the master exactly, adds `u` in float32 and
  splits it again, so a run equals, bit for bit, a float32-master run whose
  model computes with the truncated bfloat16 view. Bytes: 2 + 2.

They go last in an optax chain, like `writeback`, and return float32 deltas
that land exactly through `optax.apply_updates` (`lowprec.apply_updates`
for float8 params). Their telemetry is read with `lowprec.telemetry`. They
take unscaled grids: a scaled (MX) format is refused when the transform is
built, and the error names `lowprec.writeback` with stochastic rounding.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import counting, leafwise
from lowprec.engine.codec import Codec, encode, land, stored_dtype, tally
from lowprec.engine.counting import mass
from lowprec.engine.weights import format_lookup, path_name
from lowprec.grids import choices, scaled
from lowprec.grids import rng as rng_lib
from lowprec.grids.formats import Format, get_format
from lowprec.grids.rounding import OVERFLOW_MODES
from lowprec.optim.writeback import NONFINITE_MODES

# How the weight is rounded under compensation. Dead-zone SR is left out:
# it exists to move coordinates that nearest rounding would freeze, and the
# buffer already carries what nearest rounding drops.
COMPENSATED_ROUNDINGS = ("nearest", "stochastic")

_COUNTS = ("proposals", "erased", "moved", "saturated", "unreachable")
_COUNTS += ("nonfinite", "lost")
_MASSES = ("carried", "lost_mass")
_FIELDS = _COUNTS + _MASSES
_BF16 = get_format("bfloat16")


class CompensatedState(NamedTuple):
  """State of the compensated write-backs: buffers, a key and counts.

  `buffer` maps each parameter path that has a format to its buffer, shaped
  like the parameter: the Kahan buffer `c` in its format's native dtype
  (float32 holding grid values where there is none), the two-component
  error `e` likewise, or the remainder's low 16 bits as uint16. Counts are
  dicts from path to int32 scalars and masses to float32 scalars, for the
  last update; None with `telemetry=False`.
  """

  count: jax.Array  # int32 []: updates applied so far.
  key: jax.Array | None  # uint32 [2] key data, split each update; None (RN).
  buffer: dict[str, jax.Array]  # per path: like the param; bf16/fp8/uint16.
  proposals: dict[str, jax.Array] | None  # int32 [] per path: finite u != 0.
  erased: dict[str, jax.Array] | None  # int32 []: u != 0 and w' == w.
  moved: dict[str, jax.Array] | None  # int32 [] per path: w' != w.
  saturated: dict[str, jax.Array] | None  # int32 [] per path: past max.
  unreachable: dict[str, jax.Array] | None  # int32 [] per path: detoured.
  nonfinite: dict[str, jax.Array] | None  # int32 []: u, buffer or w bad.
  lost: dict[str, jax.Array] | None  # int32 []: residual != 0, buffer 0.
  carried: dict[str, jax.Array] | None  # float32 []: sum |buffer value|.
  lost_mass: dict[str, jax.Array] | None  # float32 []: sum |r - buffer|.

  def arrays(self) -> dict[str, jax.Array]:
    """The telemetry as arrays, traceable: keys as in `report()`.

    Counts are int32, `carried` and `lost_mass` float32 sums over tensors,
    `erased_fraction` float32 (NaN without proposals).
    """
    return counting.of_state(self, _COUNTS, masses=_MASSES, host=False)

  def report(self) -> dict[str, int | float]:
    """The telemetry as plain numbers: totals, then `<word>/<path>`.

    Keys: `steps`; `proposals` (finite `u != 0`); `erased` (from the
    weight: `u != 0` and `w' == w`; the mass may still sit in the buffer);
    `moved` (`w' != w`, which the buffer alone can cause); `saturated`;
    `unreachable` (as in `writeback`); `nonfinite` (a NaN or infinite
    `u + c`, or a NaN weight: never a proposal or a move); `lost` (the
    buffer's own rounding dropped a nonzero residual entirely); `carried`
    (sum of |buffer value| after the update: the mass waiting to be
    written); `lost_mass` (sum of |residual - stored buffer|: what the
    buffer's rounding dropped, in whole or in part); `erased_fraction`;
    and each per parameter path. Counts are exact integers, masses and
    fractions floats.
    """
    return counting.of_state(
      jax.device_get(self._replace(key=None, buffer={})),
      _COUNTS,
      masses=_MASSES,
      host=True,
    )


def kahan_writeback(
  fmt,
  rounding: str = "nearest",
  *,
  buffer="bfloat16",
  key: jax.Array | None = None,
  overflow: str = "saturate",
  nonfinite: str = "keep",
  telemetry: bool = True,
) -> optax.GradientTransformation:
  """Write-back with a Kahan buffer: what the weight's rounding drops is kept.

  For each parameter `w` on its grid `G`, with proposal `u` and buffer `c`
  on the grid `G_c` (all arithmetic in float32):

    y = u + c,    w' = Q(w + y),    c' = Q_c(y - (w' - w)),

  where `Q` is nearest or stochastic rounding onto `G` and `Q_c` nearest
  rounding onto `G_c` (saturating). The emitted delta `w' - w` lands
  exactly, as in `writeback`. A sub-half-gap proposal is erased from the
  weight but carried in `c` until the carried mass moves the weight; it is
  lost only where `Q_c` itself rounds the residual `r = y - (w' - w)` away.
  The buffer's gap is relative to `|c|`, so with a bfloat16 buffer the
  loss is second order (`~2^-9 |r|`); a float8 buffer without a scale
  flushes residuals below its smallest subnormal (`2^-9` for e4m3fn, `2^-16`
  for e5m2), a first-order loss for weights of order one.

  Where `y == 0` (a proposal that cancels the buffer exactly) the weight
  keeps its bits and the buffer is still written: `c' = y`, zero. Non-finite
  `u + c` and NaN weights follow `nonfinite` as in `writeback`; under
  "keep" the buffer is kept too. The buffer starts at zero.

  Telemetry (`lowprec.telemetry`): `proposals`, `erased` (from the
  weight), `moved`, `saturated`, `unreachable`, `nonfinite`, `lost`
  (`r != 0` and `c' == 0`), `carried` (sum `|c'|`), `lost_mass` (sum
  `|r - c'|`, the buffer's whole and partial losses), `erased_fraction`;
  see `CompensatedState.report`.

  Args:
    fmt: the weights' format specification, as in `writeback`.
    rounding: "nearest" or "stochastic" rounding of the weight.
    buffer: the buffer's format specification (one format, a pytree or
      `(regex, format)` rules over parameter paths): a floating-point
      format no wider than float32, e.g. "bfloat16" (default),
      "float8_e5m2", "float8_e4m3fn", "float16" or "float32".
    key: a JAX PRNG key, required by "stochastic".
    overflow: "saturate" (default) or "ieee", for the weight.
    nonfinite: "keep" (default) or "propagate".
    telemetry: keep the counts in the state.

  Returns:
    An `optax.GradientTransformation` whose state is a `CompensatedState`
      holding one buffer per parameter with a format.

  Raises:
    ValueError: as `writeback`; also, when the transform is built,
      "deadzone" rounding, a scaled (MX) weight format (the message names
      `lowprec.writeback(fmt, rounding="stochastic", ...)` and Kahan on the
      element grid), or a buffer format wider than float32, integer or
      scaled; at `init`, a parameter with a weight format and no buffer
      format.

  Example:
    ```python
    params = lowprec.to_grid(params, "bfloat16", storage="native")
    opt = optax.chain(
        lowprec.in_float32(optax.adamw(1e-3)),
        lowprec.kahan_writeback("bfloat16", buffer="bfloat16"),
    )
    updates, state = opt.update(grads, opt.init(params), params)
    params = optax.apply_updates(params, updates)
    lowprec.telemetry(state)["carried"]
    ```

  Reference: Kahan, "Further remarks on reducing truncation errors" (1965);
  Zamirai et al., "Revisiting BFloat16 Training" (2020).
  """
  _refuse_scaled(
    "kahan_writeback",
    fmt,
    "Kahan on the plain grid of its elements: kahan_writeback({elem!r}, "
    "buffer='bfloat16')",
  )
  buffers = _buffer_lookup(buffer)
  return _compensated(
    "kahan_writeback",
    fmt,
    rounding,
    key,
    overflow,
    nonfinite,
    telemetry,
    lambda path, f: buffers(path),
    two_sum=False,
  )


def two_component_writeback(
  fmt,
  rounding: str = "nearest",
  *,
  key: jax.Array | None = None,
  overflow: str = "saturate",
  nonfinite: str = "keep",
  telemetry: bool = True,
) -> optax.GradientTransformation:
  """Write-back onto a two-component float `a + e`, both parts on `G`.

  The weight the model uses is `a`; the state holds `e`, on the same grid
  `G` (in its native dtype where there is one). With `y = u + e`, the exact
  two-sum of `a` and `y` is formed in float32 (Fast2Sum where `|a| >= |y|`,
  else TwoSum):

    s = fl(a + y),    t = (a + y) - s exactly,
    a' = Q(s),        e' = RN_G((s - a') + t),

  so `a' + e'` holds `a + y` to about twice `G`'s precision (16 significand
  bits for bfloat16) while the model sees an ordinary `G` weight.
  This is Kahan summation (`kahan_writeback`) with the buffer on the
  weight's own grid, computed through an exact sum: the pair costs two
  `G` values per parameter and no float32 copy.

  Telemetry as `kahan_writeback`, with `e` in the buffer's place.

  Args:
    fmt: the weights' format specification, as in `writeback`.
    rounding: "nearest" or "stochastic" rounding of `a`.
    key: a JAX PRNG key, required by "stochastic".
    overflow: "saturate" (default) or "ieee", for `a`.
    nonfinite: "keep" (default) or "propagate".
    telemetry: keep the counts in the state.

  Returns:
    An `optax.GradientTransformation` whose state is a `CompensatedState`.

  Raises:
    ValueError: as `kahan_writeback`; also, at `init`, a weight format
      that is not a floating-point format.

  Example:
    ```python
    opt = optax.chain(
        lowprec.in_float32(optax.adamw(1e-3)),
        lowprec.two_component_writeback("bfloat16"),
    )
    ```

  Reference: Yu et al., "Collage: Light-Weight Low-Precision Strategy for
  LLM Training" (ICML 2024).
  """

  _refuse_scaled(
    "two_component_writeback",
    fmt,
    "a two-component float on the plain grid of its elements: "
    "two_component_writeback({elem!r})",
  )

  def on_grid(path, f: Format) -> Format:
    if not f.is_float:
      raise ValueError(
        f"two_component_writeback: parameter {path_name(path)!r} is on "
        f"the {f} grid; a two-component float needs a floating-point grid. "
        "Use kahan_writeback(fmt, buffer='bfloat16') for integer grids"
      )
    return f

  return _compensated(
    "two_component_writeback",
    fmt,
    rounding,
    key,
    overflow,
    nonfinite,
    telemetry,
    on_grid,
    two_sum=True,
  )


def remainder_writeback(
  fmt="bfloat16", *, nonfinite: str = "keep", telemetry: bool = True
) -> optax.GradientTransformation:
  """A float32 master split into the bfloat16 weight and a 16-bit remainder.

  For each parameter `w` on the bfloat16 grid with remainder `r` (uint16):

    m  = bits(w)[31:16] : r          (the float32 master, exactly),
    m' = fl32(m + u),
    w' = trunc_bf16(m') = bits(m')[31:16],    r' = bits(m')[15:0].

  The bfloat16 view is the master truncated toward zero, not rounded to
  nearest: with truncation the split is exact and the remainder is simply
  the low 16 bits, and truncation never overflows. (A ties-to-even view
  cannot be rebuilt from 16 bits: a tie rounded up and a tie kept give the
  same even view and the same remainder.) So a run equals, bit for bit, a
  float32-master run whose model computes with `trunc_bf16(master)`; the
  view lies within one bfloat16 ulp of the master, toward zero, and the
  master carries no drift.

  The transforms before it in the chain see the bfloat16 view as `params`
  (so decoupled weight decay multiplies the view, not the master: a
  difference of under one bfloat16 ulp of the weight, times the decay).

  Telemetry as `kahan_writeback`, where the residual is float32 addition
  to the master: `lost` counts `u != 0` with `m' == m` (float32 itself
  erased the proposal), `lost_mass` sums `|(m + u) - m'|` (what float32
  addition dropped, computed exactly by a two-sum) and `carried` sums
  `|m' - w'|`. `saturated` is always 0 (an infinite master stays
  infinite, as in float32).

  Args:
    fmt: "bfloat16" (default) for every parameter, or a format
      specification (pytree or rules) whose formats are bfloat16 or None
      (None passes the update through).
    nonfinite: "keep" (default) or "propagate".
    telemetry: keep the counts in the state.

  Returns:
    An `optax.GradientTransformation` whose state is a `CompensatedState`
      with uint16 remainders, starting at zero (the master equals the
      initial bfloat16 weights).

  Raises:
    ValueError: as `writeback`; also a scaled (MX) format when the
      transform is built, and at `init` a parameter on another grid than
      bfloat16.

  Example:
    ```python
    params = lowprec.to_grid(params, "bfloat16", storage="native")
    opt = optax.chain(
        lowprec.in_float32(optax.adamw(1e-3)),
        lowprec.remainder_writeback(),
    )
    ```

  Reference: Zamirai et al., "Revisiting BFloat16 Training" (2020), and
  the split float32 master of "8-bit Optimizers via Block-wise
  Quantization" (Dettmers et al., 2022).
  """

  _refuse_scaled(
    "remainder_writeback",
    fmt,
    "a float32 master split over the bfloat16 grid: "
    "remainder_writeback('bfloat16')",
  )

  def bf16_only(path, f: Format) -> None:
    if (f.kind, f.exp_bits, f.man_bits) != ("float", 8, 7):
      raise ValueError(
        f"remainder_writeback: parameter {path_name(path)!r} is on the {f} "
        "grid, but a remainder splits a float32 master into a bfloat16 "
        "weight and its low 16 bits, which only the bfloat16 grid allows. "
        "Give it 'bfloat16' (or None), or use kahan_writeback(fmt, "
        "buffer=...) for other grids"
      )

  return _compensated(
    "remainder_writeback",
    fmt,
    "nearest",
    None,
    "saturate",
    nonfinite,
    telemetry,
    bf16_only,
    two_sum=False,
    remainder=True,
  )


# ---- the shared transform -----------------------------------------------


_WIDER = ("float64", "double", "f8", "complex64", "complex128")


def buffer_format(f) -> Format:
  name = np.dtype(f).name if isinstance(f, np.dtype | type) else f
  if isinstance(name, str):
    name = name.strip()
    if name in _WIDER:
      raise ValueError(
        f"buffer format {name!r} is wider than float32: the compensated "
        "write-back computes in float32, so a wider buffer holds nothing "
        "more. Use buffer='float32' at most, or 'bfloat16' (the default)"
      )
    if _INT_NAME.match(name):  # before get_format asks for a scale
      raise _integer_buffer(name)
  if scaled.is_scaled(f):
    elem = scaled.get_scaled_format(f).element.name
    raise ValueError(
      f"buffer format {str(name)!r} is a scaled format; the buffer is one "
      "plain grid per coordinate, whose gap already follows |c|. Use "
      f"buffer={elem!r} (its element format) or 'bfloat16' (the default)"
    )
  fmt = get_format(f)
  if not fmt.is_float:
    raise _integer_buffer(fmt.name)
  return fmt


# An integer format's name, with or without a suffix ("int8", "int8:...").
_INT_NAME = re.compile(r"int\d")


def _integer_buffer(name: str) -> ValueError:
  return ValueError(
    f"buffer format {name!r} is an integer grid; the buffer holds small "
    "residuals of either magnitude and needs a floating-point format, "
    "e.g. buffer='bfloat16' or 'float8_e5m2'"
  )


def _refuse_scaled(caller: str, spec, other: str) -> None:
  """Raises for a scaled format anywhere in the weights' spec `spec`;
  `other` is the fix on a plain grid, with `{elem}` for the element."""

  def check(f):
    if f is not None and scaled.is_scaled(f):
      fmt = scaled.get_scaled_format(f)
      raise ValueError(
        f"{caller}: {fmt.name!r} is a scaled format, and the compensated "
        "write-backs here cover unscaled grids: on a scaled grid a "
        "block's scale moves with its maximum and moves every value of "
        "the block, which the buffer, its telemetry and its prediction "
        "would have to carry too. Use lowprec.writeback("
        f"{fmt.name!r}, rounding='stochastic', key=...) (stochastic "
        "rounding removes the persistent freeze on a scaled grid), or "
        + other.format(elem=fmt.element.name)
      )
    return f

  _parsed_spec(spec, check)


def _buffer_lookup(spec):
  def parse(f):
    if f is None:
      return None
    return buffer_format(f)

  lookup = format_lookup(_parsed_spec(spec, parse))

  def buffer_of(path) -> Format:
    f = lookup(path)
    if f is None:
      raise ValueError(
        f"kahan_writeback: parameter {path_name(path)!r} has a weight "
        "format but its buffer format is None; give it a buffer format "
        "(e.g. 'bfloat16'), or leave the weight alone with a None weight "
        "format"
      )
    return f

  return buffer_of


def _parsed_spec(spec, parse):
  """`spec` with its formats checked by `parse` (rules, pytree or one)."""
  if isinstance(spec, list | tuple) and all(
    isinstance(r, tuple | list) and len(r) == 2 and isinstance(r[0], str)
    for r in spec
  ):
    return [(p, parse(f)) for p, f in spec]
  return jax.tree.map(
    parse,
    spec,
    is_leaf=lambda x: (
      x is None or isinstance(x, str | Format | scaled.ScaledFormat | np.dtype)
    ),
  )


def _compensated(
  caller,
  fmt,
  rounding,
  key,
  overflow,
  nonfinite,
  telemetry,
  buffer_of,
  *,
  two_sum: bool,
  remainder: bool = False,
):
  """The transform shared by the three remedies. `buffer_of(path, f)`
  gives the buffer's format for a parameter on `f` (None for the
  remainder's uint16) and raises for a parameter the remedy cannot take."""
  if rounding == "deadzone":
    raise ValueError(
      f"{caller} does not take rounding='deadzone': dead-zone SR moves "
      "the coordinates that nearest rounding would freeze, and the buffer "
      "already carries what nearest rounding drops. Use rounding="
      "'nearest' (or 'stochastic')"
    )
  choices.check_choice("rounding", rounding, COMPENSATED_ROUNDINGS)
  choices.check_choice("overflow mode", overflow, OVERFLOW_MODES)
  choices.check_choice("nonfinite mode", nonfinite, NONFINITE_MODES)
  lookup = format_lookup(fmt)
  random = rounding == "stochastic"
  key_state = None
  if random:
    key_state = rng_lib.state_key(key, f"{caller}(rounding={rounding!r})")
  rule = _Compensated(overflow, nonfinite, telemetry, two_sum, remainder)

  def init_fn(params):
    buffers = {}
    for name, (path, f, w) in leafwise.weights(lookup, params, fmt).items():
      b = buffer_of(path, f)  # raises for a weight the remedy cannot take
      dtype = np.uint16 if remainder else stored_dtype(b)
      # zeros_like takes the sharding of a concrete parameter, as optax
      # does for its moments.
      buffers[name] = jnp.zeros_like(w, dtype)
    zeros = {}
    if telemetry:
      zeros = {
        f: dict.fromkeys(buffers, jnp.zeros([], jnp.int32)) for f in _COUNTS
      }
      zeros.update(
        {f: dict.fromkeys(buffers, jnp.zeros([], jnp.float32)) for f in _MASSES}
      )
    return CompensatedState(
      count=jnp.zeros([], jnp.int32),
      key=key_state[0] if random else None,
      buffer=buffers,
      **(zeros or dict.fromkeys(_FIELDS)),
    )

  def update_fn(updates, state, params=None):
    def leaf(path, w, u, f, bits):
      c = state.buffer[path_name(path)]
      delta, new_c, counts = rule(w, u, c, f, buffer_of(path, f), bits)
      return delta, (new_c.astype(c.dtype), counts)

    ks = (state.key, key_state[1]) if random else None
    deltas, new_key, kept = leafwise.step(
      caller, lookup, updates, params, ks, leaf
    )
    per = {n: k[1] for n, k in kept.items()}
    counts = counting.by_field(per, _FIELDS, telemetry)
    new_state = CompensatedState(
      count=optax.safe_increment(state.count),
      key=new_key,
      buffer={n: k[0] for n, k in kept.items()},
      **counts,
    )
    return deltas, new_state

  return optax.GradientTransformation(init_fn, update_fn)


class _Compensated(NamedTuple):
  """The compensated write-back of one tensor."""

  overflow: str
  nonfinite: str
  telemetry: bool
  two_sum: bool
  remainder: bool

  def __call__(self, w, u, c, fmt: Format, buf: Format | None, bits):
    """(delta, new buffer, counts or None) for one tensor."""
    if self.remainder:
      return self._remainder(w, u, c, fmt)
    c = jnp.asarray(c).astype(jnp.float32)
    st = step(
      w, u, c, fmt, buf, bits, self.two_sum, self.overflow, self.nonfinite
    )
    delta, new_c, r, written = st.delta, st.new_c, st.residual, st.written
    finite = st.finite
    if not self.telemetry:
      return delta, new_c, None
    proposed = (u != 0) & finite
    moved = written & (delta != 0)
    erased = proposed & (delta == 0)
    lost = written & (r != 0) & (new_c == 0)
    counts = tally(
      proposed, erased, moved, st.over & written, ~st.lands, ~finite, lost
    )
    masses = (mass(new_c), mass(jnp.where(written, r - new_c, 0.0)))
    return delta, new_c, counts + masses

  def _remainder(self, w, u, rem, fmt: Format):
    u32 = jnp.uint32
    # A plain float32 add of the proposal as it arrives, as a master run
    # that applies its updates with optax.apply_updates does.
    u = as_emitted(u)
    top = jax.lax.bitcast_convert_type(w, u32)
    master = jax.lax.bitcast_convert_type(top | rem.astype(u32), jnp.float32)
    finite = jnp.isfinite(u) & ~jnp.isnan(master)
    written = _written(u != 0, finite, self.nonfinite)
    # `t` is what float32 addition to the master drops, exactly.
    summed, t = _two_sum(master, u)
    new = jnp.where(written, summed, master)
    b = jax.lax.bitcast_convert_type(new, u32)
    nan = jnp.isnan(new)
    # Truncating a NaN can leave an inf: keep a quiet NaN in the view.
    view_bits = jnp.where(nan, u32(0x7FC00000), b & u32(0xFFFF0000))
    view = jax.lax.bitcast_convert_type(view_bits, jnp.float32)
    new_rem = jnp.where(nan, u32(0), b & u32(0xFFFF)).astype(jnp.uint16)
    q = jnp.where(written & (view != w), view, w)
    delta, lands = land(w, q, fmt)
    if not self.telemetry:
      return delta, new_rem, None
    proposed = (u != 0) & finite
    moved = written & (delta != 0)
    erased = proposed & (delta == 0)
    lost = proposed & (new == master)
    zero = jnp.zeros_like(proposed)
    counts = tally(proposed, erased, moved, zero, ~lands, ~finite, lost)
    held = jnp.where(nan, 0.0, new - view)
    dropped = jnp.where(proposed, t, 0.0)
    return delta, new_rem, counts + (mass(held), mass(dropped))


def _written(nonzero, finite, nonfinite: str):
  if nonfinite == "keep":
    return nonzero & finite
  return nonzero | ~finite


class Step(NamedTuple):
  """One compensated write-back of a tensor, elementwise (float32)."""

  delta: (
    jax.Array
  )  # lands w on its new grid value (see lowprec.engine.codec.land)
  new_c: jax.Array  # the new buffer (or error term), on the buffer's grid
  residual: jax.Array  # what the weight did not take of u + c, unrounded
  written: jax.Array  # bool: where the weight was written (y != 0)
  finite: jax.Array  # bool: u + c finite and w not NaN
  over: jax.Array  # bool: the weight's rounding overflowed
  lands: jax.Array  # bool: the rounded weight itself was reachable


def step(
  w,
  u,
  c,
  fmt: Format,
  buf: Format,
  bits=None,
  two_sum: bool = False,
  overflow: str = "saturate",
  nonfinite: str = "keep",
) -> Step:
  """Kahan (`two_sum=False`) or two-component (`two_sum=True`) write-back
  of weight `w` with buffer `c` and proposal `u`, all float32:

    y = u + c,  w' = Q(w + y),  c' = Q_c(y - (w' - w))

  (two-component: the residual is the exact two-sum's error plus what
  rounding `w + y` dropped). Where `y == 0` the weight keeps its bits and
  `c' = y`: the buffer is written wherever `y` is finite. `u` enters
  rounded to float32 as the optimizer emitted it, whatever XLA fuses.
  `bits` makes `Q` stochastic. The transforms here and
  `lowprec.freeze.compensated_trace` (at the reference weight's grid
  value) compute with it, so a prediction is the same arithmetic.
  """
  u = as_emitted(u)
  y = u + c
  finite = jnp.isfinite(y) & ~jnp.isnan(w)
  if two_sum:
    s, t = _two_sum(w, y)
  else:
    s, t = w + y, None
  rounding = "nearest" if bits is None else "stochastic"
  enc = encode(Codec(fmt, rounding, overflow=overflow), s, w, bits)
  q, over = enc.value, enc.over
  written = _written(y != 0, finite, nonfinite)
  q = jnp.where(written & (q != w), q, w)
  delta, lands = land(w, q, fmt)
  new_w = w + delta
  r = (s - new_w) + t if two_sum else y - (new_w - w)
  # The buffer is written wherever y is finite: where y == 0 (u cancels
  # c exactly) the weight keeps its bits and the residual is y itself,
  # as the formula gives. Only a non-finite y kept out keeps the buffer.
  r = jnp.where(written, r, jnp.where(finite, y, c))
  new_c = encode(Codec(buf), r).value
  return Step(delta, new_c, r, written, finite, over, lands)


def as_emitted(u):
  """`u` as the optimizer emitted it: rounded to float32 before any add.

  XLA:CPU contracts a multiply that feeds an add in the same fusion into
  an FMA, which skips the multiply's rounding: AdamW's last multiply (by
  `-lr`) and `u + c` become one operation, and at rounding ties the sum
  leaves the formula. An optimization barrier does not stop it (XLA:CPU
  expands barriers before it fuses). An add fuses only with a multiply
  that is its operand, so a select in between, which returns every value
  of `u` (NaN as NaN), keeps the rounding.
  """
  return jnp.where(jnp.isnan(u), jnp.float32(jnp.nan), u)


def _two_sum(a, b):
  """`s = fl(a + b)` and the exact error `t = (a + b) - s`, in float32:
  Fast2Sum where `|a| >= |b|`, Knuth's TwoSum elsewhere. XLA keeps the
  operations as written (it does not reassociate float arithmetic)."""
  s = a + b
  fast = b - (s - a)
  bb = s - a
  knuth = (a - (s - bb)) + (b - bb)
  t = jnp.where(jnp.abs(a) >= jnp.abs(b), fast, knuth)
  return s, jnp.where(jnp.isfinite(s), t, 0.0)

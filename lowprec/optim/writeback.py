"""Write-back without master weights, as an optax transform with telemetry.

Without a float32 master copy, every optimizer step writes `w + u` back to the
weights' grid: `w' = Q(w + u)`. A nonzero proposal `u` that `Q` rounds away is
**erased** (`u != 0` and `w' == w`); under nearest rounding that happens
exactly when `|u|` is below half the grid gap at `w` in the direction of `u`,
and a coordinate whose proposals are erased at every step is frozen while its
gradient is not zero. Stochastic rounding keeps `E[w'] = w + u`, so nothing
freezes for good.

`writeback` goes last in an optax chain, rounds there, and returns the float32
deltas `w' - w`, which land exactly through `optax.apply_updates` (or
`lowprec.apply_updates` for float8 storage). Its state keeps a PRNG key and
per-tensor counts of proposals, erasures and saturations, read with
`lowprec.telemetry(opt_state)`; it never holds a copy of the parameters.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import counting, leafwise, stacked
from lowprec.engine.weights import format_lookup
from lowprec.grids import choices, scaled
from lowprec.grids import rng as rng_lib
from lowprec.grids.rounding import OVERFLOW_MODES, ROUNDINGS
from lowprec.optim import writeback_kernel

NONFINITE_MODES = ("keep", "propagate")
SCALE_MODES = ("recompute", "keep")  # block scales of a scaled write-back

# `offgrid` is checked by `report()`, not reported.
_COUNTS = leafwise.PLAIN_COUNTS
_REPORTED = ("proposals", "erased", "moved", "saturated", "unreachable")
_REPORTED += ("nonfinite",)

# While `counted_in_branches` traces one of its two branches, or one of
# the two programs of `counted_and_uncounted` is traced: True in the one
# that counts, False in the other; None elsewhere (a write-back under
# `telemetry=k` then decides itself, with a `lax.cond` of its own).
_BRANCH: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
  "lowprec_writeback_branch", default=None
)


class WritebackState(NamedTuple):
  """State of `writeback`: a PRNG key and the counts of the last update.

  Counts are dicts from parameter path ("params/Dense_0/kernel") to an int32
  scalar, covering the parameters that have a format; they are None when the
  transform was built with `telemetry=False`. `erased` is `proposals - moved`.
  `arrays()` gives them as a pytree of arrays (usable under jit, scan and
  vmap), `report()` as plain numbers for `lowprec.telemetry`.
  """

  count: jax.Array  # int32 []: updates applied so far.
  key: jax.Array | None  # uint32 [2] key data, split each update; None (RN).
  proposals: dict[str, jax.Array] | None  # int32 [] per path: finite u != 0.
  moved: dict[str, jax.Array] | None  # int32 [] per path: w' != w.
  saturated: dict[str, jax.Array] | None  # int32 [] per path: past max.
  unreachable: dict[str, jax.Array] | None  # int32 [] per path: detoured.
  nonfinite: dict[str, jax.Array] | None  # int32 [] per path: u or w bad.
  # Parameters on a scaled grid only (None without any): int32 [] per path.
  blocks: dict[str, jax.Array] | None = None  # scale blocks of the tensor.
  rescaled: dict[str, jax.Array] | None = None  # blocks whose scale moved.
  # int32 [] per path: finite weights off their grid when the update
  # began (None without telemetry): `report()` raises where one is not 0.
  offgrid: dict[str, jax.Array] | None = None
  # Static: counts taken every k-th update (None: every update).
  every: CountEvery | None = None

  def arrays(self) -> dict[str, jax.Array]:
    """The counts as arrays, traceable: `{name: int32 or float32 array}`.

    Keys as in `report()`. Totals are int32 sums over tensors and
    `erased_fraction` is float32 (NaN without proposals). Under `vmap` each
    value has the ensemble's leading axis; `scan` stacks them.
    """
    return _telemetry(self, host=False)

  def report(self) -> dict[str, int | float]:
    """The counts as plain numbers: totals, then `<count>/<path>` per tensor.

    Keys: `steps`, `proposals` (finite nonzero proposals), `erased`,
    `moved`, `saturated`, `unreachable`, `nonfinite` (coordinates whose
    proposal is NaN or infinite, or whose weight is NaN; never counted as
    proposals or moves), `erased_fraction` (erased / proposals; NaN at a
    step without proposals, as in `lowprec.freeze`, whose curve functions
    skip such steps), and the same counts per parameter path. Totals are
    exact integers and fractions float64, computed on the host; a state
    with leading (ensemble) axes gives nested lists.
    Parameters on a scaled (MX) grid add `blocks`, `rescaled` (blocks whose
    scale changed this step) and `rescaled_fraction`, in total and per
    path.

    Under `telemetry=k` (k > 1) the counts are those of the last counted
    update, and two keys say which: `count_every` (k) and `counted_step`
    (that update's number, from 1; 0 before the first).

    Raises:
      ValueError: the last update found weights off their grid (the
        `offgrid` counts): something changed the params after the
        write-back's deltas, e.g. a transform chained after it; or, of
        `counted_and_uncounted`'s programs, the uncounted one ran an
        update that was due to be counted.
    """
    st = jax.device_get(self._replace(key=None))
    check_offgrid(st.offgrid)
    _check_counted(st)
    return _telemetry(st, host=True)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class CountEvery:
  """A write-back's state counts every `k`-th update (static: no arrays):
  updates 1, k + 1, 2k + 1, ... (the update number minus one a multiple
  of k)."""

  k: int

  def counted_step(self, steps):
    """The number (from 1) of the last counted update after `steps`
    updates; 0 before the first."""
    return jnp.where(steps > 0, (steps - 1) // self.k * self.k + 1, 0)


def check_offgrid(offgrid) -> None:
  """Raises where the `offgrid` counts of a write-back's state (`{path:
  count}`, concrete, any leading ensemble axes) are not all zero."""
  if not offgrid:
    return
  # -1: not counted (`counted_and_uncounted`), which the report refuses.
  bad = {
    n: int(np.sum(np.maximum(c, 0)))
    for n, c in offgrid.items()
    if np.any(np.asarray(c) > 0)
  }
  if not bad:
    return
  (name, n), more = next(iter(bad.items())), len(bad) - 1
  others = f" (and values of {more} other parameters)" if more else ""
  raise ValueError(
    f"lowprec.writeback met {n} values of parameter {name!r}{others} off "
    "their grid at its last update: the params changed after its deltas "
    "landed, so they are no longer weights on the grid. The write-back "
    "goes last in the chain, so that its deltas are what is added to the "
    "params: optax.chain(optax.adam(1e-3), lowprec.writeback(fmt)), not "
    "optax.chain(lowprec.writeback(fmt), optax.adam(1e-3)); change the "
    "params only by its updates (or put them back with lowprec.to_grid)"
  )


def _telemetry(st: WritebackState, host: bool) -> dict:
  out = counting.of_state(st, _REPORTED, host=host)
  if st.every is not None:
    at = st.every.counted_step(st.count)
    out["count_every"] = st.every.k
    out["counted_step"] = counting.host_int(at) if host else at
  if st.proposals is not None and st.blocks:
    per = {
      n: {"blocks": b, "rescaled": st.rescaled[n]} for n, b in st.blocks.items()
    }
    ratio = ("rescaled_fraction", "rescaled", "blocks")
    out.update(
      counting.layout(None, per, ("blocks", "rescaled"), ratio, host=host)
    )
  return out


def writeback(
  fmt,
  rounding: str = "nearest",
  *,
  key: jax.Array | None = None,
  overflow: str = "saturate",
  nonfinite: str = "keep",
  telemetry: bool | int = True,
  scales: str = "recompute",
  kernel: str = "xla",
) -> optax.GradientTransformation:
  """Rounds `w + u` onto the weights' grid and emits the exact deltas.

  For each parameter `w` on its format's grid and proposal `u` (the
  incoming update, in float32): `w' = Q(w + u)` and `delta = w' - w`, which
  `optax.apply_updates` lands exactly. `Q` is `nearest` (ties to even),
  `stochastic` (`E[Q(x)] = x`, 32 random bits per element from a
  counter-based hash, so sharded runs draw the same bits) or `deadzone`
  (stochastic only where nearest would erase the proposal). Coordinates
  with `u == 0` keep their bits; non-finite proposals are counted, not
  written (`nonfinite`). The state holds a key and int32 counts of the
  last update, read with `lowprec.telemetry` or `lowprec.telemetry_arrays`:
  `proposals`, `erased` (`u != 0` and `w' == w`), `moved`, `saturated`,
  `unreachable`, `nonfinite`, `erased_fraction`, in total and per path.

  The guide, docs/writeback.md, says the rest: formats per parameter,
  native storage (`lowprec.in_float32` for the optimizer before it), the
  exact-landing rule and its `unreachable` cases, non-finite proposals,
  telemetry and its cost.

  Args:
    fmt: the weights' format: a name (`"float8_e4m3fn"`, `"e8m3"`), a
      `Format` (e.g. `get_format("int3", scale=0.125)`), a pytree of formats
      shaped like (a prefix of) the params, or rules `[(regex, fmt), ...]`
      over "/"-joined parameter paths (`re.fullmatch`, first match wins, no
      match is an error). None leaves a parameter untouched (its update
      passes through). See `lowprec.storage`. An MX scaled format
      (`"mxfp8_e4m3"`, a `lowprec.ScaledFormat`) writes onto the grid of
      block scales chosen by `scales`, and adds `blocks`, `rescaled` and
      `rescaled_fraction` to the telemetry (docs/scaled.md). NVFP4 and
      per-tensor scaled formats are refused (the error says why).
    rounding: "nearest", "stochastic" or "deadzone".
    key: a JAX PRNG key; required by "stochastic" and "deadzone", ignored by
      "nearest". It is kept in the state and split at every update; give
      each member of a `vmap` ensemble its own with `lowprec.reseed`.
    overflow: "saturate" (default) clips to +-max finite; "ieee" overflows to
      inf, or NaN where the format has no inf, as a cast does.
    nonfinite: "keep" (default) or "propagate", for non-finite proposals.
    telemetry: keep the counts in the state (one reduction per tensor and
      step; on XLA:CPU it recomputes the rounding: docs/writeback.md).
      An int `k > 1` counts every k-th update only (the 1st, the k+1-th,
      ...; the others run without counts and keep the last ones), and the
      telemetry then names the update it counted (`counted_step`,
      `count_every`). True is 1, False (or 0) none.
    scales: for MX scaled formats only (ignored by the others): the block
      scales of the grid that `w + u` is rounded onto. "recompute"
      (default): from `w + u` itself, `w' = FQ(w + u)`, so a block's grid
      moves when its maximum moves. "keep": those of the current `w`
      (the previous step's, as `w` is on their grid), `w' = FQ(w + u;
      scales(w))`; a value past the block's top `max_E * scale`
      saturates there (counted in `saturated`), so a block's scale never
      grows, and `rescaled` is 0 (the next step takes the scales of `w'`,
      which may be smaller). One case needs more: under the `ocp` rule
      an e4m3 block whose maximum falls to `240 * scale` (the top of the
      binade below; doubled, 480 lies past 448) is off the grid of its
      own, halved, scale and is put there, which saturates it to
      `224 * scale`; so `w'` is always on its grid.
    kernel: "xla" (default): XLA's ops; "auto": each leaf on a plain
      float grid in one Pallas kernel on one NVIDIA GPU (the weights and
      proposals read once, the counts taken as the deltas are written),
      XLA's ops elsewhere; "pallas": the kernel everywhere (interpreted
      off a GPU, for tests). The same deltas, counts and keys bit for
      bit (`lowprec.optim.writeback_kernel`).

  Returns:
    An `optax.GradientTransformation` whose `update` needs `params`, stored
      as float32 holding grid values or as the format's native dtype.
      Its `init` checks concrete params and raises if any is off the grid.
      Leaves that are not arrays (an Equinox module's functions and Python
      numbers) need no format and are no parameters; a None update passes
      through (as `eqx.filter_grad` gives for them), so `init` and `update`
      take an unfiltered Equinox module as `params`.

  Raises:
    ValueError: unknown rounding, overflow, nonfinite, scales or kernel mode or
      format; an NVFP4 or per-tensor scaled format (the message says why
      and what to use instead); a random rounding without `key`; at
      `init`, params off their grid (call
      `lowprec.to_grid` first), stored in a dtype that cannot hold the grid
      (an integer or boolean array given a format among them), or an `intK`
      scale that is not a power of two; at `update`, missing `params`, an
      update shaped unlike its parameter, or proposals narrower than
      float32. Each names the parameter. Weights off their grid at an
      update (the params changed after the write-back's deltas: it was
      not last in the chain) are counted in the state's `offgrid`;
      `lowprec.telemetry` then raises, and so does an update run outside
      `jit`.

  Warns:
    lowprec.engine.weights.Float8ParamsWarning: at `init`, params stored in a
      one-byte float dtype: land the deltas with `lowprec.apply_updates`
      (`optax.apply_updates` cannot add float32 to float8).

  Example:
    ```python
    params = lowprec.to_grid(params, "bfloat16")  # float32 on the grid
    opt = optax.chain(
        optax.adamw(optax.cosine_decay_schedule(1e-3, 1000)),
        lowprec.writeback("bfloat16", "stochastic", key=jax.random.key(0)),
    )
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)  # still on the grid
    lowprec.telemetry(state)["erased_fraction"]
    ```

  Reference: the write-back freezing study ("Direct low-precision
  write-back can erase nonzero optimizer proposals").
  """
  choices.check_choice("rounding", rounding, ROUNDINGS)
  choices.check_choice("overflow mode", overflow, OVERFLOW_MODES)
  choices.check_choice("nonfinite mode", nonfinite, NONFINITE_MODES)
  choices.check_choice("scales", scales, SCALE_MODES)
  every = _count_every(telemetry)
  telemetry = every > 0
  lookup = format_lookup(fmt)
  random = rounding != "nearest"
  key_state = None
  if random:
    key_state = rng_lib.state_key(key, f"writeback(rounding={rounding!r})")
  leaf = leafwise.Plain(rounding, overflow, nonfinite, telemetry, scales)
  on_kernel = writeback_kernel.leaf_kernel(kernel)
  # Under telemetry=k, the deltas of every update come from the step
  # without counts; a counted update runs the counting step in a branch.
  silent = leaf._replace(telemetry=False)
  sometimes = CountEvery(every) if every > 1 else None

  def init_fn(params):
    fmts = {
      n: f for n, (_, f, _) in leafwise.weights(lookup, params, fmt).items()
    }
    # A leaf of stacked layers counts each layer (lowprec.engine.stacked).
    zeros = {n: jnp.zeros(stacked.count_shape(n), jnp.int32) for n in fmts}
    on_scaled = {n: z for n, z in zeros.items() if _is_scaled(fmts[n])}
    return WritebackState(
      count=jnp.zeros([], jnp.int32),
      key=key_state[0] if random else None,
      **{c: zeros if telemetry else None for c in _COUNTS},
      blocks=on_scaled if telemetry and on_scaled else None,
      rescaled=on_scaled if telemetry and on_scaled else None,
      every=sometimes,
    )

  def counted(updates, params, ks):
    """The deltas, the new key and the state's count fields."""
    deltas, new_key, kept = leafwise.step(
      "writeback", lookup, updates, params, ks, leaf, on_kernel, layers=True
    )
    counts = counting.by_field(kept, _COUNTS, telemetry)
    n = len(_COUNTS)
    scales = {name: k[n:] for name, k in kept.items() if len(k) > n}
    counts["blocks"] = {n: b for n, (b, _) in scales.items()} or None
    counts["rescaled"] = {n: r for n, (_, r) in scales.items()} or None
    return deltas, new_key, counts

  def update_fn(updates, state, params=None):
    ks = (state.key, key_state[1]) if random else None
    branch = _BRANCH.get() if sometimes is not None else None
    if sometimes is None:
      deltas, new_key, counts = counted(updates, params, ks)
    elif branch:  # a program that counts, chosen outside
      deltas, new_key, counts = counted(updates, params, ks)
      # Off its schedule it keeps the last counts, which the report names.
      due = state.count % every == 0
      last = _last_counts(state)
      counts = jax.tree.map(lambda c, o: jnp.where(due, c, o), counts, last)
    else:
      deltas, new_key, _ = leafwise.step(
        "writeback",
        lookup,
        updates,
        params,
        ks,
        silent,
        on_kernel,
        layers=True,
      )
      last = _last_counts(state)
      if branch is None:
        counts = jax.lax.cond(
          state.count % every == 0,
          lambda: counted(updates, params, ks)[2],
          lambda: last,
        )
      else:  # a program that does not count, chosen outside
        # On its schedule its counts are missing: -1, which the report
        # refuses rather than name stale counts as this update's.
        due = state.count % every == 0
        counts = jax.tree.map(lambda o: jnp.where(due, -1, o), last)
    new_state = WritebackState(
      count=optax.safe_increment(state.count),
      key=new_key,
      **counts,
      every=sometimes,
    )
    if telemetry and not _traced(counts["offgrid"]):
      check_offgrid(counts["offgrid"])  # an update run eagerly
    return deltas, new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _last_counts(state: WritebackState) -> dict:
  """The count fields of a state, as the update that made it left them."""
  return {f: getattr(state, f) for f in (*_COUNTS, "blocks", "rescaled")}


class BranchesState(NamedTuple):
  """State of `counted_in_branches`: its update count and the chain's."""

  count: jax.Array  # int32 []: updates so far.
  inner: optax.OptState


def counted_in_branches(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """`inner`, a chain whose write-back counts every k-th update
  (`writeback(..., telemetry=k)`), run as two programs: the whole chain
  with the counts on counted updates, without them on the others.

  A write-back under `telemetry=k` alone decides with a `lax.cond` around
  its counts, and a branch reads its operands from memory: the chain's
  float32 proposals, which XLA otherwise fuses into the write-back
  without writing them out, are written and read back at every update.
  Here the branch is around the whole chain, whose operands (gradients,
  state, params) are in memory anyway, so an uncounted update runs the
  program of the write-back without telemetry (its deltas still leave
  the branch through memory: docs/benchmarks.md). Updates, states
  and counts are those of `inner` run alone, bit for bit;
  `lowprec.telemetry` reads the state as it reads `inner`'s.

  Args:
    inner: the chain, holding one or more `lowprec.writeback`s with the
      same `telemetry=k`, k > 1.

  Returns:
    An optax transformation with state `BranchesState(count, inner)`.

  Raises:
    ValueError: at `init`, `inner` holds no write-back with `telemetry=k`
      for k > 1, or write-backs with different k.

  Example:
    ```python
    opt = lowprec.counted_in_branches(optax.chain(
        optax.adamw(1e-3),
        lowprec.writeback("bfloat16", "stochastic", key=key, telemetry=10),
    ))
    ```
  """

  def init_fn(params):
    state = inner.init(params)
    _every_of(state)
    return BranchesState(jnp.zeros([], jnp.int32), state)

  def update_fn(updates, state, params=None):
    k = _every_of(state.inner)

    def branch(counts: bool):
      def run():
        token = _BRANCH.set(counts)
        try:
          return inner.update(updates, state.inner, params)
        finally:
          _BRANCH.reset(token)

      return run

    new_updates, new_inner = jax.lax.cond(
      state.count % k == 0, branch(True), branch(False)
    )
    return new_updates, BranchesState(
      optax.safe_increment(state.count), new_inner
    )

  return optax.GradientTransformation(init_fn, update_fn)


class CountedAndUncounted(NamedTuple):
  """The two programs of `counted_and_uncounted`: optax transformations
  with one init and one state, `inner`'s."""

  counted: optax.GradientTransformation
  uncounted: optax.GradientTransformation


def counted_and_uncounted(
  inner: optax.GradientTransformation,
) -> CountedAndUncounted:
  """`inner`, a chain whose write-backs count every k-th update
  (`writeback(..., telemetry=k)`), as two transformations to compile
  apart: `counted` counts, `uncounted` is the chain's program without
  counts. The caller picks one per update, outside the compiled step.

  Nothing in the compiled steps branches, so an uncounted update runs
  exactly the program of the write-back without telemetry, and the
  counting program runs once in k updates: logging telemetry costs a
  k-th of the counts (docs/benchmarks.md). The state is
  `inner`'s (checkpoints and `lowprec.telemetry` as for `inner` alone),
  and updates, states and counts are `inner`'s bit for bit when
  `counted` runs the updates whose number minus one is a multiple of k
  (`step % k == 0`, counting steps from 0) and `uncounted` the others.
  Off that schedule, `counted` keeps the last counts; `uncounted` on an
  update due to be counted marks its counts missing (-1, as
  `lowprec.telemetry_arrays` shows them inside a compiled step), and
  `lowprec.telemetry` then raises rather than report stale counts.

  Args:
    inner: the chain, holding one or more `lowprec.writeback`s with the
      same `telemetry=k`, k > 1.

  Returns:
    `CountedAndUncounted(counted, uncounted)`.

  Raises:
    ValueError: at `init` or `update`, `inner` holds no write-back with
      `telemetry=k` for k > 1, or write-backs with different k.

  Example:
    ```python
    opt = lowprec.counted_and_uncounted(optax.chain(
        optax.adamw(1e-3),
        lowprec.writeback("bfloat16", "stochastic", key=key, telemetry=10),
    ))
    steps = {
        True: jax.jit(make_step(opt.counted)),
        False: jax.jit(make_step(opt.uncounted)),
    }
    for step in range(n):
      params, state = steps[step % 10 == 0](params, state, batch)
    ```
  """
  name = "lowprec.counted_and_uncounted"

  def init_fn(params):
    state = inner.init(params)
    _every_of(state, name)
    return state

  def program(counts: bool) -> optax.GradientTransformation:
    def update_fn(updates, state, params=None):
      _every_of(state, name)
      token = _BRANCH.set(counts)
      try:
        return inner.update(updates, state, params)
      finally:
        _BRANCH.reset(token)

    return optax.GradientTransformation(init_fn, update_fn)

  return CountedAndUncounted(program(True), program(False))


def _check_counted(st: WritebackState) -> None:
  """Raises where a state's counts are marked missing (-1): the
  uncounted program of `counted_and_uncounted` ran a due update."""
  if st.every is None or st.proposals is None:
    return
  if not any(np.any(np.asarray(c) < 0) for c in st.proposals.values()):
    return
  k = st.every.k
  due = int(np.max(st.every.counted_step(np.asarray(st.count))))
  raise ValueError(
    f"update {due} was due to be counted (telemetry={k}: "
    f"updates 1, {k + 1}, {2 * k + 1}, ...) but ran the uncounted program "
    "of lowprec.counted_and_uncounted, so its counts are missing: run the "
    f"counted program when step % {k} == 0 (steps counted from 0) and the "
    "uncounted one otherwise"
  )


def _every_of(state, name: str = "lowprec.counted_in_branches") -> int:
  """The one k of the `telemetry=k` write-backs in `state` (k > 1)."""
  found = {
    s.every.k
    for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, WritebackState)
    )
    if isinstance(s, WritebackState) and s.every is not None
  }
  if len(found) != 1:
    what = "none" if not found else f"k = {sorted(found)}"
    raise ValueError(
      f"{name} runs a chain whose write-backs count "
      f"every k-th update, all with one k > 1; this chain's have {what}: "
      "build them with lowprec.writeback(..., telemetry=k), e.g. "
      "telemetry=10"
    )
  return found.pop()


def _count_every(telemetry) -> int:
  """0 (no counts), 1 (every update) or k (every k-th) from `telemetry`."""
  if isinstance(telemetry, bool):
    return int(telemetry)
  if isinstance(telemetry, int | np.integer) and telemetry >= 0:
    return int(telemetry)
  raise ValueError(
    f"writeback's telemetry is True, False or a whole number k >= 0 (count "
    f"every k-th update; 0 is False), got {telemetry!r}: e.g. telemetry=10"
  )


def _traced(tree) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _is_scaled(fmt) -> bool:
  return isinstance(fmt, scaled.ScaledFormat)

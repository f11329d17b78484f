"""The reference-trace recorder: predicted erasure, online, in a float32 run.

`reference_trace` is an optax transform placed last in a float32 chain. It
leaves the updates unchanged and records, for each target format, which of
this step's proposals a write-back into that format would erase. The counts
of the current step live in its state and are read with `lowprec.telemetry`
after every step; the sequence of logged values is the predicted curve `p_t`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from lowprec.engine import leafwise, stacked, weights
from lowprec.freeze import reports
from lowprec.grids import choices, rounding, scaled
from lowprec.grids.formats import (
  Format,
  check_writeback_format,
  get_format,
  writeback_refusal,
)
from lowprec.grids.rounding import ROUNDINGS
from lowprec.optim import telemetry as telemetry_lib

_SUFFIX = {"nearest": "", "stochastic": "_sr", "deadzone": "_dzsr"}


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
  """A target format to predict for, and the write-back rounding.

  Attributes:
    fmt: a format specification as `lowprec.to_grid` and the write-back take
      it: one format (name, `Format` or MX `ScaledFormat`), a pytree of
      formats shaped like (a prefix of) the params, or ordered `(regex,
      format or None)` rules matched with `re.fullmatch` against
      "/"-joined parameter paths. A parameter whose format is None is left
      out (kept in float32).
    rounding: the write-back rounding to predict: "nearest" (the erased
      fraction), "stochastic" or "deadzone" (the per-step move probability;
      no persistent freeze).
  """

  fmt: Any
  rounding: str = "nearest"

  def __post_init__(self):
    choices.check_choice("rounding", self.rounding, ROUNDINGS)
    if scaled.is_scaled(self.fmt):
      object.__setattr__(self, "fmt", _checked(self.fmt))
    elif isinstance(self.fmt, (str, Format)):
      object.__setattr__(self, "fmt", _grid(self.fmt))
    object.__setattr__(self, "_lookup", weights.format_lookup(self.fmt))

  @property
  def default_name(self) -> str | None:
    if isinstance(self.fmt, (Format, scaled.ScaledFormat)):
      return self.fmt.name + _SUFFIX[self.rounding]
    return None

  def leaf_format(self, path) -> Format | scaled.ScaledFormat | None:
    """The format of the parameter at key path `path` (None: left out)."""
    fmt = self._lookup(path)
    if not scaled.is_scaled(fmt):
      return fmt
    return _checked(fmt, f"parameter {weights.path_name(path)!r}")


# The scaled formats a target takes (`_checked`): MX, power-of-two scales.
_MX_TARGETS = tuple(n for n in scaled.SCALED if writeback_refusal(n) is None)


def _grid(fmt) -> Format:
  """A target's grid; the error for an unknown name lists the MX names
  too, and points a `"name:rounding"` spec to `Target(name, rounding)`."""
  try:
    return get_format(fmt, also_valid=_MX_TARGETS)
  except ValueError as e:
    name, sep, mode = str(fmt).rpartition(":")
    if not (sep and mode in ROUNDINGS and _known(name)):
      raise
    raise ValueError(
      f"{fmt!r} is a format and a rounding; a target's rounding is its own "
      f"argument: Target({name!r}, {mode!r}), e.g. reference_trace(["
      f"Target({name!r}, {mode!r})]). ({e})"
    ) from None


def _known(name: str) -> bool:
  if scaled.is_scaled(name):
    return True
  try:
    get_format(name)
  except ValueError:
    return False
  return True


def _checked(fmt, what: str = "") -> scaled.ScaledFormat:
  """A scaled format the write-back takes (MX); the others are refused
  with the write-back's reason and fix (`what` names the parameter)."""
  where = "reference_trace (which predicts the write-back)"
  check_writeback_format(fmt, f"{where}, {what}" if what else where)
  return scaled.get_scaled_format(fmt)


def named_specs(specs, *, single, convert, what: str, example: str) -> tuple:
  """`((name, spec), ...)` from a dict `{name: spec}`, one spec (where
  `single(specs)`) or a list of them named by their `default_name`.

  Raises:
    ValueError: none, a spec without a default name outside a dict (the
      message shows `example`), duplicate names, or a name that is empty
      or holds "/".
  """
  if isinstance(specs, Mapping):
    items = [(str(k), convert(v)) for k, v in specs.items()]
  else:
    items = []
    for spec in [specs] if single(specs) else specs:
      t = convert(spec)
      if t.default_name is None:
        raise ValueError(
          f"a {what} with per-parameter formats needs a name: pass a dict, "
          f"e.g. {example}"
        )
      items.append((t.default_name, t))
  if not items:
    raise ValueError(f"at least one {what} is needed")
  names = [n for n, _ in items]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f"duplicate {what} names {dup}; pass a dict to rename")
  for n in names:
    if not n or "/" in n:
      raise ValueError(f"{what} name {n!r} must be nonempty and have no '/'")
  return tuple(items)


def _parse_targets(targets) -> tuple[tuple[str, Target], ...]:
  return named_specs(
    targets,
    single=lambda t: isinstance(t, (str, Format, Target)),
    convert=_as_target,
    what="target",
    example="{'fp8_mlp': [('.*mlp.*', 'float8_e4m3fn'), ('.*', None)]}",
  )


def _as_target(spec) -> Target:
  if isinstance(spec, Target):
    return spec
  return Target(spec)


@dataclasses.dataclass(frozen=True)
class TraceLayout:
  """Static facts of a trace: names, leaf formats and leaf offsets.

  Part of the tree structure (no arrays), so it costs nothing under jit.
  """

  targets: tuple[str, ...]
  roundings: tuple[str, ...]
  leaves: tuple[str, ...]
  formats: tuple[tuple[Format | None, ...], ...]  # [target][leaf]
  sizes: tuple[int, ...]
  theta: float
  # Where the params store layers stacked (lowprec.engine.stacked): for
  # each stored float leaf, its index in `leaves` (which names every layer
  # apart), or for a leaf of stacked layers its layers' indices
  # (`stacked.apart_index`). None when nothing is stacked.
  stored: tuple[int | tuple[int, ...], ...] | None = None

  @property
  def offsets(self) -> tuple[int, ...]:
    return tuple(int(x) for x in np.cumsum((0,) + self.sizes)[:-1])


jax.tree_util.register_static(TraceLayout)


class ReferenceTraceState(NamedTuple):
  """State of `reference_trace`: this step's counts, never a history."""

  count: jax.Array  # [] int32: updates seen so far.
  proposals: jax.Array  # [L] int32: this step's proposals u != 0 per leaf.
  erased: jax.Array  # [T, L] int32: predicted-erased proposals (nearest).
  move_prob: jax.Array  # [T, L] float32: sum of P(move) (stochastic kinds).
  run_start: jax.Array  # [T] int32: step since which p_t >= theta, or -1.
  # Without a sample (N = 0) the three are None: no zero-size arrays, which
  # checkpointers such as orbax refuse.
  sample_index: jax.Array | None  # [N] int32: flat indices of the sample.
  sample_w: jax.Array | None  # [N] float32: their weights w_t at this step.
  sample_u: jax.Array | None  # [N] float32: their proposals u_t.
  layout: TraceLayout  # static: names, formats, sizes (no arrays).
  # With at_init=True (else None): per nearest target and leaf, the initial
  # weights on the target grid (float32, shaped like the leaf; None where
  # not tracked), whether each coordinate is still predicted at its
  # initial value (bool), and those counts ([T, L] int32).
  init_q: tuple[tuple[jax.Array | None, ...], ...] | None = None
  still: tuple[tuple[jax.Array | None, ...], ...] | None = None
  at_init: jax.Array | None = None

  def report(self) -> dict[str, Any]:
    """This step's prediction as `{"pred/<target>/...": value}`.

    For a nearest target: `erased`, `proposals`, `erased_fraction` (NaN at a
    step without proposals), `crossing` (the crossing step of the run so
    far, -1 for none) and `erased_fraction/<leaf>`. For a stochastic or
    dead-zone target: `proposals`, `move_prob` (mean probability that a
    proposal moves its coordinate) and `move_prob/<leaf>`. Every target also
    gives `proposals/<leaf>`, so that leaves add up to groups. With a sample:
    `pred/sample/w` and `pred/sample/u`. With `at_init=True`, for a
    nearest target: `at_init` (coordinates predicted still at their
    initial value), `at_init_fraction` (of the target's coordinates) and
    `at_init/<leaf>` (counts, so groups of leaves add up exactly). Counts
    are exact integers and fractions float64, computed on the host; a
    state with leading (ensemble) axes gives nested lists.
    """
    # The O(params) tracking arrays stay on the device: only counts move.
    return reports.host(self._collect, self._replace(init_q=None, still=None))

  def arrays(self) -> dict[str, jax.Array]:
    """The values of `report()` as arrays (int32 counts, float32 ratios),
    traceable inside jit, stacked by `scan`, batched by `vmap`."""
    return reports.traced(self._collect, self)

  @staticmethod
  def _collect(st, xp, ratio, value) -> dict[str, Any]:
    lay = st.layout
    props = reports.counts(xp, st.proposals)
    erased = reports.counts(xp, st.erased)
    move = reports.sums(xp, st.move_prob)
    out: dict[str, Any] = {}
    for j, pre, counted in reports.targets(lay):
      n = props[..., counted].sum(axis=-1)
      out[pre + "proposals"] = value(n)
      nearest = lay.roundings[j] == "nearest"
      num = erased[..., j, :] if nearest else move[..., j, :]
      key = "erased_fraction" if nearest else "move_prob"
      if nearest:
        out[pre + "erased"] = value(num[..., counted].sum(axis=-1))
        out[pre + "crossing"] = value(xp.asarray(st.run_start)[..., j])
      out[pre + key] = ratio(num[..., counted].sum(axis=-1), n)
      for i in counted:
        out[f"{pre}{key}/{lay.leaves[i]}"] = ratio(num[..., i], props[..., i])
        out[f"{pre}proposals/{lay.leaves[i]}"] = value(props[..., i])
      if nearest and st.at_init is not None:
        kept = reports.counts(xp, st.at_init)[..., j, :]
        total = sum(lay.sizes[i] for i in counted)
        out[pre + "at_init"] = value(kept[..., counted].sum(axis=-1))
        out[pre + "at_init_fraction"] = ratio(
          kept[..., counted].sum(axis=-1), reports.counts(xp, total)
        )
        for i in counted:
          out[f"{pre}at_init/{lay.leaves[i]}"] = value(kept[..., i])
    if st.sample_index is not None:
      out["pred/sample/w"] = xp.asarray(st.sample_w)
      out["pred/sample/u"] = xp.asarray(st.sample_u)
    return out

  def sample_positions(self) -> list[tuple[str, int]]:
    """The sampled coordinates as `(leaf path, flat index in the leaf)`."""
    offsets = np.array(self.layout.offsets + (np.inf,))
    out = []
    if self.sample_index is None:
      return out
    for i in np.asarray(self.sample_index).tolist():
      leaf = int(np.searchsorted(offsets, i, side="right")) - 1
      out.append((self.layout.leaves[leaf], i - int(offsets[leaf])))
    return out


def leaf_paths(tree) -> list[str]:
  """Leaf paths as `"a/b/c"` strings, in `jax.tree_util` leaf order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [reports.leaf_name(p) for p, _ in flat]


def reference_trace(
  targets,
  *,
  sample: int = 0,
  key: jax.Array | None = None,
  theta: float = 0.5,
  at_init: bool = False,
) -> optax.GradientTransformation:
  """Records the predicted erased fraction of each step for target formats.

  Place it last in a float32 chain. For each target format `Q` and each
  nonzero proposal `u` at float32 weight `w` it evaluates, inside the jitted
  update, the nearest-rounding write-back rule at the target-grid weight:

    erased(w, u)  <=>  u != 0  and  Q_RN(Q_RN(w) + u) == Q_RN(w)

  with `Q_RN` the library's nearest rounding (ties to even, saturating), so
  the rule is exact at powers of two, subnormals and the format's maximum.
  The predicted erased fraction is `p_t = #erased / #(u != 0)`, per leaf and
  over all counted leaves. For a stochastic target the persistent freeze is
  predicted to be none; the trace reports instead the mean probability that
  a proposal moves its coordinate under stochastic rounding,
  `min(1, |(Q_RN(w) + u) - Q_RN(w)| / gap)` with the gap in the direction of
  `u` (dead-zone: 1 where nearest rounding would move it).

  An MX scaled target (`"mxfp8_e4m3"`, a `lowprec.ScaledFormat`; NVFP4
  and per-tensor formats are refused, as the write-back refuses them)
  predicts the write-back that recomputes block scales from `w + u`:
  `Q_RN` is `scaled.fake_quantize`, whose scales come from its argument,

    erased(w, u)  <=>  u != 0  and  FQ(q + u) == q,   q = FQ(w)

  so `q` is the reference weight on the grid of its own block scales and
  the rounding of `q + u` uses the scales of `q + u`: a proposal that
  moves its block's maximum moves the gap of every coordinate of the
  block. Its stochastic move probability is `scaled.move_probability`:
  the same formula with the gap at `q` in units of the block scale of
  `q + u`, and 1 where that scale put `q` off the grid.

  Counts are exact integers, the same however the params are sharded;
  `move_prob` is a float32 sum of probabilities, whose last bits (about
  1e-7 relative) follow the reduction order and so can differ between
  device layouts.

  The state holds only this step's counts (memory O(params) at most, for the
  temporaries): log `lowprec.telemetry(state)` every step to build the curve.
  Updates pass through unchanged, so the float32 run is not perturbed.

  To audit coordinates, `sample=N` keeps N coordinates fixed for the whole
  run (one uniformly random coordinate in each of N equal slices of the
  flattened parameter vector, drawn from `key` at init) and reports their
  `(w_t, u_t)` every step. The same `sample` and `key` pick the same
  coordinates in a low-precision run: put the trace just before
  `lowprec.writeback` there to record the realized trajectory.

  With `at_init=True` the trace also predicts which coordinates a nearest
  write-back leaves at their initial value: coordinate `i` is predicted
  still there after step `t` when every reference proposal so far would be
  erased at its initial grid value, `Q_RN(q0 + u_s) == q0` with
  `q0 = Q_RN(w_0)`, for all `s <= t` (norm gains at 1.0 under bf16, weight
  decay too small to register). This keeps `q0` (float32) and a flag per
  coordinate and nearest target: O(params) memory, by choice. Compare with
  `lowprec.freeze.stuck` on the low-precision run's params.

  Reference: the write-back freezing paper (see docs/freeze.md; the half-ULP
  condition, predicted from a high-precision trace and the target format
  alone, and audited coordinate by coordinate).

  Args:
    targets: a format name or `Format`, a `Target`, a list of these, or a
      dict `{name: spec}` where a spec may also be a per-parameter format
      specification as `lowprec.to_grid` takes it (a pytree of formats, or
      `[(regex, format or None), ...]` rules). Names default to the format name,
      with `_sr` / `_dzsr` appended for stochastic / dead-zone targets.
    sample: number of coordinates to sample for audits (0 for none).
    key: a PRNG key choosing the sample at init; required when
      `sample > 0`. No other randomness is drawn.
    theta: threshold of the online crossing step reported as `crossing`.
    at_init: also predict the coordinates still at their initial value
      (nearest targets; see above).

  Returns:
    An `optax.GradientTransformation` whose state is a `ReferenceTraceState`.

  Raises:
    ValueError: no or duplicate targets, unknown formats or roundings, a leaf
      matching no rule, `sample > 0` without a key, more samples than
      coordinates, or a missing `params` argument to `update`.

  Example:
    ```python
    opt = optax.chain(
        optax.adamw(optax.cosine_decay_schedule(1e-3, 1000)),
        lowprec.freeze.reference_trace(["bfloat16", "float8_e4m3fn"]))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    lowprec.telemetry(state)["pred/bfloat16/erased_fraction"]
    ```
  """
  parsed = _parse_targets(targets)
  sample = _checked_sample(sample, key, theta)

  def make_layout(params) -> TraceLayout:
    stored = _stored_layers(params)
    if stored is not None:
      # Every layer counts, samples and reports as its own leaf.
      params = jax.eval_shape(stacked.unstack, params)
    flat = reports.float_paths(params)
    return TraceLayout(
      targets=tuple(n for n, _ in parsed),
      roundings=tuple(t.rounding for _, t in parsed),
      leaves=tuple(reports.leaf_name(p) for p, _ in flat),
      formats=tuple(
        tuple(t.leaf_format(p) for p, _ in flat) for _, t in parsed
      ),
      sizes=tuple(int(np.size(x)) for _, x in flat),
      theta=float(theta),
      stored=stored,
    )

  def init_fn(params):
    lay = make_layout(params)
    ws = reports.float_leaves(params)
    if lay.stored is not None and at_init:
      raise ValueError(
        "reference_trace(at_init=True) keeps a flag per coordinate of each "
        "leaf, and params holding stacked layers (lowprec.engine.stacked) "
        "give it a leaf of several: store the layers apart "
        "(stacked.unstack), or trace without at_init"
      )
    _check_blocks(_apart_shapes(ws, lay), lay)
    n_t, n_l = len(lay.targets), len(lay.leaves)
    index = _sample_index(key, sample, sum(lay.sizes))
    empty = None if not sample else jnp.zeros([sample], jnp.float32)
    tracked = _init_tracking(ws, lay) if at_init else {}
    return ReferenceTraceState(
      count=jnp.zeros([], jnp.int32),
      proposals=jnp.zeros([n_l], jnp.int32),
      erased=jnp.zeros([n_t, n_l], jnp.int32),
      move_prob=jnp.zeros([n_t, n_l], jnp.float32),
      run_start=jnp.full([n_t], -1, jnp.int32),
      sample_index=index,
      sample_w=empty,
      sample_u=empty,
      layout=lay,
      **tracked,
    )

  def update_fn(updates, state, params=None):
    lay = state.layout
    n_stored = len(lay.leaves) if lay.stored is None else len(lay.stored)
    ws, us = reports.step_leaves("reference_trace", params, updates, n_stored)
    ws = [jnp.asarray(w, jnp.float32) for w in ws]
    us = [jnp.asarray(u, jnp.float32) for u in us]
    # One traced count per kind of leaf (stacked), not per leaf, and the
    # counts back in leaf order as one array each.
    proposals, erased_a, move_a = _stacked(
      ws,
      us,
      lambda fmts, w, u: _leaf_counts(w, u, fmts, lay.roundings),
      lay,
      state,
    )
    run_start = _online_crossing(state, proposals, erased_a, lay)
    sample_w, sample_u = _gather(ws, us, state.sample_index, lay)
    new = ReferenceTraceState(
      count=optax.safe_increment(state.count),
      proposals=proposals,
      erased=erased_a,
      move_prob=move_a,
      run_start=run_start,
      sample_index=state.sample_index,
      sample_w=sample_w,
      sample_u=sample_u,
      layout=lay,
      **(_track(state, us, lay) if state.still is not None else {}),
    )
    return updates, new

  return optax.GradientTransformation(init_fn, update_fn)


def _checked_sample(sample, key, theta) -> int:
  sample = int(sample)
  if sample < 0:
    raise ValueError(f"sample must be >= 0, got {sample}")
  if sample and key is None:
    raise ValueError(
      "sample > 0 needs a key: reference_trace(..., sample=N, "
      "key=jax.random.key(0))"
    )
  if not 0.0 <= theta <= 1.0:
    raise ValueError(f"theta must lie in [0, 1], got {theta}")
  return sample


def _sample_index(key, sample: int, total: int):
  """`sample` distinct coordinates of `total`: one uniform draw per equal
  slice, spread over all leaves (None without a sample)."""
  if sample > total:
    raise ValueError(f"sample={sample} exceeds the {total} coordinates")
  if sample and total >= 2**31:
    raise ValueError("sample= supports up to 2**31 - 1 coordinates")
  if not sample:
    return None
  edges = np.arange(sample + 1, dtype=np.int64) * total // sample
  widths = jnp.asarray(np.diff(edges), jnp.int32)
  r = jax.random.randint(key, (sample,), 0, widths, dtype=jnp.int32)
  return jnp.asarray(edges[:-1], jnp.int32) + r


def _stored_layers(params):
  """`TraceLayout.stored` of `params` (None when no leaf stacks layers)."""
  names = [reports.leaf_name(p) for p, _ in reports.float_paths(params)]
  if not any(stacked.layer_names(n) for n in names):
    return None
  apart = reports.float_paths(jax.eval_shape(stacked.unstack, params))
  return stacked.apart_index(names, [reports.leaf_name(p) for p, _ in apart])


def _apart(lay: TraceLayout, n_stored: int) -> tuple:
  """`lay.stored`, or each stored leaf its own index where none stacks."""
  return tuple(range(n_stored)) if lay.stored is None else lay.stored


def _apart_shapes(ws, lay: TraceLayout) -> list:
  """The leaves stored apart, from the stored `ws` (a layer of a stacked
  leaf as its shape alone)."""
  out = [None] * len(lay.leaves)
  for w, a in zip(ws, _apart(lay, len(ws)), strict=True):
    if not isinstance(a, tuple):
      out[a] = w
      continue
    for i in a:
      out[i] = jax.ShapeDtypeStruct(jnp.shape(w)[1:], jnp.float32)
  return out


def _stacked(ws, us, counts, lay: TraceLayout, state):
  """Proposals `[leaves]`, erased and move probabilities `[targets,
  leaves]` from `counts` of each leaf (the state's own without leaves);
  a leaf of stacked layers counts each layer, under `vmap`."""
  if not ws:
    return state.proposals, state.erased, state.move_prob
  formats = lambda i: tuple(f[i] for f in lay.formats)  # noqa: E731
  apart = _apart(lay, len(ws))
  statics = []
  for a in apart:
    if isinstance(a, tuple) and any(formats(i) != formats(a[0]) for i in a):
      raise ValueError(
        f"reference_trace: the layers of {lay.leaves[a[0]]!r}, stored "
        "stacked, have different target formats; store them apart"
      )
    statics.append(formats(a[0] if isinstance(a, tuple) else a))
  rows = list(zip(ws, us, strict=True))
  p, e, m = leafwise.grouped_apart(counts, rows, statics, apart)
  return p, e.T, m.T


def _check_blocks(ws, lay: TraceLayout) -> None:
  """Raises, naming the parameter, where a scaled target's blocks do not
  divide a leaf."""
  for row in lay.formats:
    for name, w, fmt in zip(lay.leaves, ws, row, strict=True):
      if isinstance(fmt, scaled.ScaledFormat):
        spec = jax.ShapeDtypeStruct(jnp.shape(w), jnp.float32)
        try:
          jax.eval_shape(lambda x, f=fmt: scaled.block_amax(x, f), spec)
        except ValueError as e:
          raise ValueError(f"parameter {name!r}: {e}") from None


def _nearest(x, fmt):
  """Nearest rounding onto `fmt`'s grid; a scaled grid takes its scales
  from `x`, as the write-back that recomputes them does."""
  if isinstance(fmt, scaled.ScaledFormat):
    return scaled.fake_quantize(x, fmt)
  return rounding.round_nearest(x, fmt)


def _tracked(lay: TraceLayout, j: int, i: int) -> bool:
  return lay.roundings[j] == "nearest" and lay.formats[j][i] is not None


def _init_tracking(ws, lay: TraceLayout) -> dict:
  """`init_q`, `still` and `at_init` at step 0: every coordinate at init."""
  init_q, still = [], []
  for j in range(len(lay.targets)):
    qs, st = [], []
    for i, w in enumerate(ws):
      on = _tracked(lay, j, i)
      w32 = jnp.asarray(w, jnp.float32)
      qs.append(_nearest(w32, lay.formats[j][i]) if on else None)
      st.append(jnp.ones(w32.shape, bool) if on else None)
    init_q.append(tuple(qs))
    still.append(tuple(st))
  sizes = jnp.asarray(lay.sizes, jnp.int32)
  on = jnp.asarray(
    [[_tracked(lay, j, i) for i in range(len(ws))] for j in range(len(still))],
    bool,
  ).reshape(len(still), len(ws))
  return {
    "init_q": tuple(init_q),
    "still": tuple(still),
    "at_init": jnp.where(on, sizes[None, :], 0).astype(jnp.int32),
  }


def _track(state, us, lay: TraceLayout) -> dict:
  """Clears the flag of every coordinate this step's proposal would move
  from its initial grid value (non-finite proposals move nothing)."""
  still, counts = [], []
  for j, (qs, flags) in enumerate(zip(state.init_q, state.still, strict=True)):
    row_flags, row = [], []
    for i, (q0, flag) in enumerate(zip(qs, flags, strict=True)):
      if flag is None:
        row_flags.append(None)
        row.append(jnp.zeros([], jnp.int32))
        continue
      u = us[i]
      moves = (u != 0) & jnp.isfinite(u)
      moves &= _nearest(q0 + u, lay.formats[j][i]) != q0
      flag = flag & ~moves
      row_flags.append(flag)
      row.append(_count(flag))
    still.append(tuple(row_flags))
    counts.append(jnp.stack(row) if row else jnp.zeros([0], jnp.int32))
  return {
    "init_q": state.init_q,
    "still": tuple(still),
    "at_init": jnp.stack(counts).reshape(state.at_init.shape),
  }


def _leaf_counts(w, u, formats, kinds):
  """Proposals, predicted erasures [T] and summed move probabilities [T].

  All 0/1 outcomes of a leaf are packed into one small integer per element
  and materialised before counting: on CPU, XLA runs a reduction in a single
  thread, so the roundings must not be fused into it.
  """
  zero_f = jnp.zeros([], jnp.float32)
  proposed = u != 0
  bits, move = [proposed], []
  for fmt, kind in zip(formats, kinds, strict=True):
    if fmt is None:
      move.append(zero_f)
      continue
    # On a scaled grid, q takes the scales of w and the rounding of x
    # those of x: the write-back's rule (scales recomputed from w + u).
    q = _nearest(w, fmt)
    x = q + u
    erased = proposed & (_nearest(x, fmt) == q)
    if kind == "nearest":
      bits.append(erased)
      move.append(zero_f)
      continue
    if isinstance(fmt, scaled.ScaledFormat):
      p = scaled.move_probability(q, x, fmt)
    else:
      gap = jnp.where(x > q, fmt.gap_up(q), fmt.gap_down(q))
      p = jnp.minimum(jnp.abs(x - q) / gap, 1.0)
    if kind == "deadzone":
      p = jnp.where(erased, p, 1.0)
    p = jax.lax.optimization_barrier(jnp.where(proposed, p, 0.0))
    move.append(_row_sums(p).sum())
  counts = []
  for start in range(0, len(bits), 32):
    group = bits[start : start + 32]
    dtype = jnp.uint8 if len(group) <= 8 else jnp.uint32
    code = jnp.zeros(w.shape, dtype)
    for i, b in enumerate(group):
      code = code | (b.astype(dtype) << i)
    code = jax.lax.optimization_barrier(code)
    counts += [_count((code >> i) & 1) for i in range(len(group))]
  counts = iter(counts)
  proposals = next(counts)
  zero_i = jnp.zeros([], jnp.int32)
  erased = [
    next(counts) if f is not None and k == "nearest" else zero_i
    for f, k in zip(formats, kinds, strict=True)
  ]
  return proposals, jnp.stack(erased), jnp.stack(move)


_EXACT = 1 << 24  # float32 counts integers exactly up to here


def _row_sums(x) -> jax.Array:
  """float32 sums over the last axis (all of `x` when it has one axis)."""
  x = x.astype(jnp.float32)
  return jnp.sum(x, axis=-1) if x.ndim else x


def _count(bits) -> jax.Array:
  """Exact int32 count of a 0/1 array, summed in float32 where exact."""
  if bits.ndim and bits.shape[-1] <= _EXACT:
    if bits.size <= _EXACT:
      return _row_sums(bits).sum().astype(jnp.int32)
    return jnp.sum(_row_sums(bits).astype(jnp.int32), dtype=jnp.int32)
  return jnp.sum(bits, dtype=jnp.int32)


def _online_crossing(state, proposals, erased, lay: TraceLayout):
  """Step since which every step with proposals had p_t >= theta, else -1."""
  counted = jnp.asarray(
    [[f is not None for f in row] for row in lay.formats], jnp.int32
  ).reshape(erased.shape)
  n = jnp.sum(counted * proposals[None, :], axis=1).astype(jnp.float32)
  k = jnp.sum(counted * erased, axis=1).astype(jnp.float32)
  above = k >= jnp.float32(lay.theta) * n
  start = jnp.where(state.run_start >= 0, state.run_start, state.count)
  new = jnp.where(above, start, -1)
  return jnp.where(n > 0, new, state.run_start).astype(jnp.int32)


def _gather(ws, us, index, lay: TraceLayout):
  """The sampled coordinates' weights and proposals: one gather per kind
  of leaf, from its leaves stacked, whatever the depth."""
  if index is None:
    return None, None
  w_out = jnp.zeros(index.shape, jnp.float32)
  u_out = jnp.zeros(index.shape, jnp.float32)
  for held, w, u in _gather_groups(ws, us, lay):
    size = lay.sizes[held[0]]
    offsets = jnp.asarray([lay.offsets[i] for i in held], jnp.int32)
    inside = (index >= offsets[:, None]) & (index < offsets[:, None] + size)
    member = jnp.argmax(inside, axis=0).astype(jnp.int32)
    at = jnp.clip(index - offsets[member], 0, max(size - 1, 0))
    if len(held) > 1:  # w holds the group's leaves on its first axis
      at = member * size + at
    inside = jnp.any(inside, axis=0)
    w_out = jnp.where(inside, _take(w, at), w_out)
    u_out = jnp.where(inside, _take(u, at), u_out)
  return w_out, u_out


def _gather_groups(ws, us, lay: TraceLayout) -> list:
  """`(leaves held, w, u)` per gather: the stored leaves of one layer
  stacked by shape, and each leaf of stacked layers as it is stored."""
  apart = _apart(lay, len(ws))
  lone = [s for s, a in enumerate(apart) if not isinstance(a, tuple)]
  rows = [(ws[s], us[s]) for s in lone]
  out = []
  for group in leafwise.same_shapes(rows):
    held = [apart[lone[g]] for g in group]
    w, u = rows[group[0]] if len(group) == 1 else leafwise.stack(rows, group)
    out.append((held, w, u))
  for s, a in enumerate(apart):
    if isinstance(a, tuple):
      out.append((list(a), ws[s], us[s]))
  return out


def _take(x, flat_index):
  """`x.ravel()[flat_index]`, replicated, also for explicitly sharded x."""
  if x.ndim == 0:
    return jnp.broadcast_to(x, flat_index.shape)
  idx = jnp.unravel_index(flat_index, x.shape)
  sharding = jax.typeof(x).sharding
  spec = getattr(sharding, "spec", ())
  if any(s is not None for s in spec):
    # Explicit sharding: say where the gathered values go (everywhere).
    return x.at[idx].get(out_sharding=sharding.update(spec=P()))
  return x[idx]


# telemetry names this transform when its state is met as plain arrays.
telemetry_lib.register_layout(
  ReferenceTraceState,
  {"count", "proposals", "erased", "move_prob", "run_start"},
  "lowprec.freeze.reference_trace",
)

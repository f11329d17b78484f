"""What a grid would cost a float32 run, measured in nats.

Two measurements of a float32 run predict the loss a recipe costs:

* the proposals nearest write-back would erase. `progress_trace`, last in
  the float32 chain, adds up, per target grid and coordinate, the
  proposals that nearest rounding onto the grid would erase (`u != 0`
  and `Q(Q(w) + u) == Q(w)` at the grid value of the float32 weight, as
  `reference_trace` defines it): the displacement `D` the float32
  weights took that such a write-back would not have taken.
  `lost_cost` then evaluates the loss at the final float32 weights minus
  that displacement, one group of tensors at a time, and on the grid:
  `loss(Q(w - D)) - loss(w)`. Unlike a first-order sum of `-g . u` this
  needs no gradient estimate (the step's own minibatch gradient
  overstates the progress its update made, and the next step's misses
  the curvature along it), and an oscillating coordinate whose erased
  proposals cancel costs nothing.
* the forward cost. `forward_cost` evaluates the loss with a group's
  weights on the grid, by nearest rounding, and by stochastic rounding
  over independent draws (mean and standard error): what a model
  computing with those weights pays, noise included, at the end of the
  run.

Both are predictions of a write-back run from the float32 trajectory:
they hold while the low-precision run stays near it (where a grid erases
nearly everything from the first steps, the run never gets near the
float32 weights, and the prediction is a lower bound).

    trace = lowprec.freeze.progress_trace(["bfloat16"])
    tx = optax.chain(optax.adamw(1e-3), trace)
    ... train ...
    lowprec.freeze.lost_cost(val_loss, params, opt_state)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import weights
from lowprec.engine.codec import Codec, encode
from lowprec.freeze import trace


class ProgressCounts(NamedTuple):
  """`progress_trace`'s telemetry: per target and parameter, the norm of
  the erased displacement so far."""

  count: jax.Array  # int32 []: updates so far
  norm: dict[str, dict[str, jax.Array]]  # float32 []: |D| per leaf

  def arrays(self) -> dict[str, jax.Array]:
    """`report()`'s keys as arrays (under jit, scan and vmap)."""
    return self._collect(self, jnp)

  def report(self) -> dict[str, float]:
    """`progress/<target>/displaced` (the L2 norm of the displacement the
    target's nearest rounding would have erased, over every parameter)
    and `progress/<target>/displaced/<path>` per parameter."""
    host = jax.device_get(self)
    return {k: float(v) for k, v in self._collect(host, np).items()}

  @staticmethod
  def _collect(st, xp) -> dict[str, Any]:
    out = {}
    for t, per in st.norm.items():
      sq = [
        xp.asarray(v, xp.float64 if xp is np else xp.float32) ** 2
        for v in per.values()
      ]
      out[f"progress/{t}/displaced"] = xp.sqrt(sum(sq)) if sq else 0.0
      for leaf, v in per.items():
        out[f"progress/{t}/displaced/{leaf}"] = xp.asarray(v)
    return out


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ProgressLayout:
  """Static: per target, `(parameter path, format)` of the parameters it
  covers (no arrays)."""

  formats: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]

  def of(self, target: str) -> dict[str, Any]:
    return dict(dict(self.formats)[target])


class ProgressTraceState(NamedTuple):
  """State of `progress_trace`: per target and parameter, the sum of the
  proposals its nearest rounding would have erased (float32, shaped like
  the parameter), the counts, and the formats (static)."""

  displaced: dict[str, dict[str, jax.Array]]
  counts: ProgressCounts
  layout: ProgressLayout


def progress_trace(targets) -> optax.GradientTransformation:
  """Adds up, per target grid, the proposals nearest write-back would erase.

  Place it last in a float32 chain (after the optimizer, beside
  `reference_trace`); updates pass through unchanged. Its state holds, per
  target and parameter, `D = sum of the erased proposals` (module
  docstring): one float32 array like the parameter per target, read by
  `lost_cost` from the final state (a checkpoint's).

  Args:
    targets: format names (`["bfloat16", "float8_e4m3fn"]`, each its own
      name), or `{name: format spec}` with a spec as `lowprec.to_grid`
      takes it (one format, or `(regex, format)` rules, None for
      parameters left out).

  Returns:
    An `optax.GradientTransformation` whose state is a
      `ProgressTraceState`.

  Raises:
    ValueError: no targets; at `init`, a spec that does not cover a
      parameter; at `update`, no params.
  """
  named = _named(targets)

  def init_fn(params):
    fmts = _layout(named, params)
    shapes = {weights.path_name(p): jnp.shape(x) for p, x in _leaves(params)}
    zero = jnp.zeros([], jnp.float32)
    return ProgressTraceState(
      {
        t: {n: jnp.zeros(shapes[n], jnp.float32) for n in f}
        for t, f in fmts.items()
      },
      ProgressCounts(
        jnp.zeros([], jnp.int32),
        {t: dict.fromkeys(f, zero) for t, f in fmts.items()},
      ),
      ProgressLayout(tuple((t, tuple(f.items())) for t, f in fmts.items())),
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "progress_trace rounds the params onto each target grid and needs "
        "them: call opt.update(updates, state, params)"
      )
    us = {weights.path_name(p): u for p, u in _leaves(updates)}
    ws = {weights.path_name(p): w for p, w in _leaves(params)}
    displaced, norm = {}, {}
    for t, _ in state.layout.formats:
      fmts = state.layout.of(t)
      displaced[t], norm[t] = {}, {}
      for n, f in fmts.items():
        w = jnp.asarray(ws[n], jnp.float32)
        u = jnp.asarray(us[n], jnp.float32)
        # reference_trace's rule, on its rounding.
        q = trace._nearest(w, f)
        erased = (u != 0) & jnp.isfinite(u) & (trace._nearest(q + u, f) == q)
        d = state.displaced[t][n] + jnp.where(erased, u, 0.0)
        displaced[t][n] = d
        norm[t][n] = jnp.sqrt(jnp.sum(d * d))
    counts = ProgressCounts(optax.safe_increment(state.counts.count), norm)
    return updates, ProgressTraceState(displaced, counts, state.layout)

  return optax.GradientTransformation(init_fn, update_fn)


def lost_cost(
  loss_fn, params, state, *, groups=None
) -> dict[str, dict[str, Cost]]:
  """The loss each group's erased proposals cost, measured.

  For each group of tensors (`lowprec.groups`) and each target of the
  `progress_trace` in `state`, the group's float32 weights `w` are moved
  back by the displacement the target's nearest rounding would have
  erased, and put on the grid: `loss_fn(Q(w - D)) - loss_fn(w)`, the
  group's nearest write-back cost as the float32 run predicts it (the
  forward cost of the grid included).

  Args:
    loss_fn: `params -> scalar` (e.g. the validation loss; jit it).
    params: the float32 parameters the trace ended at.
    state: the optimizer state holding a `ProgressTraceState`, or that
      state itself.
    groups: `(name, regex)` pairs (`lowprec.groups.DEFAULT_GROUPS`).

  Returns:
    `{group: {target: Cost}}` (one evaluation each: `se` 0, `draws` 1).

  Raises:
    ValueError: no `ProgressTraceState` in `state`.
  """
  trace = _find(state)
  flat, treedef, names, members = _grouped(params, groups)
  base = float(loss_fn(params))
  out: dict[str, dict[str, Cost]] = {}
  for g, leaves in members.items():
    out[g] = {}
    for t, per in trace.displaced.items():
      fmts = trace.layout.of(t)
      if not any(n in per for n in leaves):
        continue
      new = []
      for (_, x), n in zip(flat, names, strict=True):
        if n not in leaves or n not in per:
          new.append(x)
          continue
        moved = jnp.asarray(x, jnp.float32) - per[n]
        new.append(encode(Codec(fmts[n]), moved).value)
      loss = float(loss_fn(jax.tree_util.tree_unflatten(treedef, new)))
      out[g][t] = Cost(loss - base, 0.0, 1)
  return out


class Cost(NamedTuple):
  """What putting a group of weights on a grid costs the loss, in nats."""

  mean: float  # loss on the grid minus the loss as given
  se: float  # standard error of the mean over the draws (0: nearest)
  draws: int  # roundings evaluated (1 for nearest)


def forward_cost(
  loss_fn,
  params,
  targets,
  *,
  groups=None,
  key: jax.Array | None = None,
  draws: int = 8,
) -> dict[str, dict[str, Cost]]:
  """The loss each group's weights cost on each grid, measured.

  For each group of tensors (`lowprec.groups`) and each target grid, the
  group's weights alone are put on the grid and `loss_fn` evaluated:
  `loss_fn(on grid) - loss_fn(params)`. Nearest rounding once; stochastic
  rounding `draws` times with independent bits, giving the mean and its
  standard error. On a checkpoint of a float32 run this is the forward
  part of what a recipe on that grid costs: the weights the model
  computes with are rounded, and stochastic rounding adds its noise
  (one rounding's worth of it: a write-back's weights carry one rounding
  of noise at any step).

  Args:
    loss_fn: `params -> scalar` (e.g. the validation loss of a
      checkpoint's model; jit it, it is called many times).
    params: the float32 parameters, a pytree.
    targets: as `progress_trace` takes them.
    groups: `(name, regex)` pairs (`lowprec.groups.DEFAULT_GROUPS`).
    key: the PRNG key of the stochastic draws (required for them).
    draws: stochastic roundings per group and grid; 0 for nearest only.

  Returns:
    `{group: {name: Cost}}`, `name` the target's for nearest rounding and
      `<name>_sr` for stochastic (the names `lowprec.freeze.advise` reads).

  Raises:
    ValueError: no targets, `draws > 0` without a key, a negative `draws`.
  """
  from lowprec.grids import rng as rng_lib

  named = _named(targets)
  if draws < 0:
    raise ValueError(f"draws must be >= 0, got {draws}")
  if draws and key is None:
    raise ValueError(
      "forward_cost draws stochastic roundings and needs a key: "
      "forward_cost(..., key=jax.random.key(0)), or draws=0"
    )
  flat, treedef, names, members = _grouped(params, groups)
  layout = _layout(named, params)
  base = float(loss_fn(params))
  out: dict[str, dict[str, Cost]] = {}
  for g, leaves in members.items():
    out[g] = {}
    for ti, (t, all_fmts) in enumerate(layout.items()):
      fmts = {n: f for n, f in all_fmts.items() if n in leaves}
      if not fmts:
        continue

      def rounded(bits_key, fmts=fmts):
        new = []
        for (_, x), n in zip(flat, names, strict=True):
          if n not in fmts:
            new.append(x)
            continue
          w = jnp.asarray(x, jnp.float32)
          if bits_key is None:
            new.append(encode(Codec(fmts[n]), w).value)
            continue
          bits = rng_lib.random_bits(
            jax.random.fold_in(bits_key, rng_lib.leaf_seed(n)), w.shape
          )
          codec = Codec(fmts[n], "stochastic")
          new.append(encode(codec, w, bits=bits).value)
        return jax.tree_util.tree_unflatten(treedef, new)

      near = float(loss_fn(rounded(None))) - base
      out[g][t] = Cost(near, 0.0, 1)
      if draws:
        ks = jax.random.split(jax.random.fold_in(key, ti), draws)
        d = np.array([float(loss_fn(rounded(k))) - base for k in ks])
        se = float(d.std(ddof=1) / np.sqrt(draws)) if draws > 1 else np.inf
        out[g][f"{t}_sr"] = Cost(float(d.mean()), se, draws)
  return out


def _grouped(params, groups):
  """`(flat, treedef, names, {group: [names]})` of `params`' leaves."""
  from lowprec.optim import groups as groups_lib

  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [weights.path_name(p) for p, _ in flat]
  members = groups_lib.members(
    [n for n, (_, x) in zip(names, flat, strict=True) if weights.is_array(x)],
    groups_lib.as_groups(groups),
  )
  return flat, treedef, names, members


def _find(state) -> ProgressTraceState:
  """The `ProgressTraceState` in an optimizer state."""

  def is_trace(x) -> bool:
    return isinstance(x, ProgressTraceState)

  found = [
    x for x in jax.tree_util.tree_leaves(state, is_leaf=is_trace) if is_trace(x)
  ]
  if len(found) != 1:
    raise ValueError(
      f"lost_cost reads the erased displacement of one progress_trace; "
      f"the state holds {len(found)}: pass the final optimizer state of a "
      "float32 run whose chain ends with lowprec.freeze.progress_trace(...)"
    )
  return found[0]


def _layout(named, params) -> dict[str, dict[str, Any]]:
  """Per target, `{path: format}` of the parameters it covers."""
  out = {}
  for t, spec in named.items():
    lookup = weights.format_lookup(spec)
    fmts = {}
    for path, w in _leaves(params):
      f = weights.leaf_format(lookup, path, w)
      if f is not None:
        fmts[weights.path_name(path)] = f
    out[t] = fmts
  return out


def _leaves(tree):
  return [
    (p, x)
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    if weights.is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating)
  ]


def _named(targets) -> dict[str, Any]:
  if isinstance(targets, str) or not targets:
    raise ValueError(
      "progress_trace needs targets: format names, e.g. ['bfloat16', "
      "'float8_e4m3fn'], or {name: format spec}"
    )
  if isinstance(targets, dict):
    return dict(targets)
  if isinstance(targets, Sequence):
    return {str(t): str(t) for t in targets}
  raise ValueError(
    f"progress_trace targets must be a list of format names or a dict, got "
    f"{type(targets).__name__}"
  )

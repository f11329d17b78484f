"""The progress a grid would take from a float32 run, in nats.

A float32 step moves each weight by the optimizer's proposal `u`, and to
first order lowers the minibatch loss by `-g . u` (`g` the gradient the
step was given). Nearest write-back onto a grid keeps none of the
proposals it erases, so the float32 run predicts, step by step, the
first-order decrease of the loss that such a write-back would give up:

    lost_t = sum over erased proposals of -g_i u_i,

erased as `reference_trace` defines it (`Q(Q(w) + u) == Q(w)`, `u != 0`,
at the grid value of the float32 weight). Summed over a run, it is the
loss (in nats, of the training minibatches) that the erased proposals
would have taken off: a first-order estimate of what freezing costs, to
be read beside the erased share. It is an estimate: it ignores the
curvature along the proposals, the later steps that make up for some of
what was erased, and that a write-back's trajectory leaves the float32
one. Stochastic rounding gives up nothing in expectation (its cost is
the noise of its rounding, which `forward_cost` measures).

    tx = lowprec.freeze.progress_trace(optax.adamw(1e-3), ["bfloat16"])
    ...
    lowprec.telemetry(state)["progress/bfloat16/lost"]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import weights
from lowprec.engine.codec import Codec, encode


class ProgressTraceState(NamedTuple):
  """State of `progress_trace`: the inner state and its last step's sums
  of `-g . u`, in total and over the proposals each target would erase,
  per parameter path."""

  inner: Any  # the inner transform's state, as it would be without a trace
  count: jax.Array  # int32 []: updates so far
  total: dict[str, jax.Array]  # float32 []: sum of -g u per leaf
  lost: dict[str, dict[str, jax.Array]]  # [target][leaf] over the erased

  def arrays(self) -> dict[str, jax.Array]:
    """`report()`'s keys as arrays (under jit, scan and vmap)."""
    return self._collect(self, jnp)

  def report(self) -> dict[str, float]:
    """`progress/total` (this step's first-order loss decrease, `-g . u`
    summed over every parameter) and, per target, `progress/<target>/
    lost` (its part over the proposals the target's nearest rounding
    would erase), each also per parameter path (`.../<path>`), in nats.
    Sums are float64 on the host."""
    host = jax.device_get(self._replace(inner=None))
    return {k: float(v) for k, v in self._collect(host, np).items()}

  @staticmethod
  def _collect(st, xp) -> dict[str, Any]:
    wide = (lambda v: xp.asarray(v, xp.float64)) if xp is np else xp.asarray
    out = {"progress/total": sum(wide(v) for v in st.total.values())}
    for leaf, v in st.total.items():
      out[f"progress/total/{leaf}"] = wide(v)
    for t, per in st.lost.items():
      out[f"progress/{t}/lost"] = sum(wide(v) for v in per.values())
      for leaf, v in per.items():
        out[f"progress/{t}/lost/{leaf}"] = wide(v)
    return out


def progress_trace(
  inner: optax.GradientTransformation, targets
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` and sums, each update, the progress a grid would lose.

  `inner` runs unchanged (its updates pass through, its state is kept in
  the field `inner`); it must be the whole optimizer, so that what this
  transform is given is the gradient and what `inner` returns is the
  proposal that `optax.apply_updates` adds. For each target grid and each
  parameter it records this step's `sum(-g u)` over the proposals that
  nearest write-back onto the grid would erase (module docstring).

  Args:
    inner: the float32 optimizer (e.g. `optax.adamw(1e-3)`).
    targets: format names (`["bfloat16", "float8_e4m3fn"]`, each its own
      name), or `{name: format spec}` with a spec as `lowprec.to_grid`
      takes it (one format, or `(regex, format)` rules, None for
      parameters left out).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
      `ProgressTraceState`.

  Raises:
    ValueError: no targets; at `init`, a spec that does not cover a
      parameter.
  """
  named = _named(targets)
  inner = optax.with_extra_args_support(inner)

  def layout(params):
    out = {}
    for t, spec in named.items():
      lookup = weights.format_lookup(spec)
      fmts = {}
      for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
        f = weights.leaf_format(lookup, path, w)
        if f is not None:
          fmts[weights.path_name(path)] = f
      out[t] = fmts
    return out

  def init_fn(params):
    names = [weights.path_name(p) for p, _ in _leaves(params)]
    zero = jnp.zeros([], jnp.float32)
    lost = {t: dict.fromkeys(f, zero) for t, f in layout(params).items()}
    return ProgressTraceState(
      inner.init(params),
      jnp.zeros([], jnp.int32),
      dict.fromkeys(names, zero),
      lost,
    )

  def update_fn(updates, state, params=None, **extra):
    if params is None:
      raise ValueError(
        "progress_trace rounds the params onto each target grid and needs "
        "them: call opt.update(grads, state, params)"
      )
    grads = updates
    updates, new_inner = inner.update(grads, state.inner, params, **extra)
    gs = {weights.path_name(p): g for p, g in _leaves(grads)}
    us = {weights.path_name(p): u for p, u in _leaves(updates)}
    ws = {weights.path_name(p): w for p, w in _leaves(params)}
    gain = {
      n: -jnp.asarray(gs[n], jnp.float32) * jnp.asarray(us[n], jnp.float32)
      for n in ws
    }
    total = {
      n: jnp.sum(jnp.where(jnp.isfinite(v), v, 0.0)) for n, v in gain.items()
    }
    lost = {}
    for t, fmts in layout(params).items():
      lost[t] = {}
      for n, f in fmts.items():
        w = jnp.asarray(ws[n], jnp.float32)
        u = jnp.asarray(us[n], jnp.float32)
        q = encode(Codec(f), w).value
        erased = (u != 0) & (encode(Codec(f), q + u).value == q)
        erased &= jnp.isfinite(gain[n])
        lost[t][n] = jnp.sum(jnp.where(erased, gain[n], 0.0))
    count = optax.safe_increment(state.count)
    return updates, ProgressTraceState(new_inner, count, total, lost)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
  from lowprec.optim import groups as groups_lib

  named = _named(targets)
  if draws < 0:
    raise ValueError(f"draws must be >= 0, got {draws}")
  if draws and key is None:
    raise ValueError(
      "forward_cost draws stochastic roundings and needs a key: "
      "forward_cost(..., key=jax.random.key(0)), or draws=0"
    )
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [weights.path_name(p) for p, _ in flat]
  members = groups_lib.members(
    [n for n, (_, x) in zip(names, flat, strict=True) if weights.is_array(x)],
    groups_lib.as_groups(groups),
  )
  base = float(loss_fn(params))
  out: dict[str, dict[str, Cost]] = {}
  for g, leaves in members.items():
    out[g] = {}
    for ti, (t, spec) in enumerate(named.items()):
      lookup = weights.format_lookup(spec)
      fmts = {}
      for (path, x), n in zip(flat, names, strict=True):
        if n in leaves:
          f = weights.leaf_format(lookup, path, x)
          if f is not None:
            fmts[n] = f
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

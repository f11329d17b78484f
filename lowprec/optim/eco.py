"""Error feedback into the momentum (ECO): weights kept only on their grid.

Without a float32 master copy, each step writes `W^' = Q(W^ + u)` and the
rounding error `e = (W^ + u) - W^'` is gone. ECO (Nikdan, Zandieh,
Alistarh, Mirrokni, 2026) folds `e` into the optimizer's first moment
instead, scaled so that the updates of the following steps re-apply it
once in total. Nothing is stored beyond the weights (on their grid) and the
state the optimizer keeps anyway.

`eco` wraps the optimizer: it runs it in float32 (as `lowprec.in_float32`
does), writes its update back onto the weights' grid through the storage
engine (`lowprec.leafwise`, `lowprec.store`), and folds each weight's
error into that weight's first moment (`mu` of the Adam family, `trace` of
SGD with momentum). The fold is scaled by how the optimizer turns its first
moment into updates, read off the optimizer in closed form where eco knows
its transforms (`lowprec.optim.eco_fold`: optax's Adam family and SGD
with momentum, in chains with clips, schedules and weight decay), else
measured at each step as a forward-mode derivative (`jax.jvp`):

  fold = e (1 - r) / D,    r = dm'/dm,    D = du/dm,

where `m` is the first moment the step reads, `m'` the one it writes and
`u` its update. A unit of `m'` left in the momentum decays by `r` per step
and is emitted as `D` per unit, so the fold's later updates sum to
`D fold / (1 - r) = e` when `D` and `r` stay as they are. For heavy-ball
momentum (`m' = g + beta m`, `u = -eta m'`) this is `-e / c`, `c = eta
beta / (1 - beta)`, which keeps the virtual iterate `Z = W - c m`
unchanged by the rounding; for Adam it is `-e (1 - b1) / (d b1)` with
`d = lr / ((1 - b1^t)(sqrt(nhat) + eps))`. docs/eco.md derives both and
compares them with the paper's.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import counting, leafwise
from lowprec.engine.counting import mass
from lowprec.engine.weights import format_lookup, is_array, path_name
from lowprec.grids import choices
from lowprec.grids import rng as rng_lib
from lowprec.grids.rounding import OVERFLOW_MODES
from lowprec.optim import eco_fold
from lowprec.optim.compensated import as_emitted
from lowprec.optim.float32_views import _widen as float32_view
from lowprec.optim.stored_state import StoredState

# Dead-zone rounding is left out: it exists to move weights that nearest
# rounding freezes, and the momentum already carries what nearest drops.
ECO_ROUNDINGS = ("nearest", "stochastic")
# The names under which optax keeps a first moment: Adam's family (`mu`),
# SGD with momentum, `optax.trace` and RMSprop with momentum (`trace`).
FIRST_MOMENTS = ("mu", "trace")

_COUNTS = ("proposals", "moved", "saturated", "unreachable", "nonfinite")
_REPORTED = ("proposals", "erased", "moved", "saturated", "unreachable")
_REPORTED += ("nonfinite",)
_MASSES = ("carried",)
# How the fold's derivatives are taken, by the code `EcoState.fold` keeps.
_FOLDS = ("jvp", "closed")


class EcoState(NamedTuple):
  """State of `eco`: the inner optimizer's state, a key and counts.

  `inner` is the inner optimizer's state for float32 params; its first
  moment holds the folded errors. Counts are dicts from parameter path to
  an int32 scalar (`carried` to a float32 scalar), for the parameters that
  have a format; None with `telemetry=False`. `fold` says how the fold's
  derivatives are taken (an array, so that views of the state and
  checkpoints keep it; None with `telemetry=False` too).
  """

  count: jax.Array  # int32 []: updates applied so far.
  key: jax.Array | None  # uint32 [2] key data, split each update; None (RN).
  inner: Any  # the inner optimizer's state (float32 moments).
  proposals: dict[str, jax.Array] | None  # int32 [] per path: finite u != 0.
  moved: dict[str, jax.Array] | None  # int32 [] per path: W^' != W^.
  saturated: dict[str, jax.Array] | None  # int32 [] per path: past max.
  unreachable: dict[str, jax.Array] | None  # int32 [] per path: detoured.
  nonfinite: dict[str, jax.Array] | None  # int32 [] per path: u or W^ bad.
  carried: dict[str, jax.Array] | None  # float32 [] per path: sum |e| folded.
  fold: jax.Array | None  # int32 []: r and D taken by 0 jvp, 1 closed form.

  def arrays(self) -> dict[str, jax.Array]:
    """The telemetry as arrays, traceable: keys as in `report()`, with
    `fold` as its int32 code (0 "jvp", 1 "closed")."""
    out = counting.of_state(self, _REPORTED, masses=_MASSES, host=False)
    return _with_fold(out, self.fold)

  def report(self) -> dict[str, int | float | str]:
    """The telemetry as plain numbers: totals, then `<count>/<path>`.

    Keys: `steps`, `fold` ("closed" where `r` and `D` are read off the
    optimizer, "jvp" where they are taken by forward-mode
    differentiation; see `eco`), `proposals` (finite `u != 0`),
    `erased` (proposals whose weight did not move; their error is
    folded), `moved`, `saturated`, `unreachable` (as in
    `lowprec.writeback`), `nonfinite` (a NaN or infinite `u`, or a NaN
    weight: never written or folded), `erased_fraction` (erased /
    proposals, NaN without proposals), `carried` (the float32 sum of
    `|e|` folded into the momentum this step), and each of them per
    parameter path.
    """
    st = jax.device_get(self._replace(key=None, inner=None))
    out = counting.of_state(st, _REPORTED, masses=_MASSES, host=True)
    if st.fold is None:
      return out
    codes = np.asarray(st.fold)
    names = np.asarray(_FOLDS)[codes]
    return _with_fold(out, names.tolist() if codes.ndim else str(names))

  def check_stored(self, prefix: str, plan: dict) -> None:
    """Raises where a `lowprec.store_state` around eco stores this state's
    first moment other than stochastically; `plan` is the store's `{state
    path: StateFormat}`, `prefix` this state's path in it.

    The store rounds the moment after eco's fold, and the fold with it:
    stochastic rounding keeps the fold in expectation, while nearest (or
    dead-zone, nearest wherever the moment moves) rounding drops every
    fold below half the moment's gap, and with an 8- or 4-bit moment
    nearly all of them: eco would be a nearest write-back, silently.

    Raises:
      ValueError: naming the leaf, its spec and the stochastic spec.
    """
    pre = f"{prefix}/inner/" if prefix else "inner/"
    for name, sf in plan.items():
      parts = name[len(pre) :].split("/") if name.startswith(pre) else []
      moment = [c for c in parts if c in FIRST_MOMENTS]
      if moment and sf.rounding != "stochastic":
        fix = str(sf).replace(f":{sf.rounding}", ":stochastic", 1)
        raise ValueError(
          "lowprec.eco folds the rounding error into the first moment, and "
          f"store_state stores {name!r} as '{sf}', whose {sf.rounding} "
          "rounding drops every fold below half the moment's gap (eco "
          "would degrade to nearest write-back): store it with stochastic "
          f"rounding, e.g. the rule {{{moment[0]!r}: {fix!r}}}, "
          "or leave it float32 (a rule for the second moment only)"
        )


def eco(
  inner: optax.GradientTransformation,
  fmt,
  rounding: str = "nearest",
  *,
  key: jax.Array | None = None,
  overflow: str = "saturate",
  telemetry: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Runs `inner`, writes its update onto the grid, folds the error into
  its first moment.

  Per parameter `W^` on its format's grid, with gradient `g` (all in
  float32; `inner` runs on float32 views of params and gradients):

    u, m'  = inner(g, m)             # update and new first moment
    W~     = fl(W^ + u)              # the float32 sum, as a master holds it
    W^'    = Q(W~)                   # nearest or stochastic, onto the grid
    e      = W~ - W^'                # exact (see below)
    m''    = m' + e (1 - r) / D      # the fold; r = dm'/dm, D = du/dm

  and the emitted delta `W^' - W^` lands exactly through
  `optax.apply_updates` (`lowprec.apply_updates` for float8 storage).
  `r` and `D` are the derivatives of the inner's new first moment and of
  its update with respect to the first moment it read. Where `inner` is
  built of optax transforms eco knows (`scale_by_adam` or `trace` for the
  moment, as `optax.adam`, `optax.adamw`, `optax.nadam`, `optax.sgd` with
  momentum or Nesterov and `optax.rmsprop` with momentum build it, in
  `optax.chain`s with any transforms before the moment, and `scale`,
  schedules and weight decay after it), they are read off it in closed
  form, its hyperparameters and this step's learning rate and second
  moment (`lowprec.optim.eco_fold`), and the fold is one or two products
  per element. Otherwise (`optax.inject_hyperparams`, other wrappers,
  optimizers of your own) they are taken at this step by forward-mode
  differentiation (`jax.jvp`, one pass with the update). The two agree to
  float32 rounding; telemetry's `fold` names the path. A unit left in
  `m'` decays by `r` a step and is emitted as `D`, so the fold's later
  updates sum to `e` while `r` and `D` stay as they are:

  * heavy-ball (`optax.sgd(eta, momentum=beta)`, `optax.trace`): `r =
    beta`, `D = -eta beta`, fold `-e / c` with `c = eta beta / (1 -
    beta)`: the virtual iterate `Z = W - c m` moves by gradients only,
    `Z' = Z - eta g / (1 - beta)`, whatever the rounding did;
  * Adam (`optax.adam`, `optax.adamw`): `r = b1`, `D = -d b1` with the
    per-coordinate step `d = lr / ((1 - b1^t)(sqrt(nhat) + eps))`, fold
    `-e (1 - b1) / (d b1)`: `Z = W - d b1 m / (1 - b1)` is kept for
    constant `d`. AdamW's weight decay does not depend on `m` and is not
    in `D`.

  In the paper's notation (momentum as an average, `M' = beta M + (1 -
  beta) G`, `W' = W - eta M'`) the same `Z` gives the injection `M'' = M'
  + (1/eta)(1 - 1/beta) e`, the paper's rule for momentum SGD: the fold
  here is that rule with `eta` and `beta` read off the optimizer as it
  runs, and for Adam with its bias-corrected per-coordinate step, which
  differs from a step without the correction in the first few dozen
  steps only (docs/eco.md compares them).

  Exactness. `W~ = fl(W^ + u)` is the value a float32 master would hold;
  its own float32 rounding is not carried (as a master does not carry
  it). `e = W~ - W^'` is exact wherever `W^'` is zero (then `e = W~`) or
  within a factor of two of `W~` (Sterbenz): always under nearest
  rounding short of saturation, and under stochastic rounding except
  where it rounds a value below the grid's smallest positive one up to
  it. By jvp, the fold `e (1 - r) / D` and `m' + fold` are two float32
  roundings, each relative to its own result; in closed form the fold is
  `(e k) den` with the scalar `k = (1 - r) / (D den)` (`den = 1` for
  heavy ball, Adam's `sqrt(nhat) + eps` for Adam), two or three
  roundings, and `D` itself rounds differently, so the two paths' folds
  differ by a few float32 roundings (where `k` and `(1 - r) / D` are
  powers of two, as in the golden recipes' `optax.sgd(2^-10, 0.5)`, not
  at all).

  Coordinates whose `u` or `W^` is not finite keep their weight and fold
  nothing (`nonfinite`); neither does a coordinate with `D == 0` (an
  update that does not depend on the first moment, such as Lion's sign).
  The fold assumes an update elementwise in the first moment (each `u_i`
  depends on `m_i` only), true of the optimizers above and of chains that
  scale them elementwise; a transform that mixes coordinates after the
  momentum (a global-norm clip of the update, Muon's orthogonalization) is
  not checked for.

  Telemetry, read with `lowprec.telemetry`: `fold` ("closed" or "jvp":
  how `r` and `D` are taken), `proposals`, `erased`, `moved`,
  `saturated`, `unreachable`, `nonfinite`, `erased_fraction` and
  `carried` (the float32 sum of `|e|` folded this step), in total and per
  parameter path (`EcoState.report`).

  Args:
    inner: the optimizer, an optax transform that keeps a first moment
      per parameter under a state node named `mu` or `trace`
      (`optax.adam`, `optax.adamw`, `optax.sgd(lr, momentum=...)`,
      `optax.trace`, `optax.rmsprop(lr, momentum=...)`, chains and
      `optax.inject_hyperparams` of them); extra update arguments are
      passed to it.
    fmt: the weights' format specification, as in `lowprec.writeback`
      (a name, a `Format`, a pytree, or `(regex, format)` rules; None
      leaves a parameter alone: its update passes through and its moment
      is not folded). An MX scaled format takes block scales recomputed
      from `W~`; NVFP4 and per-tensor scaled formats are refused as
      `writeback` refuses them.
    rounding: "nearest" or "stochastic" (32 counter-based random bits per
      element, from the key split each step and folded per parameter path
      as `writeback` does, so sharded runs draw the same bits).
    key: a JAX PRNG key, required by "stochastic"; kept in the state and
      split every update (`lowprec.reseed` gives each member of a `vmap`
      ensemble its own).
    overflow: "saturate" (default) or "ieee", as in `writeback`.
    telemetry: keep the counts in the state.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is an
      `EcoState` and whose `update` needs `params` (float32 holding grid
      values, or the format's native dtype); it returns float32 deltas.

  Raises:
    TypeError: `inner` is not an optax transform (e.g. `optax.adam`, the
      function, rather than `optax.adam(1e-3)`).
    ValueError: an unknown rounding (also "deadzone") or overflow mode;
      "stochastic" without `key`; at `init`, an inner state with no first
      moment (or more than one) for a parameter that has a format
      (`optax.sgd(lr)` without momentum, `optax.rmsprop(lr)`), a first
      moment that keeps nothing from one step to the next (`optax.sgd(lr,
      momentum=0.0)`, Adam with `b1=0`), an update that is not finite (a
      NaN or infinite learning rate), and every refusal of `writeback`'s
      (params off their grid, an NVFP4 format); at `update`, missing
      `params`, and `writeback`'s checks of the updates. Each names the
      fix.

  Warns:
    UserWarning: at `init`, where the inner's update does not depend on
      its first moment (Lion's `sign(...)`): eco is then exactly a
      nearest (or stochastic) write-back and folds nothing. These checks
      of `init` run the inner optimizer once on a stand-in of the params
      (one element per parameter, value 1, gradient 1), so they cost next
      to nothing and also run on abstract params (`jax.eval_shape`); an
      optimizer that cannot update without extra arguments is not
      checked.

  Example:
    ```python
    params = lowprec.to_grid(params, "bfloat16", storage="native")
    tx = lowprec.eco(optax.adamw(1e-3), "bfloat16")
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = lowprec.apply_updates(params, updates)  # still bfloat16
    lowprec.telemetry(state)["carried"]
    ```

  Reference: Nikdan, Zandieh, Alistarh, Mirrokni, "ECO: Quantized
  Training without Full-Precision Master Weights" (2026),
  arXiv:2601.22101.
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    called = "; call the factory first" if callable(inner) else ""
    raise TypeError(
      "eco wraps an optax optimizer (an object with init and update, such "
      f"as optax.adam(1e-3)), got {type(inner).__name__} {inner!r:.60}"
      f"{called}: lowprec.eco(optax.adam(1e-3), 'bfloat16')"
    )
  if rounding == "deadzone":
    raise ValueError(
      "eco takes rounding 'nearest' or 'stochastic', not 'deadzone': "
      "dead-zone rounding moves weights that nearest rounding would "
      "freeze, and eco already carries what nearest rounding drops in "
      "the momentum. Use lowprec.eco(inner, fmt, 'nearest') or "
      "'stochastic' with key=jax.random.key(0)"
    )
  choices.check_choice("rounding", rounding, ECO_ROUNDINGS)
  choices.check_choice("overflow mode", overflow, OVERFLOW_MODES)
  lookup = format_lookup(fmt)
  random = rounding != "nearest"
  key_state = None
  if random:
    key_state = rng_lib.state_key(key, f"eco(rounding={rounding!r})")
  inner = optax.with_extra_args_support(inner)
  form = eco_fold.read(inner)  # None: r and D by jax.jvp
  leaf = _Leaf(
    leafwise.Plain(rounding, overflow, "keep", telemetry, "recompute")
  )

  def init_fn(params):
    weights = leafwise.weights(lookup, params, fmt)
    inner_state = inner.init(float32_view(params))
    _refuse_stored(inner_state)
    _first_moments(inner_state, weights)  # raises where one is missing
    _probe(inner, lookup, params)
    zeros = {n: jnp.zeros([], jnp.int32) for n in weights}
    counts = dict.fromkeys(_COUNTS + _MASSES)
    if telemetry:
      counts = dict.fromkeys(_COUNTS, zeros)
      counts["carried"] = {n: jnp.zeros([], jnp.float32) for n in weights}
    return EcoState(
      count=jnp.zeros([], jnp.int32),
      key=key_state[0] if random else None,
      inner=inner_state,
      **counts,
      fold=_fold_code(form) if telemetry else None,
    )

  def update_fn(updates, state, params=None, **extra):
    if params is None:
      raise ValueError(
        "eco rounds W^ + u onto the weights' grid and needs the current "
        "params: call opt.update(updates, state, params)"
      )
    g = float32_view(updates)
    if form is None:
      u, new_inner, d_u, d_inner, moments = _run_inner(
        inner, lookup, g, state.inner, params, extra
      )
      fold_of = _by_jvp(d_u, d_inner)
    else:
      u, new_inner, moments = _run_plain(
        inner, lookup, g, state.inner, params, extra
      )
      co = eco_fold.coefficients(form, state.inner, new_inner)
      fold_of = _closed(co)
    u = jax.tree.map(as_emitted, u)
    ks = (state.key, key_state[1]) if random else None
    deltas, new_key, kept = leafwise.step("eco", lookup, u, params, ks, leaf)
    new_inner, carried = _fold(new_inner, moments, kept, fold_of)
    per = {n: k[1:] for n, k in kept.items()}
    counts = counting.by_field(per, _COUNTS, telemetry)
    counts["carried"] = carried if telemetry else None
    new_state = EcoState(
      count=optax.safe_increment(state.count),
      key=new_key,
      inner=new_inner,
      **counts,
      fold=_fold_code(form) if telemetry else None,
    )
    return deltas, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Leaf(NamedTuple):
  """The plain write-back of one tensor and its error `e = W~ - W^'`."""

  plain: leafwise.Plain

  def __call__(self, path, w, u, fmt, bits):
    """`(delta, (e, *counts))`: `e` where it is folded (0 where the weight
    was not written or `e` is not finite), then `_COUNTS` with
    telemetry."""
    delta, counts = self.plain(path, w, u, fmt, bits)
    # What apply_updates writes is w + delta: q, or its neighbour.
    e = (w + u) - (w + delta)
    e = jnp.where(jnp.isfinite(e), e, jnp.float32(0))
    return delta, (e, *counts[: len(_COUNTS)])


def _moment_name(key) -> str | None:
  for attr in ("name", "key"):
    v = getattr(key, attr, None)
    if isinstance(v, str):
      return v
  return None


def _refuse_stored(state) -> None:
  """Raises for an inner state that `lowprec.store_state` keeps on a grid:
  the fold would be added to stored codes and rounded away (or, on a code
  map, fail). The store goes outside: it then stores the folded moment."""
  nodes = jax.tree_util.tree_leaves(
    state, is_leaf=lambda x: isinstance(x, StoredState)
  )
  if any(isinstance(x, StoredState) for x in nodes):
    raise ValueError(
      "eco wraps an optimizer whose state lowprec.store_state keeps on a "
      "grid: the fold would be added to the stored moment and rounded "
      "away. Store the state outside eco instead, with stochastic "
      "rounding for the first moment: lowprec.store_state(lowprec.eco("
      "optax.adamw(lr), fmt), {'mu': 'bfloat16:stochastic', ...}, key=...)"
    )


def _probe(inner, lookup, params) -> None:
  """The checks of `init` that need the inner's arithmetic (see `eco`'s
  Raises and Warns), on a stand-in of `params`: every array leaf as a
  float32 array of ones of its rank with one element, gradients of ones.
  `r` and `D` come from `_run_inner`, as at each update."""

  def one(x):
    return jnp.ones((1,) * jnp.ndim(x), jnp.float32) if is_array(x) else x

  with jax.ensure_compile_time_eval():
    try:
      ones = jax.tree.map(one, params)
      state = inner.init(ones)
      u, _, du, dnew, moments = _run_inner(inner, lookup, ones, state, ones, {})
      rates = [np.asarray(r) for r in jax.tree_util.tree_leaves(dnew)]
      slopes, updates = (
        {
          path_name(p): np.asarray(x, np.float32)
          for p, x in jax.tree_util.tree_flatten_with_path(t)[0]
          if x is not None
        }
        for t in (du, u)
      )
    except Exception:  # an optimizer the stand-in cannot run: unchecked
      return
  blind = []
  for name, i in moments.items():
    r, d, v = rates[i], slopes[name], updates[name]
    if not np.all(np.isfinite(v)):
      raise ValueError(
        f"eco: the optimizer's update of parameter {name!r} is "
        f"{v[~np.isfinite(v)].flat[0]} "
        "for a gradient of 1: it is not finite, so no weight would ever "
        "move. Check its learning rate (a NaN or infinite value, or a "
        "schedule giving one), e.g. lowprec.eco(optax.adamw(1e-3), fmt)"
      )
    if np.all(r == 0):
      raise ValueError(
        "eco folds the write-back's rounding error into the optimizer's "
        f"first moment, and the moment of parameter {name!r} keeps "
        "nothing from one step to the next (its decay rate is 0: "
        "optax.sgd(lr, momentum=0.0), optax.trace(decay=0.0), Adam with "
        "b1=0), so every fold would be dropped. Give the optimizer "
        "momentum, e.g. lowprec.eco(optax.sgd(lr, momentum=0.9), fmt) or "
        "lowprec.eco(optax.adamw(lr), fmt); or use lowprec.writeback(fmt) "
        "for a plain write-back"
      )
    if np.all(d == 0) and np.any(v != 0):
      blind.append(name)
  if blind:
    more = f" and {len(blind) - 1} more" if len(blind) > 1 else ""
    warnings.warn(
      f"eco: the optimizer's update of parameter {blind[0]!r}{more} does "
      "not depend on its first moment (as Lion's sign(...) update does): "
      "no fold can reach the weights, so eco writes back exactly as "
      "lowprec.writeback(fmt, rounding) does and `carried` stays 0. Use a "
      "momentum optimizer whose update grows with the moment "
      "(optax.adamw, optax.sgd with momentum), or lowprec.writeback",
      stacklevel=4,
    )


def _first_moments(state, weights) -> dict[str, int]:
  """`{parameter name: index of its first-moment leaf}` among the leaves
  of `state`, for every weight of `weights` (`leafwise.weights`). The
  leaf is the one at `<...>/mu/<parameter path>` or `trace/...`.

  Raises:
    ValueError: a weight has no such leaf, or more than one.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  found: dict[str, list[int]] = {n: [] for n in weights}
  by_path = {tuple(p): n for n, (p, _, _) in weights.items()}
  for i, (kp, _) in enumerate(flat):
    for j, k in enumerate(kp):
      if _moment_name(k) in FIRST_MOMENTS and tuple(kp[j + 1 :]) in by_path:
        found[by_path[tuple(kp[j + 1 :])]].append(i)
  for name, at in found.items():
    if len(at) == 1:
      continue
    if not at:
      raise ValueError(
        "eco folds the write-back's rounding error into the optimizer's "
        f"first moment, and the inner state keeps none for parameter "
        f"{name!r}: no leaf under a state node named "
        f"{' or '.join(map(repr, FIRST_MOMENTS))} mirrors it (optax.sgd "
        "without momentum, optax.rmsprop and optax.adagrad keep none). "
        "Give the optimizer momentum, e.g. lowprec.eco(optax.sgd(lr, "
        "momentum=0.9), fmt), lowprec.eco(optax.adamw(lr), fmt) or "
        "optax.rmsprop(lr, momentum=0.9); or leave the parameter off the "
        "grid with a None format"
      )
    paths = [path_name(flat[i][0]) for i in at]
    raise ValueError(
      f"eco: the inner state keeps {len(at)} first moments for parameter "
      f"{name!r} ({', '.join(paths)}), and the fold needs exactly one: "
      "wrap a single momentum optimizer, and chain the others outside eco"
    )
  return {n: at[0] for n, at in found.items()}


def _weights_of(lookup, params) -> dict:
  """`{name: (path, format, weight)}` of the params that have a format."""
  weights = {}
  for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
    f = leafwise.weight_format(lookup, path, w)
    if f is not None:
      weights[path_name(path)] = (path, f, w)
  return weights


def _run_inner(inner, lookup, g, state, params, extra):
  """`inner.update` on float32 views, with the derivatives of its update
  and new state with respect to the first moments it reads: `(u, new
  state, du, d new state, {name: moment leaf index})`."""
  moments = _first_moments(state, _weights_of(lookup, params))
  leaves, treedef = jax.tree_util.tree_flatten(state)
  at = sorted(set(moments.values()))
  p32 = float32_view(params)

  def run(ms):
    full = list(leaves)
    for i, m in zip(at, ms, strict=True):
      full[i] = m
    return inner.update(
      g, jax.tree_util.tree_unflatten(treedef, full), p32, **extra
    )

  primal = [jnp.asarray(leaves[i]) for i in at]
  ones = [jnp.ones_like(m) for m in primal]
  (u, new), (du, dnew) = jax.jvp(run, (primal,), (ones,))
  return u, new, du, dnew, moments


def _run_plain(inner, lookup, g, state, params, extra):
  """`inner.update` on float32 views: `(u, new state, {name: moment leaf
  index})`."""
  moments = _first_moments(state, _weights_of(lookup, params))
  u, new = inner.update(g, state, float32_view(params), **extra)
  return u, new, moments


def _by_jvp(du, dnew):
  """The fold `e (1 - r) / D` of parameter `name` (moment leaf `i`), with
  `r` and `D` the tangents `jax.jvp` gave, and where it applies."""
  rates = jax.tree_util.tree_leaves(dnew)
  slopes = {
    path_name(p): x
    for p, x in jax.tree_util.tree_flatten_with_path(du)[0]
    if x is not None
  }

  def fold_of(name, i, e):
    r, d = _f32(rates[i]), _f32(slopes[name])
    ok = (e != 0) & (d != 0) & jnp.isfinite(d) & jnp.isfinite(r)
    return (e * (1 - r)) / jnp.where(ok, d, jnp.float32(1)), ok

  return fold_of


def _closed(co: eco_fold.Coefficients):
  """The fold `(e k) den`, `k = (1 - r) / slope`, from the closed form's
  coefficients (`D = slope / den`; `den = 1` for heavy ball), and where
  it applies: where the jvp's `D` would be finite and nonzero."""
  k = (1 - co.rate) / co.slope
  scalars = (co.slope != 0) & jnp.isfinite(co.slope) & jnp.isfinite(co.rate)

  def fold_of(name, i, e):
    del i
    ok = (e != 0) & scalars
    if co.den is None:
      return e * k, ok
    den = co.den[name]
    return (e * k) * den, ok & (den != 0) & jnp.isfinite(den)

  return fold_of


def _fold(new, moments, kept, fold_of):
  """The new inner state with each weight's fold (`fold_of`) added to its
  first moment, and `{name: float32 sum |e| folded}`."""
  leaves, treedef = jax.tree_util.tree_flatten(new)
  carried = {}
  for name, k in kept.items():
    i = moments[name]
    m, e = leaves[i], k[0]
    fold, ok = fold_of(name, i, e)
    fold = jnp.where(ok, fold, jnp.float32(0))
    leaves[i] = (_f32(m) + fold).astype(jnp.result_type(m))
    carried[name] = mass(jnp.where(ok, e, jnp.float32(0)))
  return jax.tree_util.tree_unflatten(treedef, leaves), carried


def _fold_code(form) -> jax.Array:
  code = _FOLDS.index("jvp" if form is None else "closed")
  return jnp.asarray(code, jnp.int32)


def _with_fold(out: dict, fold) -> dict:
  """`out` (a report) with `fold` after `steps`; as it is where the state
  keeps no fold (a view of a state saved without one)."""
  if fold is None:
    return out
  first, *rest = out.items()
  return dict([first, ("fold", fold), *rest])


def _f32(x):
  return jnp.asarray(x).astype(jnp.float32)


__all__ = ["ECO_ROUNDINGS", "FIRST_MOMENTS", "EcoState", "eco"]

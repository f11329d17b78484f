"""Predicting state erasures from a float32 reference run.

`lowprec.store_state` keeps optimizer state leaves on a low-precision grid;
an update of a stored leaf is *erased* when the float32 update changed the
value but the stored value stayed where it was. As for weights (see
`reference_trace`), a float32 reference run predicts it: at each step put
the reference state `s` on the target grid, `q = Q_RN(s)`, add the
reference update `d = s' - s`, and round again:

  nearest:     erased  <=>  d != 0  and  Q_RN(q + d) == q,
  stochastic:  P(erased) = P(SR(q + d) == q), the share of the gap at q
               that q + d did not cross (1 where d does not change q + d).

Scaled targets round `x / scale(x)` with the same rule as the storage,
and code maps (`lowprec.codemaps`) encode with the store's own codec, so
under nearest rounding the prediction of one step is exact.
`state_erasure` takes the float32 states before and after one step;
`state_trace` wraps an optimizer and evaluates it at every update of a
float32 run, for several targets; `state_at_init` takes a whole sequence
of states, and predicts which coordinates stay at their initial stored
value (a second moment that never leaves 0, say).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import rules as rules_lib
from lowprec.engine.codec import encode
from lowprec.engine.weights import path_name
from lowprec.optim import stored_state as ss


def _stored(x, sf: ss.StateFormat, bits=None):
  """`Q(x / scale) * scale` with the storage's scale, in float32, and the
  stored code (as float32 numbers)."""
  rounding = "nearest" if bits is None else "stochastic"
  codec = dataclasses.replace(sf.codec(), rounding=rounding)
  enc = encode(codec, x, bits=bits)
  return enc.value, enc.code.astype(jnp.float32)


def _grid(x, sf: ss.StateFormat, bits=None):
  """`Q(x / scale) * scale` with the storage's scale, in float32."""
  return _stored(x, sf, bits)[0]


def _leaves(tree) -> dict[str, jax.Array]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_name(p): x for p, x in flat}


def _plan(rules, state) -> dict[str, ss.StateFormat]:
  plan = rules_lib.plan(ss.parse_rules(rules), state, check=True)
  ss.check_moments(plan)
  return plan


def _stay_probabilities(q, code, x, sf: ss.StateFormat):
  """Per element, the probabilities that storing `x` gives back the value
  `q` (erased) and the code `code` (stalled)."""
  rn, rn_code = _stored(x, sf)
  if sf.rounding == "nearest":
    return (rn == q).astype(jnp.float32), (rn_code == code).astype(jnp.float32)
  # Bits of all ones never round up, zero bits always do (off the grid).
  lo, lo_code = _stored(x, sf, jnp.full(x.shape, 0xFFFFFFFF, jnp.uint32))
  hi, hi_code = _stored(x, sf, jnp.zeros(x.shape, jnp.uint32))
  width = jnp.abs(hi - lo)
  up = jnp.where(width > 0, jnp.abs(x - lo) / jnp.maximum(width, 1e-38), 0.0)
  two = hi != lo

  def stay(at_lo, at_hi):
    return jnp.where(at_lo, 1.0 - up, 0.0) + jnp.where(at_hi & two, up, 0.0)

  p = stay(lo == q, hi == q)
  p_code = stay(lo_code == code, hi_code == code)
  if sf.rounding == "deadzone":  # stochastic only where nearest gives q
    p_code = jnp.where(rn == q, p_code, (rn_code == code).astype(jnp.float32))
    p = jnp.where(rn == q, p, 0.0)
  return p, p_code


def state_erasure(before, after, rules) -> dict[str, dict[str, jax.Array]]:
  """Predicted erasures of one step's state updates, per stored leaf.

  For every leaf that `rules` (as in `lowprec.store_state`) stores, with
  `s` and `s'` its float32 reference values before and after the step,
  `q` the target-grid value of `s` and `d = s' - s`:

    changed  = #(finite s' and d != 0),
    erased   = sum over changed coordinates of P(Q(q + d) == q),
    stalled  = sum over changed coordinates of P(code(q + d) == code(q))

  (counts under nearest rounding, expected counts under stochastic or
  dead-zone rounding), `erased_fraction = erased / changed` and
  `stalled_fraction = stalled / changed` (NaN without changes). `code` is
  what the store keeps for a coordinate (the grid value under its scale,
  or a code map's code): under a scale that moves with the block's
  largest value (`amax`, code maps) a coordinate whose code stays has
  stalled although its stored value moved with the scale, as
  `store_state`'s measured `stalled` counts it; without a scale the two
  counts are the same. Jit-able; the inputs are the inner transform's
  states, e.g. `state` and `new_state` of `optax.adam(...).update`.

  Args:
    before: the float32 inner state before the step.
    after: the float32 inner state after it.
    rules: the rules `lowprec.store_state` would be given.

  Returns:
    `{state path: {"changed": int32, "erased": float32,
      "erased_fraction": float32, "stalled": float32,
      "stalled_fraction": float32}}` as arrays.

  Raises:
    ValueError: as `store_state`'s `init` for bad rules.

  Example:
    ```python
    tx = optax.scale_by_adam(b2=0.999)
    s0 = tx.init(params)
    _, s1 = tx.update(grads, s0, params)
    lowprec.freeze.state_erasure(s0, s1, {"nu": "bfloat16"})["nu/w"]
    ```
  """
  plan = _plan(rules, before)
  old, new = _leaves(before), _leaves(after)
  out = {}
  for name, sf in plan.items():
    s0 = jnp.asarray(old[name], jnp.float32)
    s1 = jnp.asarray(new[name], jnp.float32)
    q, code = _stored(s0, sf)
    changed = jnp.isfinite(s1) & (s1 != s0)
    p, p_code = _stay_probabilities(q, code, q + (s1 - s0), sf)
    n = jnp.sum(changed, dtype=jnp.int32)
    erased = jnp.sum(jnp.where(changed, p, 0.0))
    stalled = jnp.sum(jnp.where(changed, p_code, 0.0))
    out[name] = {
      "changed": n,
      "erased": erased,
      "erased_fraction": _fraction(erased, n),
      "stalled": stalled,
      "stalled_fraction": _fraction(stalled, n),
    }
  return out


def state_at_init(states, rules) -> dict[str, jax.Array]:
  """Coordinates predicted to stay at their initial stored value.

  From the float32 reference states `s_0` (as `init` returns it), `s_1`,
  ..., `s_T`: with `q0` the initial state on the target grid, coordinate
  `i` of a leaf that a nearest rule stores is predicted still at `q0` when
  every reference update alone would be erased there,
  `Q_RN(q0 + (s_t - s_{t-1})) == q0` for all `t`: Adam's second moment
  stays 0 where `(1 - b2) g^2` is below half the smallest value of the
  format. Compare with the stored state of the low-precision run.

  Args:
    states: the reference inner states stacked along a leading axis of
      steps, the initial state first (a `lax.scan` of the updates gives
      the rest). Jit-able.
    rules: the rules `lowprec.store_state` would be given; leaves with a
      stochastic or dead-zone rule are left out (no persistent freeze).

  Returns:
    `{state path: bool array shaped like the leaf}`.

  Example:
    ```python
    still = lowprec.freeze.state_at_init(stacked, {"nu": "float8_e5m2"})
    float(still["0/nu/w"].mean())  # share whose nu stays at 0
    ```
  """
  first = jax.tree.map(lambda a: a[0], states)
  plan = _plan(rules, first)
  plan = {n: sf for n, sf in plan.items() if sf.rounding == "nearest"}
  seq = _leaves(states)
  seq = {n: jnp.asarray(seq[n], jnp.float32) for n in plan}
  q0 = {n: _grid(seq[n][0], sf) for n, sf in plan.items()}

  def step(still, t):
    out = {}
    for n, sf in plan.items():
      d = seq[n][t] - seq[n][t - 1]
      out[n] = still[n] & (_grid(q0[n] + d, sf) == q0[n])
    return out, None

  start = {n: jnp.ones(jnp.shape(q), bool) for n, q in q0.items()}
  steps = jnp.shape(next(iter(seq.values())))[0] if seq else 1
  return jax.lax.scan(step, start, jnp.arange(1, steps))[0]


class StateTraceState(NamedTuple):
  """State of `state_trace`: the inner state (float32) and the predicted
  erasures of its last update, per target and state path."""

  inner: Any  # the inner transform's state, as it would be without a trace
  count: jax.Array  # int32 []: updates so far
  changed: dict[str, dict[str, jax.Array]]  # int32 []: finite s' != s
  erased: dict[str, dict[str, jax.Array]]  # float32 []: expected erasures
  stalled: dict[str, dict[str, jax.Array]]  # float32 []: expected stalls

  def arrays(self) -> dict[str, jax.Array]:
    """`report()`'s keys as arrays (under jit, scan and vmap)."""
    return self._collect(self, jnp, _fraction)

  def report(self) -> dict[str, int | float]:
    """The predictions as plain numbers, prefixed `pred_state/<target>/`.

    Per target: `changed` (finite float32 updates that changed a state
    value), `erased` (the expected number of them a store would erase:
    a count under nearest rounding), `erased_fraction` (erased / changed,
    NaN without changes), `stalled` and `stalled_fraction` (the same for
    the stored code, see `state_erasure`), and each per state path
    (`.../erased/<path>`). Named like `lowprec.store_state`'s measured
    `state/...` keys.
    """
    host = jax.device_get(self._replace(inner=None))
    return {
      k: _host(v) for k, v in self._collect(host, np, _fraction_np).items()
    }

  @staticmethod
  def _collect(st, xp, fraction) -> dict[str, Any]:
    out = {}
    for t, changed in st.changed.items():
      pre = f"pred_state/{t}"
      total_c = sum((xp.asarray(v) for v in changed.values()), xp.asarray(0))
      out[f"{pre}/changed"] = total_c
      expected = {"erased": st.erased[t], "stalled": st.stalled[t]}
      for word, per in expected.items():
        total = sum(
          (xp.asarray(v, xp.float32) for v in per.values()),
          xp.asarray(0.0, xp.float32),
        )
        out[f"{pre}/{word}"] = total
        out[f"{pre}/{word}_fraction"] = fraction(total, total_c)
      for n in changed:
        out[f"{pre}/changed/{n}"] = xp.asarray(changed[n])
        for word, per in expected.items():
          out[f"{pre}/{word}/{n}"] = xp.asarray(per[n])
          out[f"{pre}/{word}_fraction/{n}"] = fraction(per[n], changed[n])
    return out


def _fraction(num, den):
  den = jnp.asarray(den)
  return jnp.where(den > 0, num / jnp.maximum(den, 1), jnp.nan)


def _fraction_np(num, den):
  return float(num) / int(den) if int(den) else float("nan")


def _host(a):
  a = np.asarray(a)
  return float(a) if np.issubdtype(a.dtype, np.floating) else int(a)


def state_trace(
  inner: optax.GradientTransformation, targets
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` in a float32 run and predicts its stored-state erasures.

  The float32 reference of `lowprec.store_state`: `inner` runs unchanged
  (its state stays float32, its updates pass through), and every update
  evaluates `state_erasure(s, s', rules)` for each target, the erasures
  that storing the state with those rules would cause at this point of the
  float32 trajectory. One run predicts several stores:

    tx = lowprec.freeze.state_trace(optax.adamw(1e-3), {
        "rn_bf16": {"mu": "bfloat16", "nu": "bfloat16"},
        "sr_bf16": {"mu": "bfloat16:stochastic", "nu": "bfloat16:stochastic"},
    })
    ...
    lowprec.telemetry(state)["pred_state/rn_bf16/erased_fraction/0/nu/w"]

  Compare with the measured `state/erased_fraction/<path>` of the run that
  stores the state (`lowprec.store_state(inner, rules)`): the same paths
  and definitions. The prediction holds while the stored run's trajectory
  stays near the float32 one.

  Args:
    inner: the optimizer whose state would be stored.
    targets: `{name: rules}`, rules as `lowprec.store_state` takes them.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
      `StateTraceState` (the inner state in its field `inner`).

  Raises:
    ValueError: no targets, or (at `init`) a target's rules as
      `store_state` would refuse them.
  """
  if not targets:
    raise ValueError(
      "state_trace needs targets: {name: rules}, e.g. "
      "{'rn_bf16': {'mu': 'bfloat16', 'nu': 'bfloat16'}}"
    )
  targets = dict(targets)
  inner = optax.with_extra_args_support(inner)

  def zeros(state):
    out_c, out_e = {}, {}
    for t, rules in targets.items():
      try:
        plan = _plan(rules, state)
      except ValueError as e:
        raise ValueError(f"state_trace target {t!r}: {e}") from None
      out_c[t] = {n: jnp.zeros([], jnp.int32) for n in plan}
      out_e[t] = {n: jnp.zeros([], jnp.float32) for n in plan}
    return out_c, out_e

  def init_fn(params):
    state = inner.init(params)
    changed, erased = zeros(state)
    count = jnp.zeros([], jnp.int32)
    return StateTraceState(state, count, changed, erased, erased)

  def update_fn(updates, state, params=None, **extra):
    updates, new = inner.update(updates, state.inner, params, **extra)
    pred = {t: state_erasure(state.inner, new, r) for t, r in targets.items()}

    def field(word):
      return {t: {n: v[word] for n, v in p.items()} for t, p in pred.items()}

    count = optax.safe_increment(state.count)
    return updates, StateTraceState(
      new, count, field("changed"), field("erased"), field("stalled")
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

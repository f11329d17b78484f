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

Scaled targets round `x / scale(x)` with the same rule as the storage.
`state_erasure` takes the float32 states before and after one step;
`state_at_init` a whole sequence of them, and predicts which coordinates
stay at their initial stored value (a second moment that never leaves 0,
say).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowprec import state_storage as ss
from lowprec.rounding import round_and_flag
from lowprec.storage import path_name


def _grid(x, sf: ss.StateFormat, bits=None):
  """`Q(x / scale) * scale` with the storage's scale, in float32."""
  x = jnp.asarray(x, jnp.float32)
  if sf.scale is None:
    return round_and_flag(x, sf.fmt, bits)[0]
  per = ss._spread(ss._scale(x, sf.fmt, sf.scale), x.shape, sf.scale)
  return round_and_flag(x / per, sf.fmt, bits)[0] * per


def _leaves(tree) -> dict[str, jax.Array]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_name(p): x for p, x in flat}


def _plan(rules, state) -> dict[str, ss.StateFormat]:
  return ss._plan(ss._parse_rules(rules), state, check=True)


def _erased_probability(q, x, sf: ss.StateFormat):
  """Per element, the probability that storing `x` gives back `q`."""
  rn = _grid(x, sf)
  if sf.rounding == "nearest":
    return (rn == q).astype(jnp.float32)
  # Bits of all ones never round up, zero bits always do (off the grid).
  lo = _grid(x, sf, jnp.full(x.shape, 0xFFFFFFFF, jnp.uint32))
  hi = _grid(x, sf, jnp.zeros(x.shape, jnp.uint32))
  width = jnp.abs(hi - lo)
  up = jnp.where(width > 0, jnp.abs(x - lo) / jnp.maximum(width, 1e-38), 0.0)
  p = jnp.where(lo == q, 1.0 - up, 0.0) + jnp.where(
    (hi == q) & (hi != lo), up, 0.0
  )
  if sf.rounding == "deadzone":
    p = jnp.where(rn == q, p, 0.0)
  return p


def state_erasure(before, after, rules) -> dict[str, dict[str, jax.Array]]:
  """Predicted erasures of one step's state updates, per stored leaf.

  For every leaf that `rules` (as in `lowprec.store_state`) stores, with
  `s` and `s'` its float32 reference values before and after the step,
  `q` the target-grid value of `s` and `d = s' - s`:

    changed  = #(finite s' and d != 0),
    erased   = sum over changed coordinates of P(Q(q + d) == q)

  (a count under nearest rounding, an expected count under stochastic or
  dead-zone rounding), and `erased_fraction = erased / changed` (NaN
  without changes). Jit-able; the inputs are the inner transform's
  states, e.g. `state` and `new_state` of `optax.adam(...).update`.

  Args:
    before: the float32 inner state before the step.
    after: the float32 inner state after it.
    rules: the rules `lowprec.store_state` would be given.

  Returns:
    `{state path: {"changed": int32, "erased": float32,
    "erased_fraction": float32}}` as arrays.

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
    q = _grid(s0, sf)
    changed = jnp.isfinite(s1) & (s1 != s0)
    p = _erased_probability(q, q + (s1 - s0), sf)
    n = jnp.sum(changed, dtype=jnp.int32)
    erased = jnp.sum(jnp.where(changed, p, 0.0))
    frac = jnp.where(n > 0, erased / jnp.maximum(n, 1), jnp.nan)
    out[name] = {"changed": n, "erased": erased, "erased_fraction": frac}
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

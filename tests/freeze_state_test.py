"""Predicted state erasures from a float32 run against the measured ones.

The gradients are a fixed sequence (independent of the params), so the
float32 reference and the low-precision run see the same data; they differ
only where storage rounded the state, which is what is predicted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec

N, STEPS = 2048, 300


def _grads(seed=0, lo=-3.0, hi=0.0):
  """[STEPS, N] gradients: per coordinate a magnitude 10^U(lo, hi) with
  30% noise from step to step."""
  rng = np.random.default_rng(seed)
  c = 10.0 ** rng.uniform(lo, hi, N)
  z = rng.standard_normal((STEPS, N))
  return jnp.asarray(c * (1 + 0.3 * z), jnp.float32)


INNER = optax.scale_by_adam(b1=0.9, b2=0.999)
PARAMS = {"w": jnp.zeros(N)}


@jax.jit
def _reference(gs):
  """The float32 inner states s_0 ... s_T, stacked."""

  def body(state, g):
    state = INNER.update({"w": g}, state, PARAMS)[1]
    return state, state

  s0 = INNER.init(PARAMS)
  _, states = jax.lax.scan(body, s0, gs)
  return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), s0, states)


def _measured(spec, gs):
  tx = lowprec.store_state(INNER, {"nu": spec}, key=jax.random.key(0))

  def body(state, g):
    state = tx.update({"w": g}, state, PARAMS)[1]
    return state, lowprec.telemetry_arrays(state)

  return jax.jit(lambda gs: jax.lax.scan(body, tx.init(PARAMS), gs))(gs)


def _predicted(states, spec):
  def one(t):
    pick = lambda i: jax.tree.map(lambda a: a[i], states)
    got = lowprec.freeze.state_erasure(pick(t), pick(t + 1), {"nu": spec})
    return got["nu/w"]

  return jax.jit(jax.vmap(one))(jnp.arange(STEPS))


@pytest.mark.parametrize(
  "spec",
  ["bfloat16", pytest.param("bfloat16:stochastic", marks=pytest.mark.slow)],
)
def test_predicted_erased_fraction_follows_the_measured_curve(spec):
  """300 steps of Adam's second moment, b2 = 0.999, 2048 coordinates with
  gradient magnitudes over three decades (seed 0). Nearest: the first
  step is predicted exactly (both start at 0), and the curves agree within
  an RMSE of 0.02 (0.003 measured) while the fraction rises from 0 to
  over half of the updates. Stochastic: the mean over the last 200 steps
  agrees within 0.01 (0.001 measured)."""
  gs = _grads()
  pred = _predicted(_reference(gs), spec)
  _, tel = _measured(spec, gs)
  got = np.asarray(tel["state/erased_fraction"], np.float64)
  want = np.asarray(pred["erased_fraction"], np.float64)
  assert got.shape == want.shape == (STEPS,)
  assert got[-1] > 0.5 and got[:5].max() < 0.1  # a real curve
  if spec == "bfloat16":
    assert int(tel["state/erased"][0]) == float(pred["erased"][0])
    assert np.sqrt(np.mean((got - want) ** 2)) < 0.02
  else:
    assert abs(got[100:].mean() - want[100:].mean()) < 0.01


def test_predicted_second_moments_at_zero_are_the_measured_ones():
  """float8_e5m2 without a scale, 300 steps, gradient magnitudes from
  10^-2.5 to 1 (seed 1): (1 - b2) g^2 falls below half the smallest e5m2
  value (2^-17) for the smaller ones, whose stored nu never leaves 0. The
  prediction from the float32 run marks at least 99% of coordinates
  right, with both outcomes common."""
  gs = _grads(seed=1, lo=-2.5, hi=0.0)
  states = _reference(gs)
  rules = {"nu": "float8_e5m2"}
  pred = jax.jit(lambda s: lowprec.freeze.state_at_init(s, rules))(states)
  pred = np.asarray(pred["nu/w"])
  final, _ = _measured("float8_e5m2", gs)
  got = np.asarray(final.inner.nu["w"], np.float32) == 0
  assert 0.1 < got.mean() < 0.9
  assert (pred == got).mean() >= 0.99, (pred == got).mean()
  # The float32 run has no such zeros.
  assert np.all(np.asarray(states.nu["w"][-1]) > 0)


def test_state_erasure_refuses_bad_rules():
  s = INNER.init(PARAMS)
  with pytest.raises(ValueError, match="rule 'nuu' matches no state leaf"):
    lowprec.freeze.state_erasure(s, s, {"nuu": "bfloat16"})


def test_state_trace_predicts_every_step_of_the_float32_run():
  """`state_trace` in a scanned float32 run (seed 0, 300 steps): its
  updates and inner state are the plain inner's bit for bit, its
  predictions per step equal `state_erasure` of the stacked states, for
  two targets at once; the nearest target's curve follows the measured
  one within an RMSE of 0.02, as above."""
  gs = _grads()
  targets = {"rn": {"nu": "bfloat16"}, "sr": {"mu": "bfloat16:stochastic"}}
  tx = lowprec.freeze.state_trace(INNER, targets)

  def body(state, g):
    u, state = tx.update({"w": g}, state, PARAMS)
    return state, (u["w"], lowprec.telemetry_arrays(state))

  final, (us, tel) = jax.jit(
    lambda gs: jax.lax.scan(body, tx.init(PARAMS), gs)
  )(gs)
  states = _reference(gs)
  last = jax.tree.map(lambda a: a[-1], states)
  assert jax.tree.all(jax.tree.map(np.array_equal, final.inner, last))

  def plain(state, g):
    u, state = INNER.update({"w": g}, state, PARAMS)
    return state, u["w"]

  _, plain_us = jax.jit(lambda gs: jax.lax.scan(plain, INNER.init(PARAMS), gs))(
    gs
  )
  np.testing.assert_array_equal(us, plain_us)
  want = _predicted(states, "bfloat16")
  got = tel["pred_state/rn/erased_fraction/nu/w"]
  np.testing.assert_array_equal(got, want["erased_fraction"])
  want_mu = jax.jit(
    jax.vmap(
      lambda t: lowprec.freeze.state_erasure(
        jax.tree.map(lambda a: a[t], states),
        jax.tree.map(lambda a: a[t + 1], states),
        targets["sr"],
      )["mu/w"]["erased"]
    )
  )(jnp.arange(STEPS))
  np.testing.assert_array_equal(tel["pred_state/sr/erased/mu/w"], want_mu)
  _, measured = _measured("bfloat16", gs)
  got = np.asarray(measured["state/erased_fraction"], np.float64)
  pred = np.asarray(tel["pred_state/rn/erased_fraction"], np.float64)
  assert np.sqrt(np.mean((got - pred) ** 2)) < 0.02
  # The host view names the same keys with plain numbers.
  host = lowprec.telemetry(final)
  assert host["pred_state/rn/changed"] == int(tel["pred_state/rn/changed"][-1])


def test_state_trace_refuses_bad_targets():
  with pytest.raises(ValueError, match="needs targets"):
    lowprec.freeze.state_trace(INNER, {})
  tx = lowprec.freeze.state_trace(INNER, {"typo": {"nuu": "bfloat16"}})
  with pytest.raises(ValueError, match="target 'typo'.*'nuu' matches no"):
    tx.init(PARAMS)


# ---- single steps worked out by hand ---------------------------------------

GAP = 2.0**-7  # bfloat16's gap above 1.0 (2^-8 below it)


def test_prediction_adds_the_update_to_the_stored_value():
  """bfloat16, three coordinates. The stored run holds q = Q_RN(s) and
  adds the update to it, so the prediction asks whether q + d rounds back
  to q, not whether s' does:

    s = 1 + 0.4 gap (q = 1), d = 0.2 gap: q + d = 1 + 0.2 gap, erased
      (s' = 1 + 0.6 gap rounds up, but the store never holds s);
    s = 1 + 0.1 gap (q = 1), d = 0.3 gap: q + d = 1 + 0.3 gap, erased;
    s = 1, d = 0.6 gap: q + d rounds up, not erased."""
  s0 = np.float32([1 + 0.4 * GAP, 1 + 0.1 * GAP, 1.0])
  d = np.float32([0.2 * GAP, 0.3 * GAP, 0.6 * GAP])
  before, after = {"s": jnp.asarray(s0)}, {"s": jnp.asarray(s0 + d)}
  got = lowprec.freeze.state_erasure(before, after, {"s": "bfloat16"})["s"]
  assert int(got["changed"]) == 3 and float(got["erased"]) == 2.0
  # The same through state_trace, on an inner whose state is its input.
  tx = lowprec.freeze.state_trace(_holder(), {"rn": {"s": "bfloat16"}})
  state = tx.init(before["s"])
  _, state = tx.update(before["s"], state)
  _, state = tx.update(after["s"], state)
  tel = lowprec.telemetry(state)
  assert tel["pred_state/rn/erased/s"] == 2.0
  assert tel["pred_state/rn/changed/s"] == 3


@pytest.mark.parametrize(
  "spec", ["bfloat16:stochastic", "bfloat16:deadzone"], ids=["sr", "deadzone"]
)
def test_stochastic_erasure_is_the_share_of_the_gap_not_crossed(spec):
  """At q = 1.0 an update of a quarter of the gap in its direction
  reaches the far neighbour with probability 1/4, so it is erased with
  probability 3/4: up by 2^-9 (gap 2^-7 above 1.0), down by 2^-10 (gap
  2^-8 below). Dead-zone rounding is stochastic there (nearest would
  erase both)."""
  s0 = jnp.ones(2)
  s1 = jnp.float32([1 + GAP / 4, 1 - GAP / 8])
  for i in range(2):
    got = lowprec.freeze.state_erasure(
      {"s": s0[i : i + 1]}, {"s": s1[i : i + 1]}, {"s": spec}
    )["s"]
    assert float(got["erased"]) == 0.75, i
    assert float(got["erased_fraction"]) == 0.75, i


def _holder() -> optax.GradientTransformation:
  """A transform whose state `{"s": ...}` is the incoming update."""

  def init(params):
    return {"s": jnp.zeros_like(params)}

  def update(updates, state, params=None):
    del state, params
    return updates, {"s": updates}

  return optax.GradientTransformation(init, update)

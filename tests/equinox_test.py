"""Training Equinox models with lowprec, the way Equinox users write it.

Models are unfiltered `eqx.Module`s, with functions, Python numbers and
int/bool arrays next to their float arrays. Loops use `eqx.filter_jit` and
`eqx.partition` / `eqx.combine` (or `eqx.filter_value_and_grad`) and check:
weights keep their native dtype and stay on the grid after every step,
non-array leaves are the same objects, the step compiles once, and the
telemetry equals a numpy recount from the weights before and after each
step and the proposals the write-back was handed (recorded by a test-only
pass-through transform). Nearest write-back is checked against the
ml_dtypes cast of `w + u`, and an orbax checkpoint resumes bit for bit.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import lowprec
from lowprec.engine.weights import path_name

NATIVE = {
  "bfloat16": ml_dtypes.bfloat16,
  "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
  "float8_e5m2": ml_dtypes.float8_e5m2,
}


class Net(eqx.Module):
  """An MLP (functions as leaves) with a float and an int leaf of its own."""

  mlp: eqx.nn.MLP
  scale: float  # a Python float: a setting, not a parameter
  seen: jax.Array  # int32: a counter, not a parameter

  def __init__(self, key):
    self.mlp = eqx.nn.MLP(4, 1, 16, 2, activation=jax.nn.tanh, key=key)
    self.scale = 0.7
    self.seen = jnp.zeros((), jnp.int32)

  def __call__(self, x):
    return self.scale * self.mlp(x)


def _rules(fmt):
  # Biases stay float32; the int counter gets a None rule of its own.
  return [(r"seen", None), (r".*bias", None), (r".*", fmt)]


def _data():
  x = jax.random.normal(jax.random.key(1), (64, 4))
  return x, jnp.sin(x @ jnp.array([1.0, -2.0, 0.5, 1.5]))[:, None]


def _loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def tap():
  """Pass-through transform keeping the last updates it saw (test only)."""

  def init(params):
    zeros = lambda w: jnp.zeros(w.shape, jnp.float32)
    return {"u": jax.tree.map(zeros, params)}

  return optax.GradientTransformation(init, lambda u, s, p=None: (u, {"u": u}))


def _build(fmt, rounding, seed=0):
  model = Net(jax.random.key(seed))
  model = lowprec.to_grid(model, _rules(fmt), storage="native")
  tx = optax.chain(
    lowprec.in_float32(optax.adamw(1e-2)),
    tap(),
    lowprec.writeback(_rules(fmt), rounding, key=jax.random.key(5)),
  )
  return model, tx, tx.init(eqx.filter(model, eqx.is_inexact_array))


def _partition_step(tx, x, y, traces):
  """float32 views of the weights for the loss: eqx.partition / combine."""

  @eqx.filter_jit
  def step(model, opt_state):
    traces.append(None)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    wide = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    loss, grads = jax.value_and_grad(
      lambda p: _loss(eqx.combine(p, static), x, y)
    )(wide)
    updates, opt_state = tx.update(grads, opt_state, params)
    model = lowprec.apply_updates(model, updates)
    return model, opt_state, loss, lowprec.telemetry_arrays(opt_state)

  return step


def _filter_grad_step(tx, x, y, traces):
  """The plain Equinox step: gradients of the stored (bfloat16) weights."""

  @eqx.filter_jit
  def step(model, opt_state):
    traces.append(None)
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = tx.update(grads, opt_state, params)
    model = lowprec.apply_updates(model, updates)
    return model, opt_state, loss, lowprec.telemetry_arrays(opt_state)

  return step


def _weights(model) -> dict[str, np.ndarray]:
  """The float arrays of a module by path, as numpy."""
  flat = jax.tree_util.tree_flatten_with_path(model)[0]
  return {
    path_name(p): np.asarray(w) for p, w in flat if eqx.is_inexact_array(w)
  }


def _recount(before, after, u, fmt, rounding):
  """Totals over gridded weights from weights and proposals, in numpy."""
  n = {"proposals": 0, "moved": 0, "erased": 0}
  for name, w in before.items():
    if name.endswith("bias"):
      assert after[name].dtype == np.float32
      continue
    assert after[name].dtype == NATIVE[fmt], name
    w32, w2 = w.astype(np.float32), after[name].astype(np.float32)
    uu = u[name]
    prop = (uu != 0) & np.isfinite(uu)
    moved = prop & (w2 != w32)
    n["proposals"] += int(prop.sum())
    n["moved"] += int(moved.sum())
    n["erased"] += int((prop & ~moved).sum())
    assert np.all(w2[~prop] == w32[~prop])
    if rounding == "nearest":
      want = (w32 + uu).astype(NATIVE[fmt]).astype(np.float32)
      np.testing.assert_array_equal(w2[prop], want[prop])
  return n


CASES = [
  pytest.param("bfloat16", "stochastic", _partition_step, id="bf16-sr"),
  pytest.param("float8_e4m3fn", "stochastic", _partition_step, id="e4m3-sr"),
  pytest.param("float8_e4m3fn", "nearest", _partition_step, id="e4m3-rn"),
  pytest.param("bfloat16", "nearest", _filter_grad_step, id="bf16-rn-grad"),
]


@pytest.mark.parametrize("fmt, rounding, make_step", CASES)
def test_equinox_loop_keeps_native_weights_on_grid_and_telemetry_recounts(
  fmt, rounding, make_step
):
  model, tx, opt_state = _build(fmt, rounding)
  act, scale, seen = model.mlp.activation, model.scale, model.seen
  x, y = _data()
  traces = []
  step = make_step(tx, x, y, traces)
  losses = []
  for _ in range(30):
    before = _weights(model)
    model, opt_state, loss, tel = step(model, opt_state)
    losses.append(float(loss))
    u = {
      path_name(p): np.asarray(v)
      for p, v in jax.tree_util.tree_flatten_with_path(opt_state[1]["u"])[0]
    }
    want = _recount(before, _weights(model), u, fmt, rounding)
    for k, v in want.items():
      assert int(tel[k]) == v, k
  assert len(traces) == 1  # compiled once
  # Non-arrays are the very same objects; the counter was not touched.
  assert model.mlp.activation is act and model.scale is scale
  assert model.seen.dtype == jnp.int32 and int(model.seen) == int(seen) == 0
  names = set(opt_state[2].moved)
  assert names == {f"mlp/layers/{i}/weight" for i in range(3)}
  lowprec.check_on_grid(model, _rules(fmt))
  assert tel["moved"] > 0 and np.all(np.isfinite(losses))
  # Nearest float8 write-back freezes early (erasing most proposals).
  assert losses[-1] < 0.85 * losses[0]


def test_eqx_apply_updates_widens_bf16_and_lowprec_apply_updates_does_not():
  model, tx, opt_state = _build("bfloat16", "nearest")
  x, y = _data()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  wide = jax.tree.map(lambda w: w.astype(jnp.float32), params)
  grads = jax.grad(lambda p: _loss(eqx.combine(p, static), x, y))(wide)
  updates, _ = tx.update(grads, opt_state, params)
  # eqx.apply_updates adds the float32 deltas without casting back: the
  # weights become float32 (on the bf16 grid still, but twice the bytes).
  widened = eqx.apply_updates(model, updates)
  assert widened.mlp.layers[0].weight.dtype == jnp.float32
  kept = lowprec.apply_updates(model, updates)
  assert kept.mlp.layers[0].weight.dtype == jnp.bfloat16
  for a, b in zip(jax.tree.leaves(widened), jax.tree.leaves(kept), strict=True):
    if eqx.is_inexact_array(a):
      np.testing.assert_array_equal(np.asarray(a), b.astype(a.dtype))
  # With float8 weights eqx.apply_updates cannot add at all.
  f8, tx8, s8 = _build("float8_e4m3fn", "nearest")
  p8 = eqx.filter(f8, eqx.is_inexact_array)
  g8 = jax.tree.map(lambda w: jnp.ones(w.shape, jnp.float32), p8)
  u8, _ = tx8.update(g8, s8, p8)
  with pytest.raises(Exception, match="promotion"):
    eqx.apply_updates(f8, u8)
  assert lowprec.apply_updates(f8, u8).mlp.layers[1].weight.dtype == (
    jnp.float8_e4m3fn
  )


def test_unfiltered_module_through_to_grid_check_on_grid_and_writeback():
  model = Net(jax.random.key(0))
  fmt = "float8_e5m2"
  gridded = lowprec.to_grid(model, _rules(fmt), storage="native")
  # The oracle: ml_dtypes' cast of each float32 weight.
  for name, w in _weights(model).items():
    got = _weights(gridded)[name]
    want = w if name.endswith("bias") else w.astype(NATIVE[fmt])
    assert got.dtype == want.dtype, name
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
  assert gridded.mlp.activation is model.mlp.activation
  lowprec.check_on_grid(gridded, _rules(fmt))
  with pytest.raises(ValueError, match="'mlp/layers/0/weight': 64 of 64"):
    lowprec.check_on_grid(model, _rules(fmt))
  # writeback alone takes the unfiltered module at init and at update,
  # with the None gradients eqx.filter_grad gives for non-arrays.
  wb = lowprec.writeback(_rules(fmt), "stochastic", key=jax.random.key(0))
  state = wb.init(gridded)
  assert sorted(state.moved) == [f"mlp/layers/{i}/weight" for i in range(3)]
  x, y = _data()
  grads = eqx.filter_grad(
    lambda m: _loss(jax.tree.map(_f32, m, is_leaf=eqx.is_array), x, y)
  )(gridded)
  assert grads.mlp.activation is None and grads.seen is None
  u = jax.tree.map(lambda g: -0.05 * g.astype(jnp.float32), grads)
  deltas, state = eqx.filter_jit(wb.update)(u, state, gridded)
  new = lowprec.apply_updates(gridded, deltas)
  assert new.mlp.layers[0].weight.dtype == jnp.float8_e5m2
  lowprec.check_on_grid(new, _rules(fmt))
  assert lowprec.telemetry(state)["moved"] > 0


def _f32(w):
  return w.astype(jnp.float32) if eqx.is_inexact_array(w) else w


def test_int_and_bool_leaves_are_refused_naming_the_leaf_and_the_fix():
  model = Net(jax.random.key(0))
  for call in (
    lambda: lowprec.to_grid(model, "bfloat16"),
    lambda: lowprec.check_on_grid(model, "bfloat16"),
    lambda: lowprec.writeback("bfloat16").init(model),
  ):
    with pytest.raises(ValueError) as e:
      call()
    msg = str(e.value)
    assert "'seen' holds int32 values" in msg
    assert "(r'seen', None)" in msg and "eqx.filter" in msg
    assert "to_grid" not in msg  # no circular advice
  # Both fixes work: a None rule, or only the float arrays.
  lowprec.to_grid(model, [("seen", None), (".*", "bfloat16")])
  floats = lowprec.to_grid(eqx.filter(model, eqx.is_inexact_array), "bfloat16")
  assert floats.seen is None and floats.scale is None


def test_an_update_shaped_unlike_its_weight_names_the_leaf_and_both_shapes():
  model, _, _ = _build("bfloat16", "nearest")
  params = eqx.filter(model, eqx.is_inexact_array)
  good = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), params)
  bad = eqx.tree_at(lambda m: m.mlp.layers[1].weight, good, jnp.zeros((4, 4)))
  wb = lowprec.writeback(_rules("bfloat16"))
  with pytest.raises(ValueError, match=r"'mlp/layers/1/weight' has shape "):
    wb.update(bad, wb.init(model), model)
  with pytest.raises(ValueError) as e:
    lowprec.apply_updates(model, bad)
  assert "'mlp/layers/1/weight' has shape (4, 4), the parameter (16, 16)" in (
    str(e.value)
  )


def test_orbax_checkpoint_resumes_bit_for_bit(tmp_path):
  x, y = _data()
  model, tx, opt_state = _build("float8_e4m3fn", "stochastic")
  step = _partition_step(tx, x, y, [])
  for _ in range(5):
    model, opt_state, _, _ = step(model, opt_state)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(
    tmp_path / "ckpt",
    {"params": eqx.filter(model, eqx.is_array), "opt_state": opt_state},
  )
  ckpt.wait_until_finished()
  for _ in range(5):
    model, opt_state, _, _ = step(model, opt_state)
  want = _weights(model)

  fresh, _, fresh_state = _build("float8_e4m3fn", "stochastic")
  params, static = eqx.partition(fresh, eqx.is_array)
  restored = ckpt.restore(
    tmp_path / "ckpt", {"params": params, "opt_state": fresh_state}
  )
  untyped = ckpt.restore(tmp_path / "ckpt")  # no target: dicts and lists
  ckpt.close()
  resumed = eqx.combine(restored["params"], static)
  assert resumed.mlp.layers[0].weight.dtype == jnp.float8_e4m3fn
  assert resumed.seen.dtype == jnp.int32
  resumed_state = restored["opt_state"]
  assert lowprec.telemetry(untyped["opt_state"]) == lowprec.telemetry(
    resumed_state
  )
  for _ in range(5):
    resumed, resumed_state, _, _ = step(resumed, resumed_state)
  got = _weights(resumed)
  assert got.keys() == want.keys()
  for k in want:
    assert got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(got[k].view(np.uint8), want[k].view(np.uint8))
  assert lowprec.telemetry(resumed_state) == lowprec.telemetry(opt_state)

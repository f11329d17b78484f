"""Native low-precision storage: `in_float32`, linen `TrainState`, and the
naive float8 path (optimizer state in float8) that must stop, not NaN.

Oracles: ml_dtypes casts (nearest write-back of `w + u`), and a plain
float32 optax run for the proposals `in_float32` must reproduce.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax.training import train_state

import lowprec


def _problem(fmt, storage):
  w = 0.3 * jax.random.normal(jax.random.key(0), (8, 4))
  x = jax.random.normal(jax.random.key(1), (16, 8))
  return lowprec.to_grid({"w": w}, fmt, storage=storage), x


def _loss(p, x):
  return jnp.mean((x @ p["w"].astype(jnp.float32) - 1.0) ** 2)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float16", "bfloat16"])
def test_naive_native_path_stops_before_anything_changes(fmt):
  p, x = _problem(fmt, "native")
  tx = optax.chain(optax.adam(1e-2), lowprec.writeback(fmt))
  state = tx.init(p)
  grads = jax.grad(_loss)(p, x)
  assert grads["w"].dtype == p["w"].dtype  # why the naive path cannot work
  with pytest.raises(ValueError, match=r"arrives as .*lowprec.in_float32"):
    tx.update(grads, state, p)
  with pytest.raises(ValueError, match=r"lowprec.in_float32"):
    jax.jit(tx.update)(grads, state, p)


def test_in_float32_gives_float32_state_and_the_float32_proposals():
  fmt = "float8_e4m3fn"
  p, x = _problem(fmt, "native")
  inner = optax.adam(1e-2)
  tx = lowprec.in_float32(inner)
  state = tx.init(p)
  dtypes = {a.dtype for a in jax.tree.leaves(state)}
  assert dtypes == {np.dtype(np.int32), np.dtype(np.float32)}
  # The oracle: plain optax on float32 copies of the same values.
  p32 = {"w": p["w"].astype(jnp.float32)}
  ref_state = inner.init(p32)
  for _ in range(3):
    g = jax.grad(_loss)(p, x)
    u, state = tx.update(g, state, p)
    ref_u, ref_state = inner.update(
      {"w": g["w"].astype(jnp.float32)}, ref_state, p32
    )
    assert u["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(ref_u["w"]))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_documented_native_path_trains_and_matches_the_cast(fmt):
  p, x = _problem(fmt, "native")
  tx = optax.chain(
    lowprec.in_float32(optax.adam(1e-2)), lowprec.writeback(fmt, "nearest")
  )
  state = tx.init(p)
  native = np.dtype(getattr(ml_dtypes, fmt))
  losses = [float(_loss(p, x))]
  for _ in range(20):
    g = jax.grad(_loss)(p, x)
    w = np.asarray(p["w"]).astype(np.float32)
    # The proposal the write-back is handed, recomputed from the same state.
    u, _ = lowprec.in_float32(optax.adam(1e-2)).update(g, state[0], p)
    updates, state = tx.update(g, state, p)
    p = lowprec.apply_updates(p, updates)
    assert p["w"].dtype == native
    got = np.asarray(p["w"]).astype(np.float32)
    uu = np.asarray(u["w"])
    want = np.where(uu != 0, (w + uu).astype(native).astype(np.float32), w)
    np.testing.assert_array_equal(got, want)
    tel = lowprec.telemetry(state)
    assert tel["moved"] == int(((got != w) & (uu != 0)).sum())
    assert tel["nonfinite"] == 0
    losses.append(float(_loss(p, x)))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(32, dtype=jnp.float32)(x))
    return nn.Dense(1, dtype=jnp.float32)(h)


def _linen(fmt, storage, rounding="nearest"):
  x = jax.random.normal(jax.random.key(1), (64, 4))
  y = jnp.sin(x.sum(-1, keepdims=True))
  net = _Net()
  rules = [(r".*bias", None), (r".*", fmt)]
  params = lowprec.to_grid(
    net.init(jax.random.key(0), x)["params"], rules, storage=storage
  )
  inner = optax.adam(1e-2)
  if storage == "native":
    inner = lowprec.in_float32(inner)
  tx = optax.chain(
    inner, lowprec.writeback(rules, rounding, key=jax.random.key(2))
  )
  state = train_state.TrainState.create(
    apply_fn=net.apply, params=params, tx=tx
  )

  def loss_fn(params):
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

  return state, loss_fn, rules


@pytest.mark.parametrize(
  "fmt, storage, rounding",
  [
    ("bfloat16", "float32", "nearest"),
    ("bfloat16", "native", "stochastic"),
    ("float8_e4m3fn", "float32", "deadzone"),
  ],
)
def test_linen_train_state_apply_gradients(fmt, storage, rounding):
  state, loss_fn, rules = _linen(fmt, storage, rounding)
  names = set(state.opt_state[1].moved)
  assert names == {"Dense_0/kernel", "Dense_1/kernel"}

  @jax.jit
  def step(state):
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(30):
    before = jax.tree.map(np.asarray, state.params)
    state, loss = step(state)
    losses.append(float(loss))
    moved = sum(
      int((np.asarray(state.params[d]["kernel"]) != before[d]["kernel"]).sum())
      for d in ("Dense_0", "Dense_1")
    )
    assert lowprec.telemetry(state.opt_state)["moved"] == moved
  assert set(state.opt_state[1].moved) == names
  lowprec.check_on_grid(state.params, rules)
  kernel = state.params["Dense_0"]["kernel"]
  assert kernel.dtype == (jnp.float32 if storage == "float32" else fmt)
  assert losses[-1] < 0.7 * losses[0]


def test_linen_native_float8_through_the_documented_step():
  state, loss_fn, rules = _linen("float8_e4m3fn", "native")

  @jax.jit
  def step(state):
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = lowprec.apply_updates(state.params, updates)
    return state.replace(
      step=state.step + 1, params=params, opt_state=opt_state
    ), loss

  losses = []
  for _ in range(30):
    state, loss = step(state)
    losses.append(float(loss))
  assert state.params["Dense_0"]["kernel"].dtype == jnp.float8_e4m3fn
  lowprec.check_on_grid(state.params, rules)
  assert losses[-1] < 0.7 * losses[0]
  # TrainState.apply_gradients adds with optax.apply_updates, which JAX
  # refuses for float8 + float32.
  grads = jax.grad(loss_fn)(state.params)
  with pytest.raises(Exception, match="promotion"):
    state.apply_gradients(grads=grads)


@pytest.mark.parametrize(
  "inner, called",
  [(3, False), ("adam", False), (optax.adam, True)],
  ids=["int", "str", "uncalled-factory"],
)
def test_in_float32_of_what_is_not_a_transform_is_a_type_error(inner, called):
  with pytest.raises(TypeError, match="in_float32 wraps an optax transform"):
    lowprec.in_float32(inner)
  with pytest.raises(TypeError) as e:
    lowprec.in_float32(inner)
  assert type(inner).__name__ in str(e.value)
  assert "lowprec.in_float32(optax.adam(1e-3))" in str(e.value)
  assert ("call the factory first" in str(e.value)) == called

"""The frontier recipes as users write their loops: a Flax linen model with
optax, a Flax NNX optimizer, an Equinox module, and an orbax checkpoint
resumed bit for bit, for ECO, split weights and the 8- and 4-bit state
stores. Each loop trains (its loss falls) and keeps its weights on their
grid; the resumed run equals the uninterrupted one in every bit.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import lowprec
from tests.state_storage_test import _bits

KEY = jax.random.key(5)
# The weights' grid of each recipe (None: float32 weights, stored state).
RECIPES = {
  "eco": ("bfloat16", lambda: lowprec.eco(optax.adamw(3e-2), "bfloat16")),
  "split": (
    "bfloat16",
    lambda: optax.chain(
      lowprec.in_float32(optax.adamw(3e-2)), lowprec.split_writeback()
    ),
  ),
  "dynamic8": (
    None,
    lambda: lowprec.store_state(
      optax.adamw(3e-2),
      {"mu": "dynamic8:stochastic:block32", "nu": "dynamic8u:block32"},
      key=KEY,
    ),
  ),
  "amax_e4m3": (
    None,
    lambda: lowprec.store_state(
      optax.adamw(3e-2), {"mu|nu": "float8_e4m3fn:nearest:block32:amax"}
    ),
  ),
  "companded8_sqrt8": (
    None,
    lambda: lowprec.store_state(
      optax.adamw(3e-2), {"mu": "companded8:block32", "nu": "sqrt8:block32"}
    ),
  ),
  "4bit": (
    None,
    lambda: lowprec.store_state(
      optax.adamw(3e-2), {"mu": "dynamic4:block32", "nu": "uint4nz:block32"}
    ),
  ),
}
X = jax.random.normal(jax.random.key(1), (64, 8))
Y = jnp.sin(X @ jnp.linspace(-1.0, 1.0, 8))[:, None]


def _on_grid(params, grid):
  return params if grid is None else lowprec.to_grid(params, grid)


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(jnp.tanh(nn.Dense(32)(x)))


def _linen_run(name, steps, params=None, state=None):
  grid, make = RECIPES[name]
  model, tx = _Linen(), make()
  if params is None:
    params = _on_grid(model.init(jax.random.key(0), X), grid)
    state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss = lambda p: jnp.mean((model.apply(p, X) - Y) ** 2)  # noqa: E731
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  losses = []
  for _ in range(steps):
    params, state, value = step(params, state)
    losses.append(float(value))
  return params, state, losses


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_linen_loop_trains_and_keeps_the_grid(name):
  params, state, losses = _linen_run(name, 30)
  assert losses[-1] < 0.7 * losses[0], losses
  grid = RECIPES[name][0]
  if grid is not None:
    lowprec.check_on_grid(params, grid)
  assert lowprec.telemetry(state)  # the recipe's counts are found


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_orbax_resume_is_bit_for_bit(name, tmp_path):
  want_p, want_s, _ = _linen_run(name, 6)
  p, s, _ = _linen_run(name, 3)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "c", {"p": p, "s": s})
  ckpt.wait_until_finished()
  back = ckpt.restore(tmp_path / "c", {"p": p, "s": s})
  ckpt.close()
  got_p, got_s, _ = _linen_run(name, 3, back["p"], back["s"])
  got = jax.tree.leaves((got_p, got_s))
  want = jax.tree.leaves((want_p, want_s))
  assert len(got) == len(want)
  for a, b in zip(got, want, strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


class _Nnx(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


@pytest.mark.parametrize("name", ["eco", "split", "dynamic8"])
def test_nnx_optimizer_loop_trains(name):
  grid, make = RECIPES[name]
  model = _Nnx(nnx.Rngs(0))
  nnx.update(model, _on_grid(nnx.state(model, nnx.Param), grid))
  opt = nnx.Optimizer(model, make(), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss = lambda m: jnp.mean((m(X) - Y) ** 2)  # noqa: E731
    value, grads = nnx.value_and_grad(loss)(model)
    opt.update(model, grads)
    return value

  losses = [float(step(model, opt)) for _ in range(30)]
  assert losses[-1] < 0.7 * losses[0], losses
  if grid is not None:
    lowprec.check_on_grid(nnx.state(model, nnx.Param), grid)
  assert lowprec.telemetry(opt.opt_state)


@pytest.mark.parametrize("name", ["eco", "split", "amax_e4m3"])
def test_equinox_loop_trains(name):
  grid, make = RECIPES[name]
  model = eqx.nn.MLP(8, 1, 32, 1, activation=jnp.tanh, key=jax.random.key(0))
  if grid is not None:
    model = lowprec.to_grid(model, grid)
  tx = make()
  state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, state):
    loss = lambda m: jnp.mean((jax.vmap(m)(X) - Y) ** 2)  # noqa: E731
    value, grads = eqx.filter_value_and_grad(loss)(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = tx.update(grads, state, params)
    return eqx.apply_updates(model, updates), state, value

  losses = []
  for _ in range(30):
    model, state, value = step(model, state)
    losses.append(float(value))
  assert losses[-1] < 0.7 * losses[0], losses
  if grid is not None:
    lowprec.check_on_grid(eqx.filter(model, eqx.is_inexact_array), grid)

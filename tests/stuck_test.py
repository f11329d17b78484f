"""`lowprec.freeze.stuck` against numpy counts, on a bf16 training loop
where norm gains at 1.0 are known to stay put (AdamW proposals under half
the bf16 gap at 1.0, 2**-8 above and 2**-9 below) while kernels move."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec

GROUPS = [(r".*gain", "norm gains"), (r".*kernel", "kernels"), (r".*", None)]


def _params():
  k = jax.random.split(jax.random.key(0), 2)
  return {
    "block": {
      "gain": jnp.ones(64),
      "kernel": 0.3 * jax.random.normal(k[0], (64, 64)),
    },
    "head": {"kernel": 0.3 * jax.random.normal(k[1], (64, 8))},
    "step_count": jnp.zeros(()),
  }


def _loss(p, x, y):
  h = x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True)) * p["block"]["gain"]
  return jnp.mean(
    (jnp.tanh(h @ p["block"]["kernel"]) @ p["head"]["kernel"] - y) ** 2
  )


def _train(rounding, steps=15, lr=1e-3):
  rules = [(r"step_count", None), (r".*", "bfloat16")]
  p0 = lowprec.to_grid(_params(), rules)
  opt = optax.chain(
    optax.adamw(lr, weight_decay=0.1),
    lowprec.writeback(rules, rounding, key=jax.random.key(1)),
  )
  x = jax.random.normal(jax.random.key(2), (32, 64))
  y = jax.random.normal(jax.random.key(3), (32, 8))

  @jax.jit
  def step(p, s):
    u, s = opt.update(jax.grad(_loss)(p, x, y), s, p)
    return optax.apply_updates(p, u), s

  p, s = p0, opt.init(p0)
  for _ in range(steps):
    p, s = step(p, s)
  return p0, p


def test_bf16_gains_at_one_stay_put_under_nearest_and_move_under_sr():
  p0, p = _train("nearest")
  got = lowprec.freeze.stuck(p0, p, GROUPS)
  assert list(got) == ["norm gains", "kernels", "all"]
  gains = np.asarray(p["block"]["gain"])
  kernels = [np.asarray(p[g]["kernel"]) for g in ("block", "head")]
  kernels0 = [np.asarray(p0[g]["kernel"]) for g in ("block", "head")]
  assert got["norm gains"].stuck == int((gains == 1.0).sum()) == 64
  assert got["norm gains"].share == 1.0
  want = sum(
    int((a == b).sum()) for a, b in zip(kernels, kernels0, strict=True)
  )
  assert got["kernels"].stuck == want
  assert got["kernels"].coordinates == 64 * 64 + 64 * 8
  assert got["kernels"].share < 0.9  # kernels do move
  assert got["all"].stuck == 64 + want
  # Stochastic write-back moves gains off 1.0.
  p0, p = _train("stochastic")
  assert lowprec.freeze.stuck(p0, p, GROUPS)["norm gains"].share < 0.5


def test_with_a_format_a_float32_run_is_read_on_the_grid():
  p0 = _params()
  moved = jax.tree.map(lambda a: a + 1e-4, p0)  # under half a bf16 gap at 1
  exact = lowprec.freeze.stuck(p0, moved, GROUPS)
  assert exact["norm gains"].stuck == 0
  on_grid = lowprec.freeze.stuck(p0, moved, GROUPS, fmt="bfloat16")
  assert on_grid["norm gains"].stuck == 64
  want = sum(
    int(
      (
        np.asarray(p0[g]["kernel"]).astype(jnp.bfloat16)
        == np.asarray(moved[g]["kernel"]).astype(jnp.bfloat16)
      ).sum()
    )
    for g in ("block", "head")
  )
  assert on_grid["kernels"].stuck == want


def test_per_tensor_groups_nonfinite_and_errors():
  p0 = {"a": jnp.zeros(4), "b": jnp.ones(2)}
  p1 = {"a": jnp.array([0.0, 1.0, jnp.nan, 0.0]), "b": jnp.ones(2)}
  got = lowprec.freeze.stuck(p0, p1)
  assert list(got) == ["a", "b", "all"]
  assert (got["a"].coordinates, got["a"].stuck, got["a"].nonfinite) == (3, 2, 1)
  assert got["b"].share == 1.0 and got["all"].stuck == 4
  with pytest.raises(ValueError, match="no group rule matches parameter 'b'"):
    lowprec.freeze.stuck(p0, p1, [(r"a", "x")])
  with pytest.raises(ValueError, match="different tree structures"):
    lowprec.freeze.stuck(p0, {"a": jnp.zeros(4)})
  with pytest.raises(ValueError, match="shape"):
    lowprec.freeze.stuck(p0, {"a": jnp.zeros(3), "b": jnp.ones(2)})

"""`lowprec.freeze.decay_erasure` against an ml_dtypes/numpy recount.

The oracle splits AdamW's proposal with plain optax: the Adam direction
`a` from `optax.scale_by_adam` (same hyperparameters, same gradients), so
the gradient part is `-lr * a`, computed independently of the transform.
Erased: `u != 0` and `bf16(w + u) == bf16(w)`; weight decay only: erased
and (`a == 0` or `bf16(w - lr * a) == bf16(w)`).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lowprec

LR = optax.cosine_decay_schedule(2e-3, 20)
WD = 0.1


def _q(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _params():
  k = jax.random.split(jax.random.key(0), 2)
  return lowprec.to_grid(
    {
      "gain": jnp.ones(256),
      "kernel": 0.05 * jax.random.normal(k[0], (64, 32)),
      "bias": 0.01 * jax.random.normal(k[1], (32,)),
    },
    "bfloat16",
  )


def _grads(step):
  k = jax.random.split(jax.random.key(10 + step), 3)
  g = {
    "gain": 1e-3 * jax.random.normal(k[0], (256,)),
    "kernel": jax.random.normal(k[1], (64, 32)),
    "bias": jax.random.normal(k[2], (32,)),
  }
  # A zero gradient for half the gains from the start: their Adam
  # direction stays exactly zero, so their proposal is decay alone.
  g["gain"] = g["gain"].at[:128].set(0.0)
  return g


@pytest.mark.parametrize("mask", [None, "no_bias"])
def test_counts_equal_an_independent_recount(mask):
  decays = None
  if mask:
    decays = {"gain": True, "kernel": True, "bias": False}
  adamw = optax.adamw(LR, weight_decay=WD, mask=decays)
  tx = optax.chain(
    adamw,
    lowprec.freeze.decay_erasure("bfloat16", LR, WD, mask=decays),
    lowprec.writeback("bfloat16"),
  )
  adam = optax.scale_by_adam()
  params = _params()
  state, adam_state = tx.init(params), adam.init(params)
  seen_only = 0
  for step in range(6):
    grads = _grads(step)
    a, adam_state = adam.update(grads, adam_state)
    u, _ = adamw.update(grads, state[0], params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    rep = lowprec.telemetry(state)
    total = total_only = 0
    for name in ("gain", "kernel", "bias"):
      w = np.asarray(params[name], np.float32)
      un = np.asarray(u[name], np.float32)
      an = np.asarray(a[name], np.float32)
      lr = np.float32(LR(step))
      erased = (un != 0) & (_q(w + un) == _q(w))
      alone = (an == 0) | (_q(w + (-lr * an)) == _q(w))
      assert rep[f"decay/erased/{name}"] == int(erased.sum()), (step, name)
      assert rep[f"decay/decay_only/{name}"] == int((erased & alone).sum())
      total += int(erased.sum())
      total_only += int((erased & alone).sum())
    assert rep["decay/erased"] == total == rep["erased"]  # the write-back's
    assert rep["decay/decay_only_share"] == pytest.approx(total_only / total)
    seen_only += total_only
    params = lowprec.apply_updates(params, updates)
  assert seen_only > 0 and total > total_only  # both kinds occur


def test_zero_adam_direction_is_decay_only_and_float32_leaves_are_skipped():
  params = {"gain": jnp.ones(8), "step": jnp.zeros((), jnp.int32)}
  rules = [("gain", "bfloat16"), ("step", None)]
  tx = optax.chain(
    optax.adamw(1e-3, weight_decay=WD),
    lowprec.freeze.decay_erasure(rules, 1e-3, WD),
  )
  state = tx.init(params)
  grads = {"gain": jnp.zeros(8), "step": jnp.zeros((), jnp.int32)}
  _, state = tx.update(grads, state, params)
  rep = lowprec.telemetry(state)
  # -1e-3 * 0.1 * 1.0 is far under half the bf16 gap below 1.0 (2**-9).
  assert rep["decay/erased/gain"] == 8 and rep["decay/decay_only/gain"] == 8
  assert "decay/erased/step" not in rep
  arrays = jax.jit(lowprec.telemetry_arrays)(state)
  assert int(arrays["decay/decay_only"]) == 8

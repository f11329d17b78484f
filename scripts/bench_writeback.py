"""Write-back step cost: `optax.adamw` alone vs adamw + `lowprec.writeback`.

One jitted optimizer step (update and apply) on a 20M-parameter pytree
(2M with --quick), float32 params; write-back params are float32 holding
bfloat16 grid values. Rows: nearest, stochastic and dead-zone write-back,
each with telemetry on and off. Target: stochastic with telemetry at most
1.3x the plain adamw step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from benchlib import median_time, table

import lowprec


def _params(n_params: int) -> dict:
  # Ten equal matrices plus their biases: the sizes of a small transformer.
  rows = int((n_params // 10) ** 0.5)
  key = jax.random.key(0)
  out = {}
  for i in range(10):
    key, sub = jax.random.split(key)
    out[f"layer{i}"] = {
      "kernel": 0.02 * jax.random.normal(sub, (rows, rows)),
      "bias": jnp.zeros((rows,)),
    }
  return out


def _step_fn(opt):
  @jax.jit
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(quick: bool) -> str:
  n_params = 2_000_000 if quick else 20_000_000
  repeats = 3 if quick else 7
  params = lowprec.to_grid(_params(n_params), "bfloat16")
  grads = jax.tree.map(lambda p: 1e-3 * jnp.sign(p) + 1e-4, params)
  count = sum(p.size for p in jax.tree.leaves(params))
  adamw = optax.adamw(1e-3)
  cases = [("adamw", adamw)]
  for rounding in ("nearest", "stochastic", "deadzone"):
    for tel in (True, False):
      wb = lowprec.writeback(
        "bfloat16", rounding, key=jax.random.key(1), telemetry=tel
      )
      name = f"adamw + {rounding}" + (" + telemetry" if tel else "")
      cases.append((name, optax.chain(adamw, wb)))
  rows = []
  for name, opt in cases:
    step = _step_fn(opt)
    state = opt.init(params)
    rows.append(
      (name, median_time(step, params, state, grads, repeats=repeats))
    )
  title = f"write-back step, {count / 1e6:.1f}M params, {jax.devices()[0]}"
  return table(title, rows, baseline="adamw")

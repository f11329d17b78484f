"""Write-back step cost: `optax.adamw` alone vs adamw + `lowprec.writeback`.

One jitted optimizer step (update and `optax.apply_updates`) on a pytree of
20M float32 parameters (2M with --quick): ten square matrices and their
biases. Write-back params are float32 holding bfloat16 grid values. Rows:
nearest, stochastic and dead-zone write-back, each with telemetry on and
off; the compensated write-backs (Kahan with a bfloat16 buffer,
two-component, remainder) without telemetry; and AdamW with its moments
stored in bfloat16 by stochastic rounding (`lowprec.store_state`). Targets:
stochastic with telemetry at most 1.3x the plain adamw step; Kahan and
two-component at most 1.25x nearest write-back without telemetry; bf16
stochastic moments at most 1.3x plain adamw.

The cases run in interleaved rounds; ratios are medians of same-round
ratios, with their range, so load from other processes on a shared machine
biases all rows alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import lowprec
from scripts.benchlib import Result, interleave


def _params(n_params: int) -> dict:
  side = int((n_params / 10) ** 0.5)
  keys = jax.random.split(jax.random.key(0), 10)
  return {
    f"layer{i}": {
      "kernel": 0.02 * jax.random.normal(k, (side, side)),
      "bias": jnp.zeros((side,)),
    }
    for i, k in enumerate(keys)
  }


def _step(opt):
  @jax.jit
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(quick: bool) -> Result:
  n_params, repeats, rounds = (2_000_000, 3, 3) if quick else (20_000_000, 3, 9)
  params = lowprec.to_grid(_params(n_params), "bfloat16")
  grads = jax.tree.map(lambda p: 1e-3 * jnp.sign(p) + 1e-4, params)
  count = sum(p.size for p in jax.tree.leaves(params))
  adamw = optax.adamw(1e-3)
  cases = {"adamw": adamw}
  for rounding in ("nearest", "stochastic", "deadzone"):
    for on in (True, False):
      wb = lowprec.writeback(
        "bfloat16", rounding, key=jax.random.key(1), telemetry=on
      )
      name = f"+ {rounding}" + (" + telemetry" if on else "")
      cases[name] = optax.chain(adamw, wb)
  key = jax.random.key(2)
  cases["+ kahan (bf16 buffer)"] = optax.chain(
    adamw, lowprec.kahan_writeback("bfloat16", telemetry=False)
  )
  cases["+ two-component"] = optax.chain(
    adamw, lowprec.two_component_writeback("bfloat16", telemetry=False)
  )
  cases["+ remainder"] = optax.chain(
    adamw, lowprec.remainder_writeback("bfloat16", telemetry=False)
  )
  moments = {"mu": "bfloat16:stochastic", "nu": "bfloat16:stochastic"}
  cases["adamw, bf16 stochastic moments"] = lowprec.store_state(
    adamw, moments, key=key, telemetry=False
  )
  calls = {
    name: (_step(opt), (params, opt.init(params), grads))
    for name, opt in cases.items()
  }
  times = interleave(calls, rounds=rounds, repeats=repeats)
  title = (
    f"write-back step, {count / 1e6:.1f}M params, "
    f"{jax.devices()[0].platform} x{jax.device_count()}"
  )
  return Result(title, times, ("adamw",))

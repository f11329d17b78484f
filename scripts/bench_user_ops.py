"""Forward + backward of an operator of your own vs the same one by hand.

A SwiGLU MLP (tokens x width -> 4 x width -> width) whose gate activation
output is stored in float8_e4m3fn (stochastic, per-tensor scale): the
down projection multiplies the rounded value, the activation's derivative
reads the original. Declared with `ops.Custom` (the backward is `jax.vjp`
of the forward recomputed with per-use reads), against a hand-written
`jax.custom_vjp` doing the same arithmetic with the derivative written out.
Both run the reference policy under `jax.jit` of `value_and_grad`; the two
are timed in alternation, round by round, so load on a shared machine hits
both alike. Reported: median and spread (min-max of the rounds) per case,
and the median of the per-round ratios.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from lowprec import ops
from lowprec.ops import saved

SR8 = ops.Rounding("float8_e4m3fn", "stochastic")


@jax.custom_jvp
def _silu_through_output(g, a, a_d):
  return a


@_silu_through_output.defjvp
def _silu_jvp(primals, tangents):
  g, a, a_d = primals
  s = jax.nn.sigmoid(g)
  return a, (s + a_d * (1 - s)) * tangents[0]


def _swiglu(x, w_gate, w_up, w_down, read):
  g = x @ w_gate
  a = jax.nn.silu(g)
  act = _silu_through_output(
    g, read("swiglu.act@dw_down", a), read.stored("swiglu.act@dact", a)
  )
  return (act * (x @ w_up)) @ w_down


def _declared():
  op = ops.Custom(
    "swiglu",
    _swiglu,
    args=("x", "w_gate", "w_up", "w_down"),
    saved={"swiglu.act": SR8},
    uses=("swiglu.act@dact", "swiglu.act@dw_down"),
  )
  # The table audit.derive gives (tests/user_ops_test.py checks it).
  return op.with_table(
    tuple(
      ops.Requirement(u, "swiglu.act", v, True, (), "")
      for u, v in (
        ("swiglu.act@dact", "original"),
        ("swiglu.act@dw_down", "rounded"),
      )
    )  # fmt: skip
  )


@jax.custom_vjp
def _by_hand(x, w_gate, w_up, w_down, key):
  return _by_hand_fwd(x, w_gate, w_up, w_down, key)[0]


def _by_hand_fwd(x, w_gate, w_up, w_down, key):
  g, u = x @ w_gate, x @ w_up
  a = jax.nn.silu(g)
  a_r, stored = SR8.round(a, saved.derive(key, "swiglu.act"))
  return (a_r * u) @ w_down, (x, w_gate, w_up, w_down, g, u, stored)


def _by_hand_bwd(res, dy):
  x, w_gate, w_up, w_down, g, u, stored = res
  a_r = stored.value()
  s = jax.nn.sigmoid(g)
  a = g * s
  dh = dy @ w_down.T
  dw_down = (a_r * u).T @ dy
  du = dh * a_r
  dg = dh * u * (s + a * (1 - s))
  dx = dg @ w_gate.T + du @ w_up.T
  return dx, x.T @ dg, x.T @ du, dw_down, None


_by_hand.defvjp(_by_hand_fwd, _by_hand_bwd)


def _steps():
  op = _declared()

  def loss_declared(params, x, key):
    return jnp.mean(jnp.square(op(x, *params, key=key)))

  def loss_by_hand(params, x, key):
    return jnp.mean(jnp.square(_by_hand(x, *params, key)))

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  return {"by hand": grad(loss_by_hand), "ops.Custom": grad(loss_declared)}


def _time(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def run(quick: bool = False) -> str:
  tokens, width = (256, 64) if quick else (2048, 256)
  rounds = 5 if quick else 31
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (tokens, width))
  params = (
    jax.random.normal(ks[1], (width, 4 * width)) / width**0.5,
    jax.random.normal(ks[2], (width, 4 * width)) / width**0.5,
    jax.random.normal(ks[3], (4 * width, width)) / (4 * width) ** 0.5,
  )
  steps = _steps()
  # Same gradients (same draws, same arithmetic up to float32 roundoff).
  (_, g0), (_, g1) = (f(params, x, ks[4]) for f in steps.values())
  err = max(
    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True)
  )
  for f in steps.values():  # compile and warm up
    for _ in range(2):
      jax.block_until_ready(f(params, x, ks[4]))
  times = {name: [] for name in steps}
  order = list(steps)
  for r in range(rounds):
    for name in order if r % 2 == 0 else order[::-1]:
      times[name].append(_time(steps[name], params, x, ks[4]))
  ratios = [
    b / a for a, b in zip(times["by hand"], times["ops.Custom"], strict=True)
  ]
  lines = [
    "### Operators of your own: SwiGLU, fwd+bwd, ops.Custom vs by hand",
    "",
    f"tokens {tokens}, width {width}, hidden {4 * width}; {rounds} "
    f"interleaved rounds; max relative gradient difference {err:.1e}",
    "",
    "| case | median ms | min ms | max ms |",
    "|---|---:|---:|---:|",
  ]
  for name, ts in times.items():
    lines.append(
      f"| {name} | {statistics.median(ts) * 1e3:.2f} | "
      f"{min(ts) * 1e3:.2f} | {max(ts) * 1e3:.2f} |"
    )
  q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else ratios
  lines += [
    "",
    f"ops.Custom / by hand, per round: median "
    f"{statistics.median(ratios):.3f}x (quartiles {q[0]:.3f}x - "
    f"{q[-1]:.3f}x; target <= 1.1x)",
  ]
  return "\n".join(lines)

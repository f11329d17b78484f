"""Forward + backward of an operator of your own vs the same one by hand.

A SwiGLU MLP (tokens x width -> 4 x width -> width) whose gate activation
output is stored in float8_e4m3fn (stochastic, per-tensor scale): the
down projection multiplies the rounded value, the activation's derivative
reads the original. Declared with `ops.Custom` (the backward is `jax.vjp`
of the forward recomputed with per-use reads), against a hand-written
`jax.custom_vjp` doing the same arithmetic with the derivative written out.
Both run the reference policy under `jax.jit` of `value_and_grad`; the two
are timed in alternation, round by round, so load on a shared machine hits
both alike; the ratio is the median of the per-round ratios, with its
range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments import swiglu
from lowprec.backward.ops import saved
from scripts.benchlib import Result, interleave

SR8 = swiglu.SR8


@jax.custom_vjp
def _by_hand(x, w_gate, w_up, w_down, key):
  return _by_hand_fwd(x, w_gate, w_up, w_down, key)[0]


def _by_hand_fwd(x, w_gate, w_up, w_down, key):
  g, u = x @ w_gate, x @ w_up
  a = jax.nn.silu(g)
  a_r, stored = SR8.round(a, saved.key_for(key, "swiglu.act"))
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
  op = swiglu.declared()

  def loss_declared(params, x, key):
    return jnp.mean(jnp.square(op(x, *params, key=key)))

  def loss_by_hand(params, x, key):
    return jnp.mean(jnp.square(_by_hand(x, *params, key)))

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  return {"by hand": grad(loss_by_hand), "ops.Custom": grad(loss_declared)}


def run(quick: bool = False) -> Result:
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
  args = (params, x, ks[4])
  times = interleave({n: (f, args) for n, f in steps.items()}, rounds=rounds)
  return Result(
    "Operators of your own: SwiGLU, fwd+bwd, ops.Custom vs by hand",
    times,
    ("by hand",),
    notes=(
      f"tokens {tokens}, width {width}, hidden {4 * width}; max relative "
      f"gradient difference {err:.1e}; target: ops.Custom <= 1.1x by hand.",
    ),
    extra={"max_relative_gradient_difference": err},
  )

"""Cost of `reference_trace`: a small GPT float32 AdamW step, with and without.

The step is a real forward + backward + AdamW update of a decoder-only
transformer (learned positions, pre-LN, tied embeddings) written in plain
JAX, a few million parameters; the traced arm appends
`lowprec.freeze.reference_trace` for three targets (bf16, e4m3fn, e5m2) and,
in a third arm, a 1024-coordinate sample. The last row times the trace's
update alone on the same gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import lowprec
from scripts.benchlib import Result, interleave

TARGETS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _init(key, *, vocab, d, layers, seq):
  keys = iter(jax.random.split(key, 4 * layers + 2))
  normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape)
  params = {"wte": normal((vocab, d)), "wpe": normal((seq, d)), "blocks": []}
  for _ in range(layers):
    params["blocks"].append(
      {
        "ln1": jnp.ones(d),
        "qkv": normal((d, 3 * d)),
        "proj": normal((d, d)),
        "ln2": jnp.ones(d),
        "fc": normal((d, 4 * d)),
        "out": normal((4 * d, d)),
      }
    )
  params["lnf"] = jnp.ones(d)
  return params


def _norm(x, g):
  x = x - x.mean(-1, keepdims=True)
  return g * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def _loss(params, tokens, heads):
  x = params["wte"][tokens[:, :-1]] + params["wpe"][None, : tokens.shape[1] - 1]
  b, t, d = x.shape
  mask = jnp.tril(jnp.ones((t, t), bool))
  for blk in params["blocks"]:
    q, k, v = jnp.split(_norm(x, blk["ln1"]) @ blk["qkv"], 3, -1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
    p = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
    a = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d)
    x = x + a @ blk["proj"]
    x = x + jax.nn.gelu(_norm(x, blk["ln2"]) @ blk["fc"]) @ blk["out"]
  logits = _norm(x, params["lnf"]) @ params["wte"].T
  labels = tokens[:, 1:]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _step_fn(opt, heads):
  @jax.jit
  def step(params, state, tokens):
    grads = jax.grad(_loss)(params, tokens, heads)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(quick: bool = False) -> Result:
  if quick:
    size = dict(vocab=512, d=64, layers=1, seq=32)
    batch, heads, repeats, rounds = 4, 2, 3, 1
  else:
    size = dict(vocab=8192, d=256, layers=4, seq=128)
    batch, heads, repeats, rounds = 8, 4, 3, 7
  params = _init(jax.random.key(0), **size)
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  tokens = jax.random.randint(
    jax.random.key(1), (batch, size["seq"] + 1), 0, size["vocab"]
  )
  adamw = optax.adamw(optax.cosine_decay_schedule(3e-4, 1000))
  trace = lowprec.freeze.reference_trace
  arms = {
    "float32 AdamW step": adamw,
    "+ reference_trace (3 targets)": optax.chain(adamw, trace(TARGETS)),
    "+ reference_trace (3 targets, sample=1024)": optax.chain(
      adamw, trace(TARGETS, sample=1024, key=jax.random.key(2))
    ),
  }
  calls = {}
  for name, opt in arms.items():
    calls[name] = (_step_fn(opt, heads), (params, opt.init(params), tokens))
  # The trace's update alone, on this model's gradients: its added cost.
  alone = trace(TARGETS)
  grads = jax.jit(jax.grad(_loss), static_argnums=2)(params, tokens, heads)
  calls["reference_trace update alone (3 targets)"] = (
    jax.jit(lambda g, s, p: alone.update(g, s, p)[1]),
    (grads, alone.init(params), params),
  )
  times = interleave(calls, rounds=rounds, repeats=repeats, warmup=1)
  title = (
    f"trace: small GPT float32 step ({n / 1e6:.1f}M params, "
    f"{batch * size['seq']} tokens/step)"
  )
  return Result(title, times, ("float32 AdamW step",))

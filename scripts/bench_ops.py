"""Forward + backward of a GPT block: emulated FP8 with per-use reads vs fp32.

A pre-norm GPT-2 block (width 256, 4 heads, length 128, batch 8) built from
`lowprec.nn`, differentiated with respect to its parameters and input. The
FP8 rows round every saved activation to float8_e4m3fn (stochastic), every
kernel to float8_e4m3fn (nearest) and every gradient entering a backward
matmul to float8_e5m2 (stochastic), all with per-tensor scaling, and read
each use as the policy says. The baseline is the same block with rounding
off (plain float32). The block-scaled rows run every dense layer as
`ops.ScaledDense` (the NVFP4 and MXFP8 recipes, reads `requantized`), the
rest of the block as the FP8 rows do; their ratios to the FP8 row are the
cost of the recipe's three block-scaled GEMMs over per-tensor FP8.
"""

from __future__ import annotations

if not __package__:  # run as a file, `python scripts/bench_ops.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.bench_ops ..."
  )


import flax.linen as fnn
import jax
import jax.numpy as jnp

from lowprec import nn, ops
from scripts.benchlib import Result, interleave

# The reference reads, and an admissible variant that reads fresh copies
# where the original is required (no fp32 copy kept for those uses).
POLICIES = {
  "reference": ops.REFERENCE,
  "fresh": ops.REFERENCE.override(
    r"attn\.(probs@dscores|out@delta)=fresh,norm\.out@(dgain|dx)=fresh"
  ),
}


class Block(fnn.Module):
  numerics: nn.Numerics
  heads: int = 4

  @fnn.compact
  def __call__(self, x):
    x = x + nn.CausalSelfAttention(self.heads, numerics=self.numerics)(x)
    return x + nn.MLP(numerics=self.numerics)(x)


def _step(numerics, x):
  block = Block(numerics)

  @jax.jit
  def step(params, x, key):
    def loss(p, x):
      y = block.apply(p, x, rngs={"lowprec": key})
      return jnp.mean(jnp.square(y))

    return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

  return step


def run(quick: bool = False) -> Result:
  batch, length, width = (2, 64, 128) if quick else (8, 128, 256)
  rounds = 5 if quick else 21
  x = jax.random.normal(jax.random.key(0), (batch, length, width))
  params = jax.jit(Block(nn.Numerics()).init)(jax.random.key(1), x)
  key = jax.random.key(2)
  cases = {"float32 (no rounding)": nn.Numerics()}
  for name, policy in POLICIES.items():
    cases[f"FP8 e4m3 SR / e5m2 SR grads, {name} reads"] = nn.Numerics.fp8(
      policy
    )
  fp8_ref = "FP8 e4m3 SR / e5m2 SR grads, reference reads"
  recipe = ops.REFERENCE.override(
    "sdense.in@dw=requantized,sdense.kernel@dx=requantized"
  )
  for name, op in (
    ("NVFP4 recipe", ops.ScaledDense.nvfp4()),
    ("MXFP8 recipe", ops.ScaledDense.mxfp8()),
  ):
    cases[f"{name} (ScaledDense), requantized reads"] = nn.Numerics.fp8(
      recipe, compute=op
    )
  args = (params, x, key)
  calls = {name: (_step(num, x), args) for name, num in cases.items()}
  times = interleave(calls, rounds=rounds)
  return Result(
    f"ops: GPT block fwd+bwd (batch {batch}, length {length}, width "
    f"{width}, 4 heads), {jax.devices()[0].platform}",
    times,
    ("float32 (no rounding)", fp8_ref),
  )


if __name__ == "__main__":
  print(run().markdown())

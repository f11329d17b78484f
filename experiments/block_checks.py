"""The choices of the FP8/FP4 recipes, predicted and verified on one layer.

Each row of `CHOICES` is one choice a recipe makes about the GEMMs of a
dense layer (`lowprec.ops.ScaledDense`): the operator configured with that
choice alone, the policy, which recipes make it, and what
`lowprec.audit.predict` says it does to the mean gradient against the
reference (the exact gradient of the forward as it ran). `run` verifies
each by Monte Carlo (`lowprec.audit.verify`, the forward held fixed) and
measures the Hadamard transform's effect on the variance; `markdown` is the
table of docs/block_scaled.md (`python -m scripts.block_checks`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowprec import audit, scaled
from lowprec.backward.ops import Rounding, ScaledDense

RECIPE = "sdense.in@dw=requantized,sdense.kernel@dx=requantized"
REUSE = "sdense.in@dw=rounded,sdense.kernel@dx=rounded"
REQ_X = "sdense.in@dw=requantized,sdense.kernel@dx=rounded"
REQ_W = "sdense.in@dw=rounded,sdense.kernel@dx=requantized"

# Stochastic rounding onto MXFP4 elements in 16-element blocks with scales
# rounded up: nothing clips, so it is unbiased (NVFP4's nearest E4M3
# scales clip a block's largest values about half the time).
SR16 = Rounding(
  scaled.get_scaled_format("mxfp4_e2m1", rule="noclip", block=16),
  "stochastic",
)


@dataclasses.dataclass(frozen=True)
class Choice:
  """One recipe choice on one operator, with its predicted verdict."""

  name: str
  recipes: str  # which recipes make it
  op: ScaledDense
  policy: str
  use: str  # the use (or "gradients") the choice is about
  predicted: str  # for that use, or for the whole policy ("gradients")


CHOICES = (
  Choice(
    "W in 16x16 tiles; the data gradient reads its copy", "NVFP4",
    ScaledDense.nvfp4(grad=None, grad_dw=None, hadamard=0), REQ_W,
    "sdense.kernel@dx", "exact",
  ),
  Choice(
    "W in 1x16 blocks, re-quantized along N", "NVFP4 1D ablation",
    ScaledDense.nvfp4(grad=None, grad_dw=None, hadamard=0,
                      kernel_blocks="1d"),
    REQ_W, "sdense.kernel@dx", "biased",
  ),
  Choice(
    "W in 1x32 blocks, re-quantized along N (two copies)", "MXFP8",
    ScaledDense.mxfp8(grad=None, grad_dw=None), REQ_W, "sdense.kernel@dx",
    "biased",
  ),
  Choice(
    "the same with OCP floor scales", "MXFP8 (OCP)",
    ScaledDense.mxfp8(rule="ocp", grad=None, grad_dw=None), REQ_W,
    "sdense.kernel@dx", "biased",
  ),
  Choice(
    "x re-quantized along M (tokens), nearest", "NVFP4, MXFP8",
    ScaledDense.nvfp4(grad=None, grad_dw=None, hadamard=0), REQ_X,
    "sdense.in@dw", "biased",
  ),
  Choice(
    "x kept unrounded, SR re-quantized along M (rounded-up scales)",
    "Quartet-style backward",
    ScaledDense(x_dw=SR16), REQ_X, "sdense.in@dw", "unbiased",
  ),
  Choice(
    "x rounded in the forward, SR re-quantized along M", "-",
    ScaledDense(x="nvfp4", x_dw=SR16), REQ_X, "sdense.in@dw", "biased",
  ),
  Choice(
    "gradients rounded to nearest (NVFP4 blocks)", "NVFP4 nearest ablation",
    ScaledDense(grad="nvfp4", grad_dw="nvfp4"), REUSE, "gradients",
    "biased",
  ),
  Choice(
    "gradients rounded to nearest (MXFP8, floor scales)", "MXFP8 (OCP)",
    ScaledDense.mxfp8(rule="ocp", x=None, kernel=None), REUSE, "gradients",
    "biased",
  ),
  Choice(
    "gradients SR onto NVFP4 (nearest E4M3 scales clip)", "NVFP4",
    ScaledDense(grad="nvfp4:stochastic", grad_dw="nvfp4:stochastic"), REUSE,
    "gradients", "biased",
  ),
  Choice(
    "gradients SR, rounded-up scales", "MXFP4 noclip, 16-blocks",
    ScaledDense(grad=SR16, grad_dw=SR16), REUSE, "gradients", "unbiased",
  ),
  Choice(
    "random Hadamard (16) on the weight gradient's inputs, SR, rounded-up "
    "scales", "MXFP4 noclip, 16-blocks",
    ScaledDense(grad_dw=SR16, x_dw=SR16, hadamard=16), REQ_X, "gradients",
    "unbiased",
  ),
  Choice(
    "the same without the Hadamard transform", "MXFP4 noclip, 16-blocks",
    ScaledDense(grad_dw=SR16, x_dw=SR16), REQ_X, "gradients", "unbiased",
  ),
)  # fmt: skip


def inputs(seed: int = 0, rows: int = 128, k: int = 32, n: int = 32):
  """`(x, W, b)`: x standard normal with every 16th row 20x larger (the
  outliers a Hadamard transform spreads), W normal * 0.1, b zero."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, k))
  x[::16] *= 20.0
  w = 0.1 * rng.standard_normal((k, n))
  return jnp.float32(x), jnp.float32(w), jnp.zeros(n, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Checked:
  choice: Choice
  verification: audit.Verification
  verdict: str  # measured, for `choice.use` (or the whole policy)
  predicted: str  # audit.predict's, as verify states it
  estimate: audit.Estimate  # the strongest of the row
  rms_error: float  # rms |g - reference| / |reference| of one draw

  @property
  def agrees(self) -> bool:
    return (self.predicted == "biased") == (self.verdict == "biased")


def check(
  choice: Choice, n_forward: int, key, data=None, rms: bool = True
) -> Checked:
  """Predicts and verifies one choice (`n_forward` forward draws); `rms`:
  also measures the error of one draw (`rms_error`, else NaN)."""
  data = inputs() if data is None else data
  v = audit.verify(choice.op, choice.policy, data, n_forward, 1, key)
  if choice.use == "gradients":
    ests, verdict, predicted = v.total, v.total_verdict, v.total_predicted
  else:
    u = v[choice.use]
    c = u.check(u.value)
    ests, verdict, predicted = c.estimates, c.verdict, c.predicted
  top = max(ests, key=lambda e: (e.deterministic, abs(e.z), abs(e.bias)))
  err = rms_error(choice, data) if rms else float("nan")
  return Checked(choice, v, verdict, predicted, top, err)


def rms_error(choice: Choice, data, draws: int = 256) -> float:
  """Root-mean-square error of one draw of a gradient against the
  reference gradient, relative to the reference's norm, over `draws`
  keys (a deterministic bias and the noise alike); the larger of the
  input's and the kernel's."""
  x, w, b = data
  c = jax.random.normal(jax.random.key(3), (x.shape[0], w.shape[1]))
  op = choice.op

  def grad(o, pol, k):
    f = lambda x, w: jnp.sum(c * o(x, w, b, policy=pol, key=k))
    return jax.grad(f, (0, 1))(x, w)

  ref_op = op.without_grad_rounding()
  keys = jax.random.split(jax.random.key(4), draws)
  g = jax.vmap(lambda k: grad(op, choice.policy, k))(keys)
  r = jax.vmap(lambda k: grad(ref_op, REUSE, k))(keys)
  errs = [
    jnp.sqrt(jnp.sum((a - e) ** 2) / jnp.sum(e**2))
    for a, e in zip(g, r, strict=True)
  ]
  return float(max(errs))


def run(n_forward: int = 1024, seed: int = 0) -> list[Checked]:
  key = jax.random.key(seed)
  return [
    check(c, n_forward, jax.random.fold_in(key, i))
    for i, c in enumerate(CHOICES)
  ]


def markdown(rows: list[Checked]) -> str:
  head = ("recipe choice", "recipes", "use", "predicted", "verified",
          "rel. bias", "z", "rms error of one draw")  # fmt: skip
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    e = r.estimate
    if e.exact:
      bias, z = "0 (exact)", "-"
    elif e.deterministic:
      bias, z = f"{e.bias:+.1e} (exact-different)", "-"
    else:
      bias, z = f"{e.bias:+.1e}", f"{e.z:+.1f}"
    mark = "" if r.agrees else " (MISMATCH)"
    lines.append(
      f"| {r.choice.name} | {r.choice.recipes} | {r.choice.use} | "
      f"{r.predicted} | {r.verdict}{mark} | {bias} | {z} | "
      f"{r.rms_error:.3f} |"
    )
  return "\n".join(lines)

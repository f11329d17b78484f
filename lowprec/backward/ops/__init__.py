"""Operators whose backward reads each saved tensor as a policy says.

Each operator is a frozen dataclass configured with one `Rounding` per saved
tensor (format, nearest or stochastic, per-tensor scaling) and `grad`, the
rounding of incoming gradients (the emulated FP8 backward: `float8_e5m2`,
stochastic, scaled). Calling it runs a `jax.custom_vjp` whose forward rounds
what it rounds and keeps only what the policy's reads need, narrow where it
can, and whose backward reads per use what the policy says:

  Dense        y = x~ W~ + b                  dense.in@dw, dense.kernel@dx
  NormDense    z = round(norm(x) g + b) W~ + c
               norm.out@dgain, norm.out@dw, norm.out@dx, dense.kernel@dx
  Attention    causal multi-head, P and O rounded
               attn.probs@dv, attn.probs@dscores, attn.out@delta
  Activation   h = f(x), x stored rounded     act.in@dact
  ScaledDense  y = Q(x) Q(W) + b, block-scaled data- and weight-gradient
               GEMMs (FP8/FP4 recipes)   sdense.in@dw, sdense.kernel@dx

Each carries its requirements table (`op.requirements`: use -> the value the
reference gradient reads, with the derivation) and `op.reference`, the forward
with straight-through roundings whose `jax.grad` is the reference gradient.
`REFERENCE` is the policy that reads, for every use of every operator, what
the reference reads.

Operators of your own: `Custom` builds one from a plain JAX forward whose
every backward read of a saved tensor goes through `read(use, t)`; its
requirements table is derived by `lowprec.audit.derive` (see
`docs/own_operators.md`).

Example:
  ```python
  fp8 = Rounding("float8_e4m3fn", "stochastic")
  op = Attention(probs=fp8, out=fp8, grad="float8_e5m2:stochastic")
  o = op(q, k, v, key=jax.random.key(0), policy=REFERENCE)
  ```
"""

from lowprec.backward.ops.activation import ACTIVATIONS, Activation, activation
from lowprec.backward.ops.attention import FRESH_OUT, Attention, attention
from lowprec.backward.ops.base import Op
from lowprec.backward.ops.custom import Custom, Reader
from lowprec.backward.ops.dense import Dense, dense
from lowprec.backward.ops.norm_dense import NORMS, NormDense, norm_dense
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.backward.ops.scaled_dense import ScaledDense, scaled_dense
from lowprec.backward.policy import Policy

OPS: dict[str, type[Op]] = {
  "dense": Dense,
  "norm_dense": NormDense,
  "attention": Attention,
  "activation": Activation,
  "scaled_dense": ScaledDense,
}

REFERENCE = Policy(
  tuple(
    dict.fromkeys((r.use, r.must_read) for op in OPS.values() for r in op.table)
  )
)

__all__ = [
  "ACTIVATIONS",
  "FRESH_OUT",
  "NORMS",
  "OPS",
  "REFERENCE",
  "Activation",
  "Attention",
  "Custom",
  "Dense",
  "NormDense",
  "Op",
  "Policy",
  "Reader",
  "Requirement",
  "Rounding",
  "ScaledDense",
  "activation",
  "attention",
  "dense",
  "norm_dense",
  "scaled_dense",
]

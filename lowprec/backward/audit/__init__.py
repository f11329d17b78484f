"""Predict, then verify by Monte Carlo, what a policy does to the mean gradient.

`predict(op, policy)` reads the operator's requirements table: for each use,
whether the value the policy reads is the one the reference gradient reads
(`exact`), an admissible substitute (`unbiased`), or neither (`biased`), and
whether reusing the forward's draw differs on average from an independent
copy.

`verify(op, policy, inputs, n_forward, n_backward, key)` measures the same
things on one operator, without training. It draws `n_forward` forward keys
and, for each, `n_backward` backward keys (fresh reads, gradient rounding).
Per forward key the forward runs once, and every variant's backward reads
its residuals, so the forward is held fixed exactly:

  reference      the must-read value for every use, no gradient rounding
                 (checked against `jax.grad` of the straight-through
                 forward: `reference_error`);
  use u as v     every use reads its reference value except u, which reads
                 v; for every use and every value, so the bias is attributed
                 to one use and the whole requirements table is checked;
  reuse vs copy  u read as `rounded` minus u read as an independent copy;
  total          the whole policy.

Gradients flow from a fixed loss of the output. The default,
`0.5 |y - y0|^2 + <c, y>` with `y0` the output with rounding off and `c`
along `y0` with the norm of one draw's rounding error, makes the downstream
gradient depend on the forward's draw (so reuse shows) and have a nonzero
mean (so a deterministic error shows).

For each variant and each input's gradient, the per-forward differences
`d_f` from the reference (averaged over the backward draws) are tested for
mean zero by a split-sample projection: the first half of the forward draws
estimates the direction `u` of the mean, the second half gives
`t_f = <d_f, u> / |u|`, and `z = mean(t) / se(t)` is standard normal under
no bias, whatever `u` is. Biases and standard errors are reported relative
to the root-mean-square norm of the reference gradient. A difference that is
zero for every draw is `exact`; one that is the same nonzero value for every
draw (no spread: a deterministic bias, as under nearest rounding) is
`biased` and reported as exact-different, with no z (there is no standard
error to divide by); `|z| >= z_threshold` is `biased`; otherwise
`unbiased`. With stochastic gradient rounding nothing is exact, so `exact`
predictions are compared as `unbiased`.

Example:
  ```python
  fp8 = ops.Rounding("float8_e4m3fn", "stochastic")
  op = ops.Attention(probs=fp8, out=fp8)
  pol = "attn.probs@.*=rounded,attn.out@delta=rounded"  # reuse
  print(predict(op, pol))
  v = verify(op, pol, (q, k, v), 512, 1, jax.random.key(0))
  v.agrees, print(v)
  ```

Reference: "Backward-State Policy Is Part of the Learning Algorithm" (2026).
"""

from lowprec.backward.audit.derive import Derivation, Evidence, derive
from lowprec.backward.audit.predict import Prediction, UsePrediction, predict
from lowprec.backward.audit.report import ROUNDOFF, Estimate
from lowprec.backward.audit.verify import (
  UseVerification,
  ValueCheck,
  Verification,
  default_loss,
  verify,
)

__all__ = [
  "ROUNDOFF",
  "Derivation",
  "Estimate",
  "Evidence",
  "Prediction",
  "UsePrediction",
  "UseVerification",
  "ValueCheck",
  "Verification",
  "default_loss",
  "derive",
  "predict",
  "verify",
]

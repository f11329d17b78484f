"""The independent copy of attention's output that a reuse test compares.

`attn.out@delta=fresh` reads `Q_s(P~' V)`: the probabilities' rounding and
the output's rounding both drawn anew. Checked by Monte Carlo against the
forward's own `O~ = Q(P~ V)` (seed-fixed keys, 4096 draws of each, on one
8-token, 2-head input): per-element means and variances agree within 5
standard errors, and the copy is uncorrelated with the forward's draw. The
same checks reject the copy that redraws only the output's rounding
(`fresh_out="output"`), whose variance is smaller.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowprec import audit, ops
from lowprec.ops import saved

SR8 = ops.Rounding("float8_e4m3fn", "stochastic")
RN8 = ops.Rounding("float8_e4m3fn", "nearest")
SR4 = ops.Rounding("float4_e2m1fn", "stochastic")
N = 4096  # draws of the forward's output and of the copy each
SIGMA = 5.0  # per-element tolerance in standard errors


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return tuple(
    rng.standard_normal((1, 8, 2, 8)).astype(np.float32) for _ in range(3)
  )


def _probs(q, k):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
  mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
  return jax.nn.softmax(jnp.where(mask, s, -jnp.inf), -1)


def _draws(op, inputs):
  """`(O~, copy)` for N forward keys, the copy drawn with each forward
  key's own backward key (as the operator derives it)."""
  q, k, v = inputs
  p = _probs(q, k)
  keys = jax.random.split(jax.random.key(7), N)

  def one(kf):
    out = op(q, k, v, key=kf)
    copy = op._output_copy(p, v, saved.key_for(kf, "backward"))
    return out, copy

  out, copy = jax.jit(jax.vmap(one))(keys)
  return np.asarray(out, np.float64), np.asarray(copy, np.float64)


def _moments_z(a, b):
  """Per-element z of the difference of means and of variances."""
  ma, mb = a.mean(0), b.mean(0)
  va, vb = a.var(0, ddof=1), b.var(0, ddof=1)
  z_mean = (ma - mb) / np.sqrt((va + vb) / len(a) + 1e-300)
  # The standard error of a sample variance: sqrt((m4 - var^2) / n).
  m4a = ((a - ma) ** 4).mean(0)
  m4b = ((b - mb) ** 4).mean(0)
  se_var = np.sqrt((m4a - va**2) / len(a) + (m4b - vb**2) / len(b) + 1e-300)
  return z_mean, (va - vb) / se_var, va, vb


@pytest.mark.parametrize("fmt", [SR8, SR4], ids=["e4m3", "e2m1"])
def test_copy_has_the_distribution_of_the_reused_output(fmt):
  op = ops.Attention(probs=fmt, out=fmt)
  out, copy = _draws(op, _inputs())
  z_mean, z_var, va, vb = _moments_z(out, copy)
  assert np.all(va > 0)  # every element is random
  assert np.max(np.abs(z_mean)) < SIGMA
  assert np.max(np.abs(z_var)) < SIGMA
  # Independent of the forward's draw: per-element correlation across draws
  # within 5 / sqrt(N) of zero.
  da, db = out - out.mean(0), copy - copy.mean(0)
  corr = (da * db).mean(0) / np.sqrt(va * vb)
  assert np.max(np.abs(corr)) < SIGMA / np.sqrt(N)


def test_the_output_only_copy_has_less_variance_and_the_test_sees_it():
  op = ops.Attention(probs=SR4, out=SR4, fresh_out="output")
  out, copy = _draws(op, _inputs())
  z_mean, z_var, va, vb = _moments_z(out, copy)
  assert np.max(np.abs(z_mean)) < SIGMA  # the same mean, P V
  assert np.max(z_var) > 3 * SIGMA  # ... but visibly less variance
  assert np.median(vb / va) < 0.9


def _reads(value):
  return ops.REFERENCE.override(f"attn.out@delta={value}")


def test_predictions_follow_what_the_copy_draws():
  out = "attn.out@delta"
  sr = audit.predict(ops.Attention(probs=SR8, out=SR8), _reads("fresh"))
  assert sr[out].verdict == "unbiased"
  assert sr[out].admissible == ("original", "fresh")
  assert sr[out].reuse_differs is True
  # Nearest probabilities: the redrawn copy keeps their rounding, so its
  # mean is RN(P) V, not P V; only the output-only copy is unbiased.
  rn = ops.Attention(probs=RN8, out=SR8)
  assert audit.predict(rn, _reads("fresh"))[out].verdict == "biased"
  assert rn.copy_value("out") == "fresh"
  old = ops.Attention(probs=RN8, out=SR8, fresh_out="output")
  assert audit.predict(old, _reads("fresh"))[out].verdict == "unbiased"
  # The output-only copy is not from O~'s distribution: no reuse test.
  assert old.copy_value("out") is None
  assert audit.predict(old, _reads("rounded"))[out].reuse_differs is None
  # Unrounded output, stochastic probabilities: O~ = P~ V; the copy is
  # P~' V, unbiased; reading P V is exact.
  probs_only = ops.Attention(probs=SR8)
  p = audit.predict(probs_only, _reads("fresh"))
  assert p[out].verdict == "unbiased"
  assert p[out].reuse_differs is True
  # Nearest output of stochastic probabilities: no value reads a copy.
  assert ops.Attention(probs=SR8, out=RN8).copy_value("out") is None


@pytest.mark.parametrize(
  "config",
  [
    dict(probs=SR8, out=SR8),
    dict(probs=RN8, out=SR8),
    dict(probs=RN8, out=SR8, fresh_out="output"),
    dict(probs=SR8),
  ],
  ids=["sr-sr", "rn-sr", "rn-sr-output", "sr-none"],
)
def test_verification_agrees_with_the_prediction(config):
  # 512 forward draws x 1 backward draw, biased when |z| >= 4.
  op = ops.Attention(**config)
  pol = "attn.probs@dv=rounded,attn.probs@dscores=original,attn.out@delta=fresh"
  v = audit.verify(op, pol, _inputs(), 512, 1, jax.random.key(0))
  assert v.agrees, str(v)


def test_fresh_out_must_be_known():
  with pytest.raises(ValueError, match="fresh_out.*redraw, output"):
    ops.Attention(probs=SR8, fresh_out="probs")


def test_output_only_copy_is_the_earlier_fresh_read_bit_for_bit():
  # fresh_out="output" reads Q_s(P V) with the key the earlier fresh read
  # used, derive(backward_key, "attn.out@delta"): runs that used it keep
  # their bits.
  q, k, v = _inputs()
  op = ops.Attention(probs=SR8, out=SR8, fresh_out="output")
  bkey = jax.random.key(3)
  p = _probs(q, k)
  want = SR8.round(
    jnp.einsum("bhqk,bkhd->bqhd", p, v),
    saved.key_for(bkey, "attn.out@delta"),
    mode="stochastic",
  )[0]
  np.testing.assert_array_equal(op._output_copy(p, v, bkey), want)

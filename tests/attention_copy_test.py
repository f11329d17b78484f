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

import lowprec
from lowprec import audit, ops
from lowprec.backward.ops import saved

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


# Block-scaled saved tensors: 32 keys (the probabilities' blocks) and a
# width of 2 heads x 16 = 32 (the output's blocks; head_dim 16 alone is
# shorter than a block, as in the CPU-scale GPT).
MX4 = "mxfp4_e2m1"
SRMX = ops.Rounding(MX4, "stochastic")


def _mx_inputs(seed=0):
  rng = np.random.default_rng(seed)
  return tuple(
    rng.standard_normal((1, 32, 2, 16)).astype(np.float32) for _ in range(3)
  )


def _by_width(f, o):
  """`f` applied to `o[b, q, h, d]` as `[b, q, h * d]`."""
  return f(o.reshape(*o.shape[:2], -1)).reshape(o.shape)


@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_mx_saved_tensors_are_rounded_with_block_scales(mode):
  # Oracle: lowprec.scaled.fake_quantize with the operator's own keys, on
  # the probabilities (blocks of 32 keys) and on P~ V (blocks of the width).
  q, k, v = _mx_inputs()
  key = jax.random.key(5)
  op = ops.Attention(probs=f"{MX4}:{mode}", out=f"{MX4}:{mode}")
  sr = mode == "stochastic"
  kp, ko = (saved.key_for(key, t) if sr else None for t in ("probs", "out"))
  p = _probs(q, k)
  pr = lowprec.scaled.fake_quantize(p, MX4, mode, kp)
  pv = jnp.einsum("bhqk,bkhd->bqhd", pr, v)
  want = _by_width(lambda x: lowprec.scaled.fake_quantize(x, MX4, mode, ko), pv)
  got = op(q, k, v, key=key)
  # The operator's softmax may differ from jax.nn.softmax in a last bit,
  # moving a rare element to the next grid value: nearly all are equal
  # (all of them here, on an AVX2 CPU).
  assert np.mean(np.asarray(got) == np.asarray(want)) > 0.99
  # Per-tensor e2m1 on the same values is another grid: MX is what ran.
  tensor = ops.Rounding("float4_e2m1fn", mode).round(pv, ko)[0]
  assert np.mean(np.asarray(got) == np.asarray(tensor)) < 0.5  # 7-8% here
  # The backward keeps the elements and the E8M0 block scales.
  values = op.resolve(_reads("rounded"))
  _, res = op._forward(values, (q, k, v), op._keys(values, key, None))
  stored_p, stored_o = res["probs"]["rounded"], res["out"]["rounded"]
  assert stored_p.quantized.scales.block.shape == (1, 2, 32, 1)
  assert stored_o.quantized.scales.block.shape == (1, 32, 1)
  assert stored_o.quantized.scales.block.dtype == jnp.float8_e8m0fnu
  np.testing.assert_array_equal(
    stored_o.value().reshape(got.shape), np.asarray(got)
  )


def test_mx_copies_recompute_their_scales_from_what_they_round():
  # The output-only copy rounds P V with P V's block scales; a nearest
  # read of P V gives the same block grid.
  q, k, v = _mx_inputs()
  bkey = jax.random.key(3)
  p = _probs(q, k)
  pv = jnp.einsum("bhqk,bkhd->bqhd", p, v)
  op = ops.Attention(probs=SRMX, out=SRMX, fresh_out="output")
  want = _by_width(
    lambda x: lowprec.scaled.fake_quantize(
      x, MX4, "stochastic", saved.key_for(bkey, "attn.out@delta")
    ),
    pv,
  )
  np.testing.assert_array_equal(op._output_copy(p, v, bkey), want)


def test_mx_copy_has_the_distribution_of_the_reused_output():
  # As test_copy_has_the_distribution_of_the_reused_output, in mxfp4_e2m1:
  # each rounding's block scales come from its own values, so the redraw
  # is the forward's map on a new draw (the same law, saturation included).
  op = ops.Attention(probs=SRMX, out=SRMX)
  out, copy = _draws(op, _mx_inputs())
  z_mean, z_var, va, vb = _moments_z(out, copy)
  random = va > 0
  assert np.mean(random) > 0.9
  assert np.max(np.abs(z_mean[random])) < SIGMA
  assert np.max(np.abs(z_var[random])) < SIGMA

"""Predictions from the requirements tables, then Monte Carlo verification.

Canonical single-operator checks: each expectation is first stated as a
prediction (from the requirements table alone), then verified by sampling.
Verdicts use `verify`'s default split-sample z-test, biased when |z| >= 4;
the biased cells below are asserted at |z| >= 8, the unbiased ones must stay
under 4. Inputs are drawn with numpy seeds 0..4, draws with the stated
`jax.random.key`; sample sizes are given at each call.
"""

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

from lowprec import audit, ops
from lowprec.backward.audit import report as audit_report
from lowprec.backward.ops.requirements import Requirement

SR8 = ops.Rounding("float8_e4m3fn", "stochastic")
RN8 = ops.Rounding("float8_e4m3fn", "nearest")
E5 = ops.Rounding("float8_e5m2", "stochastic")
Z = 4.0  # verify's threshold
STRONG = 8.0  # what the canonical biased cells must reach


def _normal(seed, shape, scale=1.0, shift=0.0):
  rng = np.random.default_rng(seed)
  return (shift + scale * rng.standard_normal(shape)).astype(np.float32)


ATTN = ops.Attention(probs=SR8, out=SR8, grad=E5)  # emulated FP8 backward
ATTN_IN = tuple(_normal(i, (1, 8, 2, 8)) for i in range(3))
NORM = ops.NormDense(out=SR8, kernel=RN8)
NORM_IN = (
  _normal(0, (8, 16)),
  _normal(1, (16,), 0.1, 1.0),
  _normal(2, (16,), 0.1),
  _normal(3, (16, 8), 0.25),
  np.zeros(8, np.float32),
)
DENSE = ops.Dense(x=SR8, kernel=RN8)
DENSE_IN = (_normal(0, (8, 16)), _normal(3, (16, 8), 0.25), None)

REUSE = (
  "attn.probs@dv=rounded,attn.probs@dscores=rounded,attn.out@delta=rounded"
)
FRESH = "attn.probs@dv=rounded,attn.probs@dscores=fresh,attn.out@delta=fresh"
NORM_ORIGINAL = "norm.out@.*=original,dense.kernel@dx=rounded"
NORM_ROUNDED = (
  "norm.out@(dgain|dw)=rounded,norm.out@dx=original,dense.kernel@dx=rounded"
)
NORM_PER_USE = (
  "norm.out@dw=rounded,norm.out@.*=original,dense.kernel@dx=rounded"
)


def _verdicts(p):
  return {u.use: u.verdict for u in p.uses}


# ---- predictions -------------------------------------------------------------


def test_predict_attention():
  reuse = audit.predict(ATTN, REUSE)
  assert _verdicts(reuse) == {
    "attn.probs@dv": "exact",
    "attn.probs@dscores": "biased",
    "attn.out@delta": "biased",
  }
  assert _verdicts(audit.predict(ATTN, FRESH)) == {
    "attn.probs@dv": "exact",
    "attn.probs@dscores": "unbiased",
    "attn.out@delta": "unbiased",
  }
  assert all(u.reuse_differs for u in reuse.uses)
  assert reuse["attn.probs@dscores"].admissible == ("original", "fresh")
  assert reuse["attn.probs@dv"].admissible == ("rounded",)


def test_predict_norm_dense():
  assert audit.predict(NORM, NORM_ORIGINAL).biased == ("norm.out@dw",)
  assert audit.predict(NORM, NORM_ROUNDED).biased == ("norm.out@dgain",)
  assert audit.predict(NORM, NORM_PER_USE).biased == ()
  assert audit.predict(NORM, ops.REFERENCE).biased == ()


def test_predict_dense_and_activation():
  p = audit.predict(DENSE, ".*=rounded")
  assert _verdicts(p) == {"dense.in@dw": "exact", "dense.kernel@dx": "exact"}
  assert p["dense.in@dw"].reuse_differs
  assert not p["dense.kernel@dx"].reuse_differs  # nearest: copy == reuse
  act = audit.predict(ops.Activation(x=SR8), "act.in@dact=fresh")
  assert act.biased == ("act.in@dact",)  # f' is nonlinear
  assert not act["act.in@dact"].reuse_differs  # stored only


def test_predict_depends_on_how_the_tensor_was_rounded():
  nearest = ops.NormDense(out=RN8, kernel=RN8)
  p = audit.predict(nearest, {"norm.out@dw": "nearest", ".*": "original"})
  assert p["norm.out@dw"].verdict == "exact"  # rounded == nearest under RN
  unrounded = ops.NormDense()
  assert audit.predict(unrounded, ".*=fresh").biased == ()
  # Rounded probabilities make the rounded output differ from P V even when
  # the output itself is not rounded.
  probs_only = ops.Attention(probs=SR8)
  p = audit.predict(probs_only, ".*=rounded")
  assert p["attn.out@delta"].verdict == "biased"
  assert p["attn.out@delta"].admissible == ("original", "fresh", "nearest")


# ---- verification of the canonical cases -------------------------------------


def _check(v, expected):
  """Verdicts as expected, prediction == verification, margins as stated."""
  assert v.agrees, str(v)
  assert v.reference_error < 1e-4, str(v)
  for use, verdict in expected.items():
    u = v[use]
    assert u.verdict == verdict, str(v)
    top = max(abs(e.z) for e in u.check(u.value).estimates)
    if verdict == "biased":
      assert top >= STRONG, str(v)
    else:
      assert top < Z, str(v)


def test_attention_reusing_rounded_probs_or_output_is_biased():
  # 2048 forward draws x 1 backward draw (e5m2 gradient rounding).
  v = audit.verify(ATTN, REUSE, ATTN_IN, 2048, 1, jax.random.key(0))
  _check(
    v,
    {
      "attn.probs@dscores": "biased",
      "attn.out@delta": "biased",
      "attn.probs@dv": "unbiased",
    },
  )
  assert v.total_verdict == "biased"
  # Reuse vs an independent copy from the same distribution: differs on
  # average for all three uses, as predicted.
  assert all(u.reuse_verdict for u in v.uses), str(v)


def test_attention_fresh_rounding_is_unbiased():
  v = audit.verify(ATTN, FRESH, ATTN_IN, 2048, 1, jax.random.key(1))
  _check(v, {"attn.probs@dscores": "unbiased", "attn.out@delta": "unbiased"})
  assert v.total_verdict == "unbiased"
  print(v)


@pytest.mark.parametrize(
  ("policy", "biased", "gradient"),
  [
    (NORM_ORIGINAL, "norm.out@dw", "kernel"),
    (NORM_ROUNDED, "norm.out@dgain", "gain"),
    (NORM_PER_USE, None, None),
  ],
  ids=["original_for_both", "rounded_for_both", "per_use"],
)
def test_norm_output_needs_original_for_gain_and_rounded_for_weight(
  policy, biased, gradient
):
  # 2048 forward draws; no backward randomness (no gradient rounding).
  v = audit.verify(NORM, policy, NORM_IN, 2048, 1, jax.random.key(2))
  expected = {u: "exact" for u in NORM.uses}
  if biased:
    expected[biased] = "biased"
    est = {e.gradient: e for e in v[biased].check(v[biased].value).estimates}
    assert abs(est[gradient].z) >= STRONG, str(v)
    assert all(e.exact for g, e in est.items() if g != gradient), str(v)
  _check(v, expected)
  assert v.total_verdict == ("biased" if biased else "exact")


def test_dense_kernel_gradient_reading_the_rounded_input_is_exact():
  v = audit.verify(DENSE, ".*=rounded", DENSE_IN, 1024, 1, jax.random.key(3))
  _check(v, {"dense.in@dw": "exact", "dense.kernel@dx": "exact"})
  # The other values of dense.in@dw are biased; reuse differs from a copy.
  for value in ("original", "fresh", "nearest"):
    assert v["dense.in@dw"].check(value).verdict == "biased", str(v)
  assert v["dense.in@dw"].reuse_verdict


def test_verify_catches_a_wrong_requirements_table():
  # A table claiming the kernel gradient needs the original input: the
  # reference it implies is not autodiff of the forward, and verify says so.
  wrong = dataclasses.replace(DENSE.table[0], must_read="original")

  @dataclasses.dataclass(frozen=True)
  class WrongDense(ops.Dense):
    table = (wrong, DENSE.table[1])

  v = audit.verify(
    WrongDense(x=SR8, kernel=RN8),
    ".*=rounded",
    DENSE_IN,
    64,
    1,
    jax.random.key(3),
  )
  assert v.reference_error > 1e-3


# ---- the built-in tables against autodiff of the forward ---------------------
# Each row's `must_read` is checked on its own: with every saved tensor
# rounded stochastically, reading what the table says must reproduce
# `jax.grad` of the straight-through forward (`op.reference`) to float32
# roundoff, and flipping any one row must move it far beyond that.

TABLES = {
  "dense": (ops.Dense(x=SR8, kernel=SR8), DENSE_IN),
  "norm_dense": (ops.NormDense(out=SR8, kernel=SR8), NORM_IN),
  "attention": (ops.Attention(probs=SR8, out=SR8), ATTN_IN),
  "activation": (ops.Activation("gelu", x=SR8), (_normal(0, (8, 16), 2.0),)),
  "scaled_dense": (
    ops.ScaledDense(x="nvfp4:stochastic", kernel="mxfp8_e4m3:stochastic"),
    (_normal(0, (16, 32)), _normal(1, (32, 32), 0.2), _normal(2, (32,))),
  ),
}
FLIPPED = 1e-3  # the smallest effect of one flipped row here is 6e-3
KEY = jax.random.key(5)  # the forward draws


def _grads(op, inputs, fn):
  """Gradients of `<c, fn(*inputs)>` (c normal, numpy seed 9) with respect
  to the inputs present, jitted."""
  present = [i for i, x in enumerate(inputs) if x is not None]
  c = _normal(9, jax.eval_shape(lambda: op.reference(*inputs, key=KEY)).shape)

  def loss(*args):
    full = list(inputs)
    for i, a in zip(present, args, strict=True):
      full[i] = a
    return (c * fn(*full)).sum()

  argnums = tuple(range(len(present)))
  return jax.jit(jax.grad(loss, argnums))(*(inputs[i] for i in present))


@functools.cache
def _autodiff(name):
  """`jax.grad` of the straight-through forward: no table involved."""
  op, inputs = TABLES[name]
  return _grads(op, inputs, lambda *a: op.reference(*a, key=KEY))


def _table_error(name, op):
  """max |grad reading what `op`'s table says - autodiff| / max |autodiff|."""
  inputs = TABLES[name][1]
  got = _grads(
    op, inputs, lambda *a: op(*a, policy=op.reference_policy, key=KEY)
  )
  want = _autodiff(name)
  top = max(float(np.abs(w).max()) for w in want)
  err = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
  return err / (top or 1.0)


def _flip(op, i):
  """`op` with row `i` of its table reading the other value."""
  row = op.table[i]
  other = "original" if row.must_read == "rounded" else "rounded"
  table = (
    *op.table[:i],
    dataclasses.replace(row, must_read=other),
    *op.table[i + 1 :],
  )
  flipped = type(f"Flipped{type(op).__name__}", (type(op),), {"table": table})
  return flipped(
    **{f.name: getattr(op, f.name) for f in dataclasses.fields(op)}
  )


def test_every_builtin_operator_has_a_table_check():
  assert set(TABLES) == set(ops.OPS)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_builtin_table_reproduces_autodiff_of_the_forward(name):
  assert _table_error(name, TABLES[name][0]) <= audit.ROUNDOFF


# One flipped row in the default run (the activation's); every other row
# with `-m slow` (each compiles its own backward).
FLIPS = [
  pytest.param(
    n,
    i,
    id=TABLES[n][0].table[i].use,
    marks=() if (n, i) == ("activation", 0) else pytest.mark.slow,
  )
  for n in sorted(TABLES)
  for i in range(len(TABLES[n][0].table))
]


@pytest.mark.parametrize("name, i", FLIPS)
def test_a_flipped_row_of_a_builtin_table_is_caught(name, i):
  """The check above can fail: each row, flipped alone, moves the
  gradient by more than `FLIPPED` relative."""
  assert _table_error(name, _flip(TABLES[name][0], i)) > FLIPPED


@pytest.mark.slow
def test_activation_storage_only_rounding():
  # 8192 forward draws: the Jensen bias of f'(x~) is small.
  op = ops.Activation("gelu", x=SR8)
  v = audit.verify(
    op,
    "act.in@dact=fresh",
    (_normal(0, (8, 16), 2.0),),
    8192,
    1,
    jax.random.key(4),
  )
  assert v.agrees, str(v)
  assert v["act.in@dact"].verdict == "biased"
  assert v["act.in@dact"].reuse_verdict is False


def test_report_and_bad_input():
  p = audit.predict(NORM, NORM_PER_USE)
  assert "norm.out@dgain" in str(p)
  with pytest.raises(ValueError, match="n_forward >= 4"):
    audit.verify(NORM, NORM_PER_USE, NORM_IN, 2, 1, jax.random.key(0))
  with pytest.raises(TypeError, match="expected an operator"):
    audit.predict("attention", REUSE)
  with pytest.raises(ValueError, match="no rule for use"):
    audit.predict(ATTN, "attn.probs@dv=rounded")
  assert isinstance(NORM.table[0], Requirement)


# ---- deterministic differences: exact-different, never a z -----------------


def test_a_constant_nonzero_difference_is_exact_different_without_a_z():
  # Oracle by hand: 32 draws of the same difference c along 10 coordinates
  # project to |c| * sqrt(10) on the first half's direction (which is c's
  # own, so the projection is positive whatever the sign of c).
  c = np.full((32, 10), 0.3)
  rng = np.random.default_rng(0)
  jitter = 1e-9 * rng.standard_normal(c.shape)  # float32 roundoff, 1e-8 rel
  for d in (c, c + jitter, -c):
    with np.errstate(all="raise"):  # no division by a zero spread
      e = audit_report.estimate("w", d, 2.0)
    assert e.deterministic and not e.exact
    assert e.se == 0.0 and e.z == math.inf
    assert e.bias == pytest.approx(0.3 * math.sqrt(10) / 2)
    assert e.biased(1e300)  # at any threshold
    assert audit_report.fmt_z(e) == "-"
    assert "exact-different" in audit_report.fmt_bias(e)
  # A spread above roundoff gets its z, computed as the docstring says.
  noisy = c + 0.05 * rng.standard_normal(c.shape)
  e = audit_report.estimate("w", noisy, 1.0)
  u = noisy[:16].mean(0)
  t = noisy[16:] @ (u / np.linalg.norm(u))
  assert not e.deterministic
  assert e.z == pytest.approx(t.mean() / (t.std(ddof=1) / 4.0))
  # A difference that is all zero is exact, not exact-different.
  assert audit_report.estimate("w", np.zeros((8, 3)), 1.0).exact


def test_nearest_forward_reports_a_deterministic_bias_without_a_z():
  # Nearest rounding: every forward draw is the same, so reading the
  # original where the weight gradient needs the rounded value is off by
  # one fixed amount. It is biased, printed as exact-different, no z.
  op = ops.NormDense(out=RN8, kernel=RN8)
  v = audit.verify(op, NORM_ORIGINAL, NORM_IN, 16, 1, jax.random.key(2))
  assert v.agrees and v["norm.out@dw"].verdict == "biased", str(v)
  (est,) = [
    e for e in v["norm.out@dw"].check("original").estimates if not e.exact
  ]
  assert est.gradient == "kernel" and est.deterministic and est.se == 0.0
  report = str(v)
  row = next(r for r in report.splitlines() if r.startswith("| norm.out@dw |"))
  assert "(exact-different) | - |" in row, row
  assert "biased -> biased (exact-different)" in report
  assert "inf" not in report and "e+0" not in report.split("\n\n", 1)[1]

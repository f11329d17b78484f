"""Operators of your own: derived requirements tables, verified per use.

Each operator is a plain JAX forward reading its saved tensors through
`read`. Its table is derived by `audit.derive` (deterministic checks on 4
forward draws, exact up to float32 reassociation), then checked by Monte
Carlo (`audit.verify`, split-sample z-test, biased when |z| >= 4; sample
sizes at each call).
Inputs come from numpy seeds 0..4; draws from the stated `jax.random.key`.
Independent oracles: `jax.grad` of the plain (unrounded) forward, and
gradients written out by hand in float64 numpy.
"""

import contextlib
import functools
import io
import math
import os
import re

import flax.linen as fnn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from experiments import swiglu
from lowprec import audit, nn, ops, policy
from lowprec.backward.policy import Policy

SR8 = ops.Rounding("float8_e4m3fn", "stochastic")
RN8 = ops.Rounding("float8_e4m3fn", "nearest")
# gelu's curvature bias (the Jensen term of a stored-only read) is small:
# tensors read that way are stored in e5m2, and checked with 1024 draws.
E5 = ops.Rounding("float8_e5m2", "stochastic")


def _normal(seed, shape, scale=1.0, shift=0.0):
  rng = np.random.default_rng(seed)
  return (shift + scale * rng.standard_normal(shape)).astype(np.float32)


def _row(req):
  """What a table row says, without its free-text derivation."""
  return (req.use, req.must_read, req.linear, req.feeds, req.storage_only)


# ---- SwiGLU: the gate's activation output stored in float8 -------------------


swiglu_forward, swiglu_plain = swiglu.forward, swiglu.plain
SWIGLU = swiglu.operator(SR8)
SWIGLU_IN = (
  _normal(0, (8, 16)),
  _normal(1, (16, 32), 0.25),
  _normal(2, (16, 32), 0.25),
  _normal(3, (32, 16), 0.18),
)


@functools.cache
def _swiglu_derived():
  # 256 forward draws x 1 backward draw for the Monte Carlo check.
  return audit.derive(SWIGLU, SWIGLU_IN, jax.random.key(0), n_forward=256)


def test_swiglu_table_derived():
  d = _swiglu_derived()
  table = {r.use: r for r in d.table}
  # The activation's derivative is of silu evaluated before the rounding:
  # it must read the original. The down projection multiplied act~, so its
  # weight gradient must read the rounded value.
  assert _row(table["swiglu.act@dact"]) == (
    "swiglu.act@dact", "original", True, ("x", "w_gate"), False,
  )  # fmt: skip
  assert _row(table["swiglu.act@dw_down"]) == (
    "swiglu.act@dw_down", "rounded", True, ("x", "w_up", "w_down"), False,
  )  # fmt: skip
  # The table the benchmark declares without deriving is this one.
  assert tuple((r.use, r.must_read) for r in d.table) == swiglu.TABLE
  ev = {e.use: e for e in d.evidence}
  assert ev["swiglu.act@dact"].rounded > 1e-3  # reading rounded moves it
  assert ev["swiglu.act@dw_down"].original > 1e-3
  assert isinstance(d.op.table[0], ops.Requirement)  # the built-ins' type


def test_swiglu_prediction_equals_verification_for_every_use_and_value():
  d = _swiglu_derived()
  v = d.verification
  assert v.agrees, str(v)
  assert d.counts == (11, 11)  # 2 uses x 4 values, 2 reuse checks, total
  p = audit.predict(d.op, d.op.reference_policy)
  assert p["swiglu.act@dact"].admissible == ("original", "fresh")
  assert p["swiglu.act@dw_down"].admissible == ("rounded",)
  for use in d.op.uses:
    for value in d.op.values:
      c = v[use].check(value)
      assert (
        c.predicted
        == audit.predict(
          d.op, d.op.reference_policy.override(f"{use}={value}")
        )[use].verdict
      )
      assert c.agrees, (use, value, str(v))


def _swiglu_by_hand(x, wg, wu, wd, a_r, dy, dact_reads_rounded):
  """The reference gradient written out in float64 numpy."""
  x, wg, wu, wd, a_r, dy = (np.asarray(t, np.float64) for t in (
    x, wg, wu, wd, a_r, dy))  # fmt: skip
  g, u = x @ wg, x @ wu
  s = 1 / (1 + np.exp(-g))
  a = g * s
  dh = dy @ wd.T
  dwd = (a_r * u).T @ dy  # the down projection multiplied act~
  du = dh * a_r
  a_d = a_r if dact_reads_rounded else a
  dg = dh * u * (s + a_d * (1 - s))
  return x.T @ dg, x.T @ du, dwd, dg @ wg.T + du @ wu.T


def test_swiglu_gradients_match_float64_by_hand_and_jax_grad():
  op = ops.Custom(
    "swiglu", swiglu_forward, args=SWIGLU.args,
    saved={"swiglu.act": RN8}, uses=SWIGLU.uses,
  ).with_table(_swiglu_derived().table)  # fmt: skip
  x, wg, wu, wd = SWIGLU_IN
  a = np.asarray(jax.nn.silu(jnp.asarray(x) @ wg))
  s = np.float32(448) / np.max(np.abs(a))  # per-tensor scale
  a_r = (a * s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / s
  dy = _normal(4, (8, 16))

  @functools.partial(jax.jit, static_argnums=0)
  def grads(policy):
    y, pull = jax.vjp(lambda *t: op(*t, policy=policy), x, wg, wu, wd)
    return pull(jnp.asarray(dy))

  ref = grads(None)
  dwg, dwu, dwd, dx = _swiglu_by_hand(x, wg, wu, wd, a_r, dy, False)
  for got, want in zip(ref, (dx, dwg, dwu, dwd), strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
  # Reading the rounded value for the activation's derivative is what the
  # hand computation with a~ there gives, and not the reference.
  wrong = grads("swiglu.act@dact=rounded,swiglu.act@dw_down=rounded")
  _, _, _, dx_w = _swiglu_by_hand(x, wg, wu, wd, a_r, dy, True)
  np.testing.assert_allclose(wrong[0], dx_w, rtol=2e-4, atol=2e-5)
  assert np.max(np.abs(np.asarray(wrong[0]) - dx)) > 1e-3
  # With rounding off, the operator's gradient is jax.grad of the plain op.
  plain = jax.vjp(swiglu_plain, x, wg, wu, wd)[1](jnp.asarray(dy))
  off = op.unrounded()
  got = jax.vjp(lambda *t: off(*t), x, wg, wu, wd)[1](jnp.asarray(dy))
  for a_, b_ in zip(got, plain, strict=True):
    np.testing.assert_allclose(a_, b_, rtol=1e-5, atol=1e-6)


def test_swiglu_keeps_only_what_the_policy_reads():
  op = _swiglu_derived().op
  key = jax.random.key(3)
  _, res = op._forward(
    op.resolve(None), SWIGLU_IN, op._keys(op.resolve(None), key, None)
  )
  kept = res["kept"]["swiglu.act"]
  assert kept["rounded"].data.dtype == jnp.float8_e4m3fn
  assert "original" in kept  # swiglu.act@dact reads it
  values = op.resolve(".*=rounded")
  _, res = op._forward(values, SWIGLU_IN, op._keys(values, key, None))
  assert set(res["kept"]["swiglu.act"]) == {"rounded"}
  values = op.resolve(".*=original")
  _, res = op._forward(values, SWIGLU_IN, op._keys(values, key, None))
  assert set(res["kept"]["swiglu.act"]) == {"original"}


# ---- rotary embeddings -------------------------------------------------------


def _rotate(x):
  """Rotary position embedding of `x[length, dim]` (pairs of halves)."""
  t, d = x.shape
  inv = 1.0 / (10000 ** (np.arange(d // 2) / (d // 2)))
  ang = np.arange(t)[:, None] * inv[None]
  cos, sin = (
    jnp.asarray(np.cos(ang), x.dtype),
    jnp.asarray(np.sin(ang), x.dtype),
  )
  x1, x2 = x[:, : d // 2], x[:, d // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def rope_forward(q, k, read):
  """Attention scores of rotated queries and keys, both stored in FP8."""
  qr = read("rope.q@dk", _rotate(q))
  kr = read("rope.k@dq", _rotate(k))
  return qr @ kr.T / math.sqrt(q.shape[-1])


ROPE = ops.Custom(
  "rope_scores", rope_forward, args=("q", "k"),
  saved={"rope.q": SR8, "rope.k": SR8}, uses=("rope.q@dk", "rope.k@dq"),
)  # fmt: skip
ROPE_IN = (_normal(0, (8, 16)), _normal(1, (8, 16)))


ROPE_TABLE = [
  ("rope.q@dk", "rounded", True, ("k",), False),
  ("rope.k@dq", "rounded", True, ("q",), False),
]


@pytest.mark.slow
def test_rotary_table_verified_by_monte_carlo():
  # 256 forward draws x 1 backward draw.
  d = audit.derive(ROPE, ROPE_IN, jax.random.key(1), n_forward=256)
  assert [_row(r) for r in d.table] == ROPE_TABLE
  assert d.agrees, str(d.verification)
  assert d.counts == (11, 11)


def test_rotary_table_derived():
  d = audit.derive(ROPE, ROPE_IN, jax.random.key(1), n_forward=0)
  assert [_row(r) for r in d.table] == ROPE_TABLE
  # Oracle: rounding off, the gradient is jax.grad of the plain forward.
  plain = lambda q, k: _rotate(q) @ _rotate(k).T / 4.0
  dy = _normal(2, (8, 8))
  want = jax.vjp(plain, *ROPE_IN)[1](dy)
  off = d.op.unrounded()
  got = jax.vjp(lambda q, k: off(q, k), *ROPE_IN)[1](dy)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- a small convolution, its output stored for the activation ---------------


def conv_forward(x, w, read):
  """gelu(conv1d(x~, w~)); the conv output kept in FP8 for gelu's
  derivative only (the forward applies gelu to the unrounded output)."""
  y = jax.lax.conv_general_dilated(
    read("conv.in@dw", x), read("conv.kernel@dx", w), (1,), "SAME",
    dimension_numbers=("NWC", "WIO", "NWC"),
  )  # fmt: skip
  return jax.nn.gelu(read.stored("conv.out@dact", y))


CONV = ops.Custom(
  "conv_gelu", conv_forward, args=("x", "w"),
  saved={"conv.in": SR8, "conv.kernel": RN8, "conv.out": E5},
  uses=("conv.in@dw", "conv.kernel@dx", "conv.out@dact"),
)  # fmt: skip
CONV_IN = (_normal(0, (2, 12, 4)), _normal(1, (3, 4, 6), 0.4))


CONV_TABLE = [
  ("conv.in@dw", "rounded", True, ("w",), False),
  ("conv.kernel@dx", "rounded", True, ("x",), False),
  ("conv.out@dact", "original", False, ("x", "w"), True),
]


@pytest.mark.slow
def test_convolution_table_verified_by_monte_carlo():
  # 1024 forward draws x 1 backward draw.
  d = audit.derive(CONV, CONV_IN, jax.random.key(2), n_forward=1024)
  assert [_row(r) for r in d.table] == CONV_TABLE
  assert d.agrees, str(d.verification)
  assert d.counts == (3 * 4 + 3 + 1,) * 2


@pytest.mark.slow
def test_convolution_table_derived():
  d = audit.derive(CONV, CONV_IN, jax.random.key(2), n_forward=0)
  assert [_row(r) for r in d.table] == CONV_TABLE
  pred = audit.predict(d.op, d.op.reference_policy)
  assert pred["conv.out@dact"].admissible == ("original",)  # gelu' nonlinear
  assert pred["conv.out@dact"].reuse_differs is False  # storage only
  assert pred["conv.kernel@dx"].admissible == ("rounded", "nearest")  # RN
  # Oracle: rounding off, jax.grad of the plain forward.
  plain = lambda x, w: jax.nn.gelu(
    jax.lax.conv_general_dilated(
      x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )
  )
  dy = _normal(3, (2, 12, 6))
  want = jax.vjp(plain, *CONV_IN)[1](dy)
  off = d.op.unrounded()
  got = jax.vjp(lambda x, w: off(x, w), *CONV_IN)[1](dy)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- stored-only pre-activations: affine and non-affine derivatives ----------
#
# The forward goes on with the pre-activation y itself; y~ is kept for the
# derivative only, so the stored draw is one the forward never saw. Where the
# derivative is affine in the value read (squared ReLU: 2 relu(y), affine on
# each side of zero, and stochastic rounding never crosses zero), reading y~
# is on average the same as reading y: admissible, like a fresh draw. Where
# it is not (a cube: 3 y^2), both are biased by the draw's variance.


def sqrelu_forward(x, w, read):
  y = read("sq.in@dw", x) @ w
  return jnp.square(jax.nn.relu(read.stored("sq.pre@dact", y)))


def cube_forward(x, read):
  return read.stored("cube.in@dact", x) ** 3 / 3


SQRELU = ops.Custom(
  "sqrelu", sqrelu_forward, args=("x", "w"),
  saved={"sq.in": SR8, "sq.pre": SR8}, uses=("sq.in@dw", "sq.pre@dact"),
)  # fmt: skip
CUBE = ops.Custom(
  "cube", cube_forward, args=("x",),
  # float4: a variance large enough to see its bias with few draws.
  saved={"cube.in": ops.Rounding("float4_e2m1fn", "stochastic")},
  uses=("cube.in@dact",),
)  # fmt: skip
STORED_IN = (_normal(0, (8, 16)), _normal(1, (16, 8), 0.25))


def test_stored_read_with_affine_derivative_is_admissible():
  # 512 forward draws x 1 backward draw; biased when |z| >= 4.
  d = audit.derive(SQRELU, STORED_IN, jax.random.key(4), n_forward=512)
  assert [_row(r) for r in d.table] == [
    ("sq.in@dw", "rounded", True, ("w",), False),
    ("sq.pre@dact", "original", True, ("x", "w"), True),
  ]
  p = audit.predict(d.op, d.op.reference_policy)
  # The stored draw: as admissible as a fresh one; nearest is a fixed map.
  assert p["sq.pre@dact"].admissible == ("rounded", "original", "fresh")
  assert p["sq.pre@dact"].reuse_differs is False
  assert d.agrees, str(d.verification)
  assert d.counts == (11, 11)
  v = d.verification["sq.pre@dact"]
  assert v.check("rounded").verdict == "unbiased"
  assert v.check("nearest").verdict == "biased"
  assert "rounded/original/fresh" in str(d)


def test_stored_read_with_nonaffine_derivative_is_biased():
  # 4096 forward draws x 1 backward draw. The bias is the draw's variance
  # times dy; a loss linear in the output (dy = 1) shows it best, and with
  # no other use there is no reuse bias for it to hide.
  d = audit.derive(
    CUBE, STORED_IN[:1], jax.random.key(5), n_forward=4096, loss=jnp.sum
  )
  (row,) = d.table
  assert (row.must_read, row.linear, row.storage_only) == (
    "original", False, True
  )  # fmt: skip
  p = audit.predict(d.op, d.op.reference_policy)
  assert p["cube.in@dact"].admissible == ("original",)
  assert p["cube.in@dact"].reuse_differs is False  # still storage only
  assert d.agrees, str(d.verification)
  v = d.verification["cube.in@dact"]
  assert v.check("rounded").verdict == "biased"
  assert v.check("fresh").verdict == "biased"


# ---- the built-in operators, declared as operators of your own ---------------


def dense_forward(x, kernel, bias, read):
  y = read("dense.in@dw", x) @ read("dense.kernel@dx", kernel)
  return y if bias is None else y + bias


def activation_forward(x, read):
  return jax.nn.gelu(read.stored("act.in@dact", x), approximate=True)


def norm_dense_forward(x, gain, shift, kernel, bias, read):
  mu = jnp.mean(x, -1, keepdims=True)
  xc = x - mu
  n = xc * jax.lax.rsqrt(jnp.mean(xc * xc, -1, keepdims=True) + 1e-5)
  y = n * gain + shift
  z = read("norm.out@dw", y) @ read("dense.kernel@dx", kernel)
  return z + bias


def _as_custom(name, fn, builtin, saved, uses=None):
  return ops.Custom(
    name, fn, args=builtin.args, saved=saved, uses=uses or builtin.uses
  )


DENSE_IN = (_normal(0, (8, 16)), _normal(1, (16, 8), 0.25), _normal(2, (8,)))


def _grads(op, inputs, policy, key, dy):
  """Output and input gradients, compiled: the built-ins are compared with
  their generic form under jit, as they run (evaluated op by op, XLA's
  rewrites of a division by the scale differ between the two)."""
  f = lambda *a: op(*a, policy=policy, key=key)
  return jax.jit(lambda *a: jax.vjp(f, *a)[1](dy))(*inputs)


@pytest.mark.slow
def test_dense_as_custom_same_table_and_bit_identical_gradients():
  builtin = ops.Dense(x=RN8, kernel=RN8)
  mine = _as_custom(
    "my_dense", dense_forward, builtin, {"dense.in": RN8, "dense.kernel": RN8}
  )
  d = audit.derive(mine, DENSE_IN, jax.random.key(4), n_forward=0)
  assert [_row(t) for t in d.table] == [_row(t) for t in builtin.table]
  dy = jnp.asarray(_normal(3, (8, 8)))
  key = jax.random.key(5)
  # Forward draws are keyed by tensor name ("x" there, "dense.in" here), so
  # bit-for-bit comparisons of gradients use nearest rounding.
  for pol in ("dense.in@dw=rounded,dense.kernel@dx=rounded",
              "dense.in@dw=original,dense.kernel@dx=nearest",
              ".*=original"):  # fmt: skip
    a = _grads(builtin, DENSE_IN, pol, key, dy)
    b = _grads(d.op, DENSE_IN, pol, key, dy)
    for x, y in zip(a, b, strict=True):
      np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(
    jax.jit(builtin)(*DENSE_IN), jax.jit(d.op)(*DENSE_IN)
  )


@pytest.mark.slow
def test_dense_as_custom_stochastic_same_table():
  builtin = ops.Dense(x=SR8, kernel=SR8)
  mine = _as_custom(
    "my_dense", dense_forward, builtin, {"dense.in": SR8, "dense.kernel": SR8}
  )
  # 256 forward draws x 1 backward draw.
  d = audit.derive(mine, DENSE_IN, jax.random.key(4), n_forward=256)
  assert [_row(t) for t in d.table] == [_row(t) for t in builtin.table]
  assert d.agrees, str(d.verification)


def test_activation_as_custom_same_table_and_bit_identical_gradients():
  builtin = ops.Activation("gelu", x=SR8)
  mine = _as_custom("my_act", activation_forward, builtin, {"act.in": SR8})
  x = (_normal(0, (8, 16), 2.0),)
  d = audit.derive(mine, x, jax.random.key(6), n_forward=0)
  assert [_row(t) for t in d.table] == [_row(t) for t in builtin.table]
  dy = jnp.asarray(_normal(1, (8, 16)))
  key = jax.random.key(7)
  for pol in ("act.in@dact=original", "act.in@dact=nearest"):
    a = _grads(builtin, x, pol, key, dy)
    b = _grads(d.op, x, pol, key, dy)
    np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(
    jax.jit(builtin)(*x, key=key), jax.jit(d.op)(*x, key=key)
  )


@pytest.mark.slow
def test_norm_dense_as_custom_explained_difference():
  """The generic form differentiates the norm by autodiff from x, so its
  derivative reads no stored value: `norm.out@dgain` and `norm.out@dx`,
  which the built-in reads from the stored output (as a backward keeping
  only the output must), are not uses of it. The uses both have agree row
  for row, and the reference gradients agree to float32 roundoff (the
  built-in's norm backward is a closed form, not autodiff's sequence)."""
  builtin = ops.NormDense(out=RN8, kernel=RN8)
  mine = _as_custom(
    "my_norm_dense", norm_dense_forward, builtin,
    {"norm.out": RN8, "dense.kernel": RN8}, ("norm.out@dw", "dense.kernel@dx"),
  )  # fmt: skip
  inputs = (
    _normal(0, (8, 16)), _normal(1, (16,), 0.1, 1.0), _normal(2, (16,), 0.1),
    _normal(3, (16, 8), 0.25), _normal(4, (8,)),
  )  # fmt: skip
  d = audit.derive(mine, inputs, jax.random.key(8), n_forward=0)
  assert d.op.uses == ("norm.out@dw", "dense.kernel@dx")
  assert [_row(t) for t in d.table] == [
    _row(builtin.requirements[u]) for u in d.op.uses
  ]
  dy = jnp.asarray(_normal(5, (8, 8)))
  key = jax.random.key(9)
  a = _grads(builtin, inputs, None, key, dy)
  b = _grads(d.op, inputs, None, key, dy)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
  # Reading the original for the weight gradient moves dkernel the same way.
  wrong = "norm.out@dw=original,norm.out@.*=original,dense.kernel@dx=rounded"
  a = _grads(builtin, inputs, wrong, key, dy)
  b = _grads(d.op, inputs, wrong, key, dy)
  np.testing.assert_allclose(a[3], b[3], rtol=1e-5, atol=1e-6)


# ---- the open registry -------------------------------------------------------


def test_registry_is_explicit_and_immutable():
  reg = policy.BUILTIN.register(SWIGLU)
  assert "swiglu" in reg and "swiglu" not in policy.BUILTIN
  assert reg.uses("swiglu") == SWIGLU.uses
  assert reg.register(SWIGLU) is reg  # idempotent
  assert hash(reg) != hash(policy.BUILTIN)
  with pytest.raises(TypeError):
    policy.USES["swiglu"] = SWIGLU.uses  # a read-only view
  with pytest.raises(ValueError, match="already registered"):
    policy.BUILTIN.register(("dense", ("dense.in@dw",)))
  with pytest.raises(ValueError, match="Did you mean 'swiglu'"):
    reg.uses("swiglo")


def test_one_policy_configures_builtin_and_own_operators():
  op = _swiglu_derived().op
  model = ops.REFERENCE.override(op.reference_policy)
  assert model.resolve("attention")["attn.out@delta"] == "original"
  assert model.resolve(op) == {
    "swiglu.act@dact": "original",
    "swiglu.act@dw_down": "rounded",
  }
  assert model.resolve("swiglu") == model.resolve(op)  # registered by name
  # The string form round-trips given the registry; a policy is hashable.
  assert Policy.parse(str(model), model.registry) == model
  assert hash(model) == hash(Policy.parse(str(model), model.registry))
  # Without the registry a built-in operator flags the rule as unknown.
  bare = Policy.parse(str(model))
  with pytest.raises(ValueError, match="matches no use name"):
    bare.resolve("attention")
  assert bare.resolve(op)["swiglu.act@dact"] == "original"  # op knows itself
  assert "registry=+swiglu" in repr(model)


# ---- errors ------------------------------------------------------------------


def _reads_one(x, read):
  return read("e.t@a", x) * 2.0


def test_error_use_the_forward_never_reads():
  op = ops.Custom("e", _reads_one, args=("x",), saved={"e.t": SR8},
                  uses=("e.t@a", "e.t@b"))  # fmt: skip
  x = _normal(0, (4,))
  with pytest.raises(ValueError, match="'e.t@b' but its forward never"):
    op(x, policy=".*=rounded", key=jax.random.key(0))
  with pytest.raises(ValueError, match="never reads"):
    audit.derive(op, (x,), jax.random.key(0), n_forward=0)


def test_error_saved_tensor_with_no_uses():
  with pytest.raises(ValueError, match="saved tensor 'e.u' of e has no uses"):
    ops.Custom("e", _reads_one, args=("x",),
               saved={"e.t": SR8, "e.u": SR8}, uses=("e.t@a",))  # fmt: skip


def test_error_policy_naming_an_undeclared_use():
  op = ops.Custom("e", _reads_one, args=("x",), saved={"e.t": SR8},
                  uses=("e.t@a",))  # fmt: skip
  x = _normal(0, (4,))
  with pytest.raises(ValueError, match="matches no use name") as e:
    op(x, policy="e.t@aa=rounded", key=jax.random.key(0))
  assert "Did you mean 'e.t@a'" in str(e.value)
  assert "Uses of e: e.t@a" in str(e.value)
  with pytest.raises(ValueError, match="no rule for use 'e.t@a'"):
    op(x, policy="dense.in@dw=rounded", key=jax.random.key(0))


def test_error_other_declaration_mistakes():
  x = _normal(0, (4,))
  with pytest.raises(ValueError, match="names tensor 'e.s', which is not"):
    ops.Custom("e", _reads_one, args=("x",), saved={"e.t": SR8},
               uses=("e.t@a", "e.s@a"))  # fmt: skip
  with pytest.raises(ValueError, match="exactly one '@'"):
    ops.Custom("e", _reads_one, args=("x",), saved={"e.t": SR8},
               uses=("e.t.a",))  # fmt: skip
  other = ops.Custom("e", lambda x, read: read("e.t@c", x), args=("x",),
                     saved={"e.t": SR8}, uses=("e.t@a",))  # fmt: skip
  with pytest.raises(ValueError, match="reads use 'e.t@c', which the"):
    other(x, policy=".*=rounded", key=jax.random.key(0))
  no_table = ops.Custom("e", _reads_one, args=("x",), saved={"e.t": SR8},
                        uses=("e.t@a",))  # fmt: skip
  with pytest.raises(ValueError, match="no requirements table yet"):
    no_table(x, key=jax.random.key(0))
  # A use whose read changes no gradient: rounded and original both give
  # the reference, so the table cannot say which one is required.
  idle = ops.Custom(
    "e", lambda x, read: x + 0.0 * read("e.t@a", x),
    args=("x",), saved={"e.t": SR8}, uses=("e.t@a",),
  )  # fmt: skip
  with pytest.raises(ValueError, match="more than one combination"):
    audit.derive(idle, (x,), jax.random.key(0), n_forward=0)


def test_custom_runs_under_jit_and_is_a_static_argument():
  op = _swiglu_derived().op
  f = jax.jit(jax.grad(lambda x, k: jnp.sum(op(x, *SWIGLU_IN[1:], key=k) ** 2)))
  g1 = f(SWIGLU_IN[0], jax.random.key(0))
  g2 = jax.grad(lambda x, k: jnp.sum(op(x, *SWIGLU_IN[1:], key=k) ** 2))(
    SWIGLU_IN[0], jax.random.key(0)
  )
  np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_docs_example_prints_what_the_page_shows():
  """The first example of docs/own_operators.md, run as pasted."""
  path = os.path.join(
    os.path.dirname(__file__), "..", "docs", "own_operators.md"
  )
  text = open(path).read()
  code, shown = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```", text,
                          re.S).groups()  # fmt: skip
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, path, "exec"), {})
  assert out.getvalue().rstrip() == shown.rstrip()


class _Mlp(fnn.Module):
  """A built-in Dense feeding the custom SwiGLU, under one Numerics."""

  numerics: nn.Numerics
  op: ops.Custom

  @fnn.compact
  def __call__(self, x):
    x = nn.Dense(16, numerics=self.numerics)(x)
    init = fnn.initializers.normal(0.25)
    params = [
      self.param(n, init, s)
      for n, s in (("w_gate", (16, 32)), ("w_up", (16, 32)),
                   ("w_down", (32, 16)))
    ]  # fmt: skip
    return nn.call(self, self.op, self.numerics, x, *params)


@pytest.mark.slow
def test_custom_operator_in_a_linen_model_under_one_policy():
  op = _swiglu_derived().op
  num = nn.Numerics(
    policy=ops.REFERENCE.override(op.reference_policy), saved=SR8
  )
  model = _Mlp(num, op)
  x = jnp.asarray(SWIGLU_IN[0])
  params = model.init(jax.random.key(0), x)
  rngs = {"lowprec": jax.random.key(1)}
  loss = lambda p: jnp.sum(model.apply(p, x, rngs=rngs) ** 2)
  g = jax.jit(jax.grad(loss))(params)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))
  # The module's policy decides the custom operator's reads too.
  wrong = nn.Numerics(
    policy=num.policy.override("swiglu.act@dact=rounded"), saved=SR8
  )
  g2 = jax.jit(jax.grad(lambda p: jnp.sum(_Mlp(wrong, op).apply(
    p, x, rngs=rngs) ** 2)))(params)  # fmt: skip
  assert jnp.any(g2["params"]["w_gate"] != g["params"]["w_gate"])
  np.testing.assert_array_equal(
    g2["params"]["w_down"], g["params"]["w_down"]
  )  # swiglu.act@dact feeds w_gate and x, not w_down
  with pytest.raises(ValueError, match="no rule for use 'swiglu.act@dact'"):
    _Mlp(nn.Numerics(saved=SR8), op).init(jax.random.key(0), x)

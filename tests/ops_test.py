"""Operators: exactness without rounding, the reference gradient, per-use
reads, residual dtypes, keys and bad input.

Oracles are independent of the operators' code: plain JAX implementations
(`jax.nn.dot_product_attention`, a LayerNorm written out) differentiated by
`jax.grad` in float64, and straight-through forwards written here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from lowprec import ops
from lowprec.backward.ops.rounding import Rounding
from lowprec.backward.ops.saved import key_for

SR8 = Rounding("float8_e4m3fn", "stochastic")
RN8 = Rounding("float8_e4m3fn", "nearest")
E5 = Rounding("float8_e5m2", "stochastic")
KEY = jax.random.key(7)


def _normal(seed, shape, scale=1.0):
  """Inputs come from numpy, so that no test compiles a random generator."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _layer_norm(x, eps, rms=False):
  if rms:
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
  mu = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
  return (x - mu) / jnp.sqrt(var + eps)


# ---- plain operators and their inputs ----------------------------------------


def _attention(q, k, v):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
  s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _case(name, dtype=jnp.float32):
  """(op without rounding, plain function, inputs)."""
  if name == "dense":
    args = (_normal(0, (2, 3, 8)), _normal(1, (8, 5)), _normal(2, (5,)))
    return ops.Dense(), lambda x, w, b: x @ w + b, args
  if name in ("layer_norm_dense", "rms_norm_dense"):
    rms = name.startswith("rms")
    args = (
      _normal(0, (2, 3, 8), 3.0) + 1.0,
      1.0 + _normal(1, (8,), 0.2),
      None if rms else _normal(2, (8,), 0.2),
      _normal(3, (8, 5)),
      _normal(4, (5,)),
    )

    def plain(x, g, b, w, c):
      y = _layer_norm(x, 1e-5, rms) * g
      return (y if b is None else y + b) @ w + c

    return ops.NormDense(norm="rms" if rms else "layer"), plain, args
  if name == "attention":
    args = tuple(_normal(i, (2, 6, 2, 4)) for i in range(3))
    return ops.Attention(), _attention, args
  fn = name.split("_", 1)[1]
  plain = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
  }[fn]
  return ops.Activation(fn), plain, (_normal(0, (3, 7), 2.0),)


CASES = [
  "dense",
  "layer_norm_dense",
  "rms_norm_dense",
  "attention",
  "act_gelu",
  "act_silu",
]


def _loss(f):
  """A nonlinear scalar loss of `f`'s output."""

  def loss(*a):
    y = f(*a)
    w = jnp.arange(1, y.size + 1, dtype=y.dtype).reshape(y.shape) / y.size
    return jnp.sum(jnp.sin(y) * w)

  return loss


def _value_and_grads(fs, args):
  """For each f: `f(*args)` and the gradients of `_loss(f)` in the present
  args; one jitted program."""
  idx = _present(args)

  @jax.jit
  def run(*a):
    return [(f(*a), jax.grad(_loss(f), argnums=idx)(*a)) for f in fs]

  return run(*args)


def _present(args):
  return [i for i, a in enumerate(args) if a is not None]


@pytest.mark.parametrize("name", CASES)
def test_without_rounding_value_and_grad_match_plain_op_in_float64(name):
  with jax.enable_x64(True):
    op, plain, args = _case(name)
    args = tuple(None if a is None else a.astype(jnp.float64) for a in args)
    (y, got), (y_want, want) = _value_and_grads([op, plain], args)
    np.testing.assert_allclose(y, y_want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want, strict=True):
      assert g.dtype == jnp.float64
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_without_rounding_attention_matches_jax_attention_and_fd():
  op, _, args = _case("attention")
  plain = functools.partial(jax.nn.dot_product_attention, is_causal=True)
  (y, got), (y_want, want) = _value_and_grads([op, plain], args)
  np.testing.assert_allclose(y, y_want, rtol=1e-6, atol=1e-6)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
  with jax.enable_x64(True):  # finite differences, the operator alone
    check_grads(
      jax.jit(op), [a.astype(jnp.float64) for a in args], 1, modes=["rev"]
    )


# ---- the reference gradient --------------------------------------------------


def _st(r, x, key):
  """Straight-through rounding, written independently of the operators."""
  q = r.quantize(x, key).value()
  return x + jax.lax.stop_gradient(q - x)


def _st_case(name):
  """(op with FP8 roundings, straight-through forward, inputs)."""
  if name == "dense":
    op = ops.Dense(x=SR8, kernel=RN8)
    args = _case("dense")[2]

    def st(x, w, b):
      return _st(SR8, x, key_for(KEY, "x")) @ _st(RN8, w, None) + b

    return op, st, args
  if name in ("layer_norm_dense", "rms_norm_dense"):
    rms = name.startswith("rms")
    op = ops.NormDense(norm="rms" if rms else "layer", out=SR8, kernel=RN8)
    args = _case(name)[2]

    def st(x, g, b, w, c):
      y = _layer_norm(x, 1e-5, rms) * g
      y = y if b is None else y + b
      return _st(SR8, y, key_for(KEY, "out")) @ _st(RN8, w, None) + c

    return op, st, args
  if name == "attention":
    op = ops.Attention(probs=SR8, out=SR8)
    args = _case("attention")[2]

    def st(q, k, v):
      s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
      s = jnp.where(jnp.tril(jnp.ones((6, 6), bool)), s, -jnp.inf)
      p = _st(SR8, jax.nn.softmax(s, -1), key_for(KEY, "probs"))
      o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
      return _st(SR8, o, key_for(KEY, "out"))

    return op, st, args
  op = ops.Activation("gelu", x=SR8)
  return op, lambda x: jax.nn.gelu(x, approximate=True), _case("act_gelu")[2]


@pytest.mark.parametrize("name", CASES[:5])
def test_reference_policy_gives_autodiff_of_straight_through_forward(name):
  op, st, args = _st_case(name)
  # The operator under its reference policy, the straight-through forward
  # written here, and the library's own straight-through forward.
  (y, got), (y_want, want), (_, lib) = _value_and_grads(
    [
      lambda *a: op(*a, key=KEY),
      st,
      lambda *a: op.reference(*a, key=KEY),
    ],
    args,
  )
  np.testing.assert_allclose(y, y_want, rtol=1e-6, atol=1e-6)
  for g, g_lib, w in zip(got, lib, want, strict=True):
    scale = float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(g_lib, w, rtol=0, atol=2e-5 * scale)


# ---- each use reads what the policy says -------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _dense_dw(value, backward_key=None):
  """The dense kernel gradient with `dense.in@dw` read as `value`."""
  op = ops.Dense(x=SR8, kernel=RN8)
  x, w, b = _case("dense")[2]
  dy = _normal(9, (2, 3, 5))
  pol = f"dense.in@dw={value},dense.kernel@dx=rounded"
  _, vjp = jax.vjp(
    lambda x, w: op(x, w, b, policy=pol, key=KEY, backward_key=backward_key),
    x,
    w,
  )
  return vjp(dy)[1], x, dy


@jax.jit
def _dense_x_copies():
  x = _case("dense")[2][0]
  rounded = SR8.quantize(x, key_for(KEY, "x")).value()
  return rounded, SR8.quantize(x, mode="nearest").value(), x


def test_dense_kernel_gradient_reads_the_value_the_policy_names():
  copies = dict(
    zip(("rounded", "nearest", "original"), _dense_x_copies(), strict=True)
  )
  for value, xv in copies.items():
    dw, _, dy = _dense_dw(value)
    want = xv.reshape(-1, 8).T @ dy.reshape(-1, 5)
    np.testing.assert_allclose(dw, want, rtol=1e-6, atol=1e-6, err_msg=value)
  # The forward's draw is reused: rounded differs from a nearest rounding.
  assert not np.allclose(copies["rounded"], copies["nearest"])


def test_fresh_read_is_an_unbiased_independent_draw():
  # 4000 backward keys, forward fixed: the mean kernel gradient under
  # `fresh` is x^T dy within 5 standard errors per element, and the draws
  # are not the forward's (which would give x~^T dy for every key).
  keys = jax.random.split(jax.random.key(11), 4000)
  dws = jax.jit(jax.vmap(lambda k: _dense_dw("fresh", k)[0]))(keys)
  dws = np.asarray(dws, np.float64)
  _, x, dy = _dense_dw("original")
  want = x.reshape(-1, 8).T @ dy.reshape(-1, 5)
  mean, se = dws.mean(0), dws.std(0) / np.sqrt(len(keys))
  assert float(np.max(np.abs(mean - want) / se)) < 5.0
  rounded = _dense_dw("rounded")[0]
  assert not np.any(np.all(np.isclose(dws, rounded[None]), axis=(1, 2)))


def test_same_keys_reproduce_and_backward_key_changes_only_fresh_draws():
  a, _, _ = _dense_dw("fresh", jax.random.key(1))
  b, _, _ = _dense_dw("fresh", jax.random.key(1))
  c, _, _ = _dense_dw("fresh", jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  r1, _, _ = _dense_dw("rounded", jax.random.key(1))
  r2, _, _ = _dense_dw("rounded", jax.random.key(2))
  np.testing.assert_array_equal(r1, r2)


def test_fresh_draws_differ_per_use():
  # attn.probs@dv and attn.probs@dscores both fresh: two different draws.
  assert not np.array_equal(
    jax.random.key_data(key_for(KEY, "attn.probs@dv")),
    jax.random.key_data(key_for(KEY, "attn.probs@dscores")),
  )


@functools.partial(jax.jit, static_argnums=0)
def _norm_dgain(value):
  """(gain gradient with `norm.out@dgain` read as `value`, expected)."""
  op = ops.NormDense(out=SR8)
  x, g, b, w, c = _case("layer_norm_dense")[2]
  dz = _normal(9, (2, 3, 5))
  pol = {"norm.out@dgain": value, "norm.out@dx": "original", ".*": "rounded"}
  _, vjp = jax.vjp(lambda g: op(x, g, b, w, c, policy=pol, key=KEY), g)
  n = _layer_norm(x, 1e-5)
  if value == "rounded":
    n = (SR8.quantize(n * g + b, key_for(KEY, "out")).value() - b) / g
  return vjp(dz)[0], jnp.sum((dz @ w.T) * n, (0, 1))


@pytest.mark.parametrize("value", ["original", "rounded"])
def test_norm_dense_gain_gradient_reads_per_use(value):
  got, want = _norm_dgain(value)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gradient_rounding_rounds_incoming_gradients_to_e5m2():
  @jax.jit
  def run():
    op = ops.Dense(grad=E5)
    x, w, _ = _case("dense")[2]
    dy = _normal(9, (2, 3, 5))
    _, vjp = jax.vjp(lambda b: op(x, w, b, key=KEY), jnp.zeros(5))
    # db is the sum of the rounded dy: round it here with the same key.
    key = key_for(key_for(KEY, "backward"), "grad:dy")
    return vjp(dy)[0], E5.quantize(dy, key).value(), dy

  db, dy_r, dy = run()
  np.testing.assert_allclose(db, dy_r.reshape(-1, 5).sum(0), rtol=1e-6)
  assert not np.allclose(db, dy.reshape(-1, 5).sum(0), rtol=1e-3)


# ---- residuals: what the backward keeps --------------------------------------


def _residuals(f, *args):
  """(dtype, shape) of every residual the vjp keeps, from its jaxpr."""
  jaxpr = jax.make_jaxpr(
    lambda *a: jax.tree_util.tree_leaves(jax.vjp(f, *a)[1])
  )(*args)
  return [(str(a.dtype), tuple(a.shape)) for a in jaxpr.out_avals]


def test_attention_keeps_rounded_probabilities_narrow():
  op = ops.Attention(probs=SR8, out=SR8)
  q, k, v = _case("attention")[2]
  square = (2, 2, 6, 6)
  reuse = "attn.probs@.*=rounded,attn.out@delta=rounded"
  res = _residuals(lambda *a: op(*a, policy=reuse, key=KEY), q, k, v)
  assert ("float8_e4m3fn", square) in res
  assert ("float8_e4m3fn", (2, 6, 2, 4)) in res  # the rounded output
  assert all(s != square for d, s in res if d == "float32")
  assert all(s != (2, 2, 6) for d, s in res)  # no log-sum-exp needed
  # Reading the original probabilities keeps no square tensor at all: they
  # are recomputed from q, k and the log-sum-exp.
  res = _residuals(lambda *a: op(*a, key=KEY), q, k, v)
  assert all(s != square for d, s in res if d == "float32")
  assert ("float32", (2, 2, 6)) in res
  assert ("float8_e4m3fn", square) in res  # dV reads the rounded P


def test_norm_dense_keeps_only_what_each_policy_reads():
  op = ops.NormDense(out=SR8, kernel=RN8)
  x, g, b, w, c = _case("layer_norm_dense")[2]
  f = lambda pol: lambda x: op(x, g, b, w, c, policy=pol, key=KEY)
  rounded = _residuals(f(".*=rounded"), x)
  assert ("float8_e4m3fn", x.shape) in rounded
  assert ("float8_e4m3fn", w.shape) in rounded
  assert ("float32", x.shape) not in rounded  # the input is not kept
  per_use = _residuals(f(ops.REFERENCE), x)
  assert ("float8_e4m3fn", x.shape) in per_use  # y~ for the weight grad
  assert ("float32", x.shape) in per_use  # x for the gain and input grads


def test_dense_keeps_the_rounded_input_narrow_and_bf16_as_bf16():
  x, w, b = _case("dense")[2]
  op = ops.Dense(x=SR8, kernel="bfloat16")
  res = _residuals(lambda x, w: op(x, w, b, key=KEY), x, w)
  assert ("float8_e4m3fn", x.shape) in res
  assert ("bfloat16", w.shape) in res
  assert ("float32", x.shape) not in res
  res = _residuals(
    lambda x, w: op(x, w, b, key=KEY, policy=".*@dw=fresh,.*=rounded"), x, w
  )
  assert ("float32", x.shape) in res  # fresh draws need the original


# ---- bad input ---------------------------------------------------------------


def test_missing_key_for_a_stochastic_op_is_an_error():
  op = ops.Attention(probs=SR8)
  q, k, v = _case("attention")[2]
  with pytest.raises(ValueError, match="key=None"):
    jax.eval_shape(op, q, k, v)
  # A fresh read draws in the backward: it needs a key too.
  with pytest.raises(ValueError, match="key=None"):
    jax.eval_shape(
      lambda *a: ops.Dense(x=RN8)(*a, policy=".*@dw=fresh,.*=rounded"),
      *_case("dense")[2],
    )
  # Nearest rounding draws nothing.
  jax.eval_shape(ops.Dense(x=RN8, kernel=RN8), *_case("dense")[2])


def test_unknown_use_in_an_op_policy_is_an_error():
  op = ops.Dense(x=SR8)
  with pytest.raises(ValueError, match="Did you mean 'dense.in@dw'"):
    op.resolve("dense.input@dw=rounded,.*=rounded")
  with pytest.raises(ValueError, match="no rule for use 'dense.kernel@dx'"):
    jax.eval_shape(
      lambda *a: op(*a, key=KEY, policy="dense.in@dw=fresh"),
      *_case("dense")[2],
    )


def test_bad_configuration():
  with pytest.raises(ValueError, match="unknown norm"):
    ops.NormDense(norm="batch")
  with pytest.raises(ValueError, match="unknown activation"):
    ops.Activation("swish")
  with pytest.raises(ValueError, match="unknown format"):
    ops.Dense(x="float8_e4m3")  # valid
    ops.Dense(x="float8_e4m4fn")
  with pytest.raises(ValueError, match="unknown rounding mode"):
    Rounding("bfloat16", "sr")
  with pytest.raises(TypeError, match="takes 3 inputs"):
    ops.Dense().apply(("rounded", "rounded"), (1.0,), None)


def test_per_tensor_scale_guards_zero_and_tiny_amax():
  r = Rounding("float8_e4m3fn")
  scale = jax.jit(r.scale)
  assert float(scale(jnp.zeros(4))) == 1.0
  assert float(scale(jnp.full(4, 1e-38))) == 1.0
  assert float(scale(jnp.array([0.5, -2.0, 0.0, 1.0]))) == 224.0
  assert float(scale(jnp.array([0.5, jnp.inf, 0.0, 1.0]))) == 1.0
  zero = jax.jit(lambda x: r.quantize(x).value())(jnp.zeros(3))
  np.testing.assert_array_equal(zero, 0.0)
  assert Rounding.parse("float8_e5m2:stochastic") == E5
  assert not Rounding("bfloat16").scaled


@pytest.mark.parametrize(
  "fmt, stored",
  [
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float6_e3m2fn", "float32"),
    ("float6_e2m3fn", "float32"),
    ("float4_e2m1fn", "float32"),
  ],
)
def test_saved_tensors_are_native_only_for_8_and_16_bit_formats(fmt, stored):
  # ml_dtypes gives FP6/FP4 dtypes one byte each; XLA:CPU fails to compile
  # some programs that convert to float6_e3m2fn, so those stay float32.
  from lowprec.backward.ops import saved

  r = saved.Rounding(fmt, "stochastic")
  x = jax.random.normal(jax.random.key(0), (32, 16))

  def f(x):
    value, st = r.round(x, jax.random.key(1))
    return value, st.data

  value, data = jax.jit(f)(x)
  assert data.dtype == jnp.dtype(stored)
  # Either way the stored codes are the grid values of the scaled tensor.
  scale = r.scale(x)
  want = np.asarray(value, np.float32) * np.asarray(scale)
  np.testing.assert_allclose(np.asarray(data, np.float32), want, rtol=1e-6)


# ---- draws of op and op.reference (the contract in `Op.reference`) -----------

N_DRAWS = 64  # draws of a 65536-element tensor, keys 0..63


def test_op_and_reference_draw_the_same_bits_for_an_input_they_round():
  # Dense rounds its input itself; with an identity kernel (float32) the
  # output is the rounded input exactly, so it shows every draw.
  op = ops.Dense(x=SR8)
  x = _normal(11, (256, 256))
  eye = jnp.eye(256, dtype=jnp.float32)
  call = jax.jit(lambda x, key: op(x, eye, None, key=key))
  ref = jax.jit(lambda x, key: op.reference(x, eye, None, key=key))
  alone = jax.jit(lambda x, key: SR8.round(x, key_for(key, "x"))[0])
  for i in range(N_DRAWS):
    key = jax.random.key(i)
    # Equal values (the matmul turns a -0 into +0): equal draws, since a
    # draw moves an element to a different grid value.
    want = np.asarray(alone(x, key))
    np.testing.assert_array_equal(np.asarray(call(x, key)), want)
    np.testing.assert_array_equal(np.asarray(ref(x, key)), want)


@pytest.mark.parametrize("ulps", [0, 4])
def test_same_bits_on_values_a_few_ulps_apart_flip_few_elements_by_one_step(
  ulps,
):
  # The values a second compiled program feeds to the rounding may differ
  # in their last bits. With the same random bits, each element then rounds
  # to the same grid value or to the adjacent one, the latter with
  # probability ulps * 2**(m - 23) (m = 3 for e4m3): 16 expected flips in
  # 64 draws of 65536 elements at 4 ulps (Poisson; asserted within 1..48),
  # none at 0. Unscaled, normal-range values: the ulps are those rounded.
  r = Rounding("float8_e4m3fn", "stochastic", scaled=False)
  rng = np.random.default_rng(12)
  mag = 2.0 ** rng.uniform(-5, 8, 65536)
  x = (np.where(rng.random(65536) < 0.5, -1, 1) * mag).astype(np.float32)
  y = x.view(np.uint32) + np.uint32(ulps)  # |x| grows by `ulps` ulps
  y = y.view(np.float32)
  rnd = jax.jit(lambda v, key: r.round(v, key)[1].data)  # float8 codes
  flips = 0
  for i in range(N_DRAWS):
    key = jax.random.key(i)
    a = np.asarray(rnd(x, key)).view(np.uint8).astype(np.int16)
    b = np.asarray(rnd(y, key)).view(np.uint8).astype(np.int16)
    # One code step away from zero (codes are sign-magnitude): the next
    # grid value up in magnitude, never further.
    assert set(np.unique(b - a)) <= {0, 1}, i
    flips += int(np.sum(a != b))
  if ulps == 0:
    assert flips == 0
  else:
    assert 1 <= flips <= 48, flips

"""How a model computes: fused attention, compute dtype, matmul precision.

Oracles: the per-use attention operator with nothing rounded (whose
gradient is the plain float32 attention's), float64 numpy attention, and
the compiled program's own text (the dots' operand types and precision).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from experiments import models, tasks
from lowprec import nn as lpnn
from lowprec import ops

TOKENS = jax.random.randint(jax.random.key(3), (2, 16), 0, 256)


def _config(**model):
  c = common.get_config()
  c.model.update(dict(n_layer=2, n_head=2, d_model=32, seq_len=16))
  c.model.vocab_size = 256  # the built-in text's bytes
  c.model.update(model)
  return c


def _loss_and_grads(numerics, cfg=None):
  cfg = cfg or tasks._gpt_cfg(_config().model)
  model = models.GPT(cfg, numerics)
  params = model.init(jax.random.key(0), TOKENS)["params"]

  def loss(p):
    y = model.apply({"params": p}, TOKENS, rngs={"lowprec": jax.random.key(1)})
    return jnp.mean(y**2)

  return jax.jit(jax.value_and_grad(loss))(params)


def test_fused_attention_equals_the_operator_to_float32_rounding():
  fused, fused_g = _loss_and_grads(lpnn.Numerics(fused_attention=True))
  op, op_g = _loss_and_grads(lpnn.Numerics())
  np.testing.assert_allclose(fused, op, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(fused_g), jax.tree.leaves(op_g), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_fused_attention_matches_float64_attention():
  q, k, v = (
    np.asarray(jax.random.normal(jax.random.key(i), (2, 8, 2, 4)))
    for i in range(3)
  )
  s = np.einsum("bqhd,bkhd->bhqk", q, k).astype(np.float64) / 2.0
  s = np.where(np.tril(np.ones((8, 8), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.einsum("bhqk,bkhd->bqhd", p, v)
  got = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _custom_vjps(numerics) -> int:
  """How many custom_vjp calls one forward of a 2-layer GPT makes."""
  cfg = tasks._gpt_cfg(_config().model)
  model = models.GPT(cfg, numerics)
  params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]
  jaxpr = jax.make_jaxpr(
    lambda p: model.apply(
      {"params": p}, TOKENS, rngs={"lowprec": jax.random.key(1)}
    )
  )(params)
  return str(jaxpr).count("custom_vjp_call")


@pytest.mark.parametrize(
  "numerics, kind",
  [
    (lpnn.Numerics(), "op"),
    (lpnn.Numerics(fused_attention=True), "fused"),
    (
      lpnn.Numerics(
        fused_attention=True,
        policy=ops.REFERENCE.override("attn.out@delta=rounded"),
      ),
      "fused",
    ),
    (lpnn.Numerics.fp8(fused_attention=True), "op"),
    (lpnn.Numerics(fused_attention=True, saved="bfloat16:nearest"), "op"),
    (lpnn.Numerics(fused_attention=True, grads="float8_e5m2"), "op"),
  ],
  ids=["off", "plain", "reads-without-rounding", "fp8", "saved", "grads"],
)
def test_attention_is_fused_only_where_nothing_is_rounded(numerics, kind):
  assert lpnn.attention_kind(numerics) == kind
  # What runs: each layer's attention operator is one custom_vjp call,
  # gone where the fused function runs instead (2 layers).
  unfused = dataclasses.replace(numerics, fused_attention=False)
  fewer = _custom_vjps(unfused) - _custom_vjps(numerics)
  assert fewer == (2 if kind == "fused" else 0)


def test_the_runner_header_says_which_attention_precision_and_storage():
  c = _config(fused_attention=True, matmul_precision="highest")
  assert tasks.compute_header(c) == (
    "compute float32, matmul precision highest, attention fused "
    "(jax.nn.dot_product_attention), layers stored apart"
  )
  c.lowprec.fwd_format = "float8_e4m3fn"
  c.model.layer_storage = "auto"
  assert tasks.compute_header(c).endswith(
    "attention per-use operator (lowprec.ops.Attention), layers stored stacked"
  )
  # "auto" keeps the layers apart where a transform keeps values per leaf.
  c.lowprec.trace_targets = ("bfloat16",)
  assert tasks.compute_header(c).endswith("layers stored stacked")
  c.lowprec.trace_at_init = True
  assert tasks.compute_header(c).endswith("layers stored apart")


def _dots(config):
  """The dot_general lines of the program of the loss's gradient, jitted
  as the runner jits its step (under `task.compute.precise`)."""
  task = tasks.build(config)
  params = jax.eval_shape(task.init, jax.random.key(0))
  batch = (TOKENS, TOKENS)

  def grad(p):
    return jax.grad(lambda p: task.loss(p, batch, jax.random.key(1))[0])(p)

  text = jax.jit(task.compute.precise(grad)).lower(params).as_text()
  return [line for line in text.splitlines() if "dot_general" in line]


@pytest.mark.slow
def test_bfloat16_compute_runs_every_dot_in_bfloat16():
  dots = _dots(_config(compute_dtype="bfloat16"))
  assert dots
  assert all("xbf16>" in d and "xf32>" not in d.split("->")[0] for d in dots), (
    dots[:3]
  )
  dots32 = _dots(_config())
  assert all("bf16" not in d for d in dots32)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name, hlo",
  [("highest", "HIGHEST"), ("tf32", "HIGH"), ("default", "DEFAULT")],
)
def test_matmul_precision_reaches_every_dot(name, hlo):
  # Forward and backward: the gradient's dots (custom_vjp backward rules
  # included) are traced after the forward returns.
  dots = _dots(_config(matmul_precision=name))
  assert len(dots) > 20
  assert all(f"precision = [{hlo}, {hlo}]" in d for d in dots), dots[:2]


@pytest.mark.slow
def test_bfloat16_compute_trains_close_to_float32():
  losses = {}
  for dtype in ("float32", "bfloat16"):
    task = tasks.build(_config(compute_dtype=dtype))
    params = task.init(jax.random.key(0))
    loss = task.loss(params, (TOKENS, TOKENS), jax.random.key(1))[0]
    losses[dtype] = float(loss)
  # bfloat16 keeps 8 bits: the loss (about ln 256 = 5.5) within 1%.
  assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=1e-2)
  assert losses["bfloat16"] != losses["float32"]


@pytest.mark.parametrize(
  "key, value",
  [("compute_dtype", "float16"), ("matmul_precision", "bfloat16")],
)
def test_an_unknown_choice_names_the_valid_ones(key, value):
  with pytest.raises(ValueError, match=f"model.{key}") as e:
    tasks.Compute.of(_config(**{key: value}).model)
  assert "float32" in str(e.value) or "highest" in str(e.value)


# ---- native FP8 dots --------------------------------------------------------


X = jax.random.normal(jax.random.key(5), (4, 16, 64)) * 3.0
W = jax.random.normal(jax.random.key(6), (64, 32)) * 0.05


@pytest.mark.parametrize(
  "x, kernel",
  [
    ("float8_e4m3fn:stochastic", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e4m3fn"),
    (
      ops.Rounding("float8_e4m3fn", scaled=False),
      ops.Rounding("float8_e4m3fn", scaled=False),
    ),
  ],
  ids=["e4m3-sr-scaled", "e5m2-e4m3-scaled", "e4m3-unscaled"],
)
def test_a_native_fp8_dot_equals_the_emulation_to_float32_rounding(x, kernel):
  emulated = ops.Dense(x=x, kernel=kernel)
  native = ops.Dense(x=x, kernel=kernel, native_fp8=True)
  assert native.uses_native_fp8 and not emulated.uses_native_fp8
  key = jax.random.key(2)
  got = jax.jit(lambda a, b: native(a, b, key=key))(X, W)
  want = jax.jit(lambda a, b: emulated(a, b, key=key))(X, W)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
  # The program holds a dot of float8 operands with a float32 result.
  text = jax.jit(lambda a, b: native(a, b, key=key)).lower(X, W).as_text()
  assert any(
    "dot_general" in line and "f8E" in line and "xf32>" in line.split("->")[-1]
    for line in text.splitlines()
  )
  # The gradients are the emulation's (the backward stays emulated).
  g_native = jax.grad(lambda a: jnp.sum(native(a, W, key=key)))(X)
  g_emul = jax.grad(lambda a: jnp.sum(emulated(a, W, key=key)))(X)
  np.testing.assert_array_equal(g_native, g_emul)


def test_native_fp8_stays_emulated_for_other_formats():
  for x, kernel in [("bfloat16", "bfloat16"), ("float8_e4m3fn", None)]:
    op = ops.Dense(x=x, kernel=kernel, native_fp8=True)
    assert not op.uses_native_fp8
  text = (
    jax.jit(lambda a, b: ops.Dense(x="bfloat16", native_fp8=True)(a, b))
    .lower(X, W)
    .as_text()
  )
  assert "f8E" not in text


def _value_and_grad(task):
  def loss(p):
    return task.loss(p, (TOKENS, TOKENS), jax.random.key(1))[0]

  return jax.jit(jax.value_and_grad(loss))(task.init(jax.random.key(0)))


def _value_and_grad(task):
  def loss(p):
    return task.loss(p, (TOKENS, TOKENS), jax.random.key(1))[0]

  return jax.jit(jax.value_and_grad(loss))(task.init(jax.random.key(0)))


@pytest.mark.slow
def test_a_gpt_with_native_fp8_trains_as_the_emulation():
  got = {}
  for native in (False, True):
    c = _config()
    c.lowprec.update(
      dict(
        fwd_format="float8_e4m3fn",
        fwd_rounding="nearest",
        weight_format="float8_e4m3fn",
        native_fp8=native,
      )
    )
    got[native] = _value_and_grad(tasks.build(c))
  (value, grads), (want, want_grads) = got[True], got[False]
  np.testing.assert_allclose(value, want, rtol=1e-5)
  for a, b in zip(
    jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)

"""Flax modules: exactly the plain layers with rounding off; FP8 numerics."""

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowprec import nn, ops

X = jnp.asarray(
  np.random.default_rng(0).standard_normal((2, 8, 32)), jnp.float32
)


def _loss(y):
  return jnp.sum(jnp.sin(y))


def _both(ours, plain, params, plain_params, x=X):
  """Outputs and input gradients of both modules, in one jitted program."""

  @jax.jit
  def run(p, q, x):
    fa = lambda x: ours.apply(p, x)
    fb = lambda x: plain.apply(q, x)
    return (
      fa(x),
      fb(x),
      jax.grad(lambda x: _loss(fa(x)))(x),
      jax.grad(lambda x: _loss(fb(x)))(x),
    )

  return run(params, plain_params, x)


def _close(a, b, tol=2e-6):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(u, v, rtol=tol, atol=tol)


def test_dense_is_flax_dense():
  ours, plain = nn.Dense(16), fnn.Dense(16)
  p = ours.init(jax.random.key(0), X)
  q = plain.init(jax.random.key(0), X)
  _close(p, q)  # same names, shapes, initialisers
  y, y_plain, g, g_plain = _both(ours, plain, p, q)
  np.testing.assert_array_equal(y, y_plain)
  _close(g, g_plain)


class _PlainNormDense(fnn.Module):
  features: int
  norm: str

  @fnn.compact
  def __call__(self, x):
    if self.norm == "layer":
      x = fnn.LayerNorm(epsilon=1e-5, name="ln")(x)
    else:
      x = fnn.RMSNorm(epsilon=1e-5, name="ln")(x)
    return fnn.Dense(self.features, name="dense")(x)


def _plain_norm_params(p, prefix=""):
  p = p["params"]
  ln = {"scale": p["norm_scale"]}
  if "norm_bias" in p:
    ln["bias"] = p["norm_bias"]
  return {"ln": ln, "dense": {"kernel": p["kernel"], "bias": p["bias"]}}


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_dense_is_flax_norm_then_dense(norm):
  ours = nn.NormDense(24, norm=norm)
  p = ours.init(jax.random.key(0), X)
  p = jax.tree.map(
    lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size)).reshape(a.shape), p
  )
  q = {"params": _plain_norm_params(p)}
  y, y_plain, g, g_plain = _both(ours, _PlainNormDense(24, norm), p, q)
  _close(y, y_plain, 2e-6)
  _close(g, g_plain, 2e-5)


def _rotary_complex(x, base=10000.0):
  """Rotary embedding as complex multiplication (half-split pairs)."""
  t, d = x.shape[1], x.shape[-1]
  z = x[..., : d // 2] + 1j * x[..., d // 2 :]
  freq = base ** (-np.arange(0, d, 2) / d)
  rot = np.exp(1j * np.arange(t)[:, None] * freq[None, :])
  z = z * rot[None, :, None, :]
  return jnp.concatenate([z.real, z.imag], -1).astype(x.dtype)


class _PlainAttention(fnn.Module):
  heads: int
  rotary: bool

  @fnn.compact
  def __call__(self, x):
    b, t, w = x.shape
    h = fnn.LayerNorm(epsilon=1e-5, name="ln")(x)
    q, k, v = jnp.split(fnn.Dense(3 * w, name="qkv")(h), 3, -1)
    q, k, v = (a.reshape(b, t, self.heads, w // self.heads) for a in (q, k, v))
    if self.rotary:
      q, k = _rotary_complex(q), _rotary_complex(k)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return fnn.Dense(w, name="out")(o.reshape(b, t, w))


@pytest.mark.parametrize("rotary", [False, True], ids=["learned", "rotary"])
def test_attention_is_plain_pre_norm_attention(rotary):
  ours = nn.CausalSelfAttention(4, rotary_base=10000.0 if rotary else None)
  p = ours.init(jax.random.key(0), X)
  pp = p["params"]
  q = {
    "params": {**_plain_norm_params({"params": pp["qkv"]}), "out": pp["out"]}
  }
  q["params"]["qkv"] = q["params"].pop("dense")
  y, y_plain, g, g_plain = _both(ours, _PlainAttention(4, rotary), p, q)
  _close(y, y_plain, 1e-5)
  _close(g, g_plain, 5e-5)


class _PlainMLP(fnn.Module):
  @fnn.compact
  def __call__(self, x):
    h = fnn.Dense(128, name="fc")(fnn.LayerNorm(epsilon=1e-5, name="ln")(x))
    return fnn.Dense(32, name="proj")(jax.nn.gelu(h, approximate=True))


def test_mlp_is_plain_pre_norm_gelu_mlp():
  ours = nn.MLP()
  p = ours.init(jax.random.key(0), X)
  pp = p["params"]
  q = {
    "params": {**_plain_norm_params({"params": pp["fc"]}), "proj": pp["proj"]}
  }
  q["params"]["fc"] = q["params"].pop("dense")
  y, y_plain, g, g_plain = _both(ours, _PlainMLP(), p, q)
  _close(y, y_plain, 1e-5)
  _close(g, g_plain, 5e-5)


class _Block(fnn.Module):
  numerics: nn.Numerics

  @fnn.compact
  def __call__(self, x):
    x = x + nn.CausalSelfAttention(4, numerics=self.numerics)(x)
    return x + nn.MLP(numerics=self.numerics)(x)


@pytest.mark.slow
def test_fp8_block_draws_from_its_rng_stream():
  block = _Block(nn.Numerics.fp8())
  # Init needs no 'lowprec' stream (it falls back to 'params'), and the
  # parameters do not depend on the numerics.
  params = jax.eval_shape(block.init, jax.random.key(0), X)
  params = jax.jit(_Block(nn.Numerics()).init)(jax.random.key(0), X)

  @jax.jit
  def step(params, key):
    f = lambda p: block.apply(p, X, rngs={"lowprec": key})
    y, vjp = jax.vjp(f, params)
    plain = _Block(nn.Numerics()).apply(params, X)
    return (
      _loss(y),
      vjp(jnp.cos(y))[0],
      jnp.linalg.norm(y - plain) / (jnp.linalg.norm(plain)),
    )

  (l1, g1, rel), (l2, g2, _), (l3, _, _) = (
    step(params, jax.random.key(k)) for k in (1, 1, 2)
  )
  assert float(l1) == float(l2) and float(l1) != float(l3)
  _close(g1, g2, 0)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(g1))
  assert 1e-4 < float(rel) < 0.1  # rounded, but close
  with pytest.raises(ValueError, match="rngs=\\{'lowprec'"):
    jax.eval_shape(lambda p: block.apply(p, X), params)


def test_numerics_policy_and_tied_head():
  num = nn.Numerics.fp8(ops.REFERENCE.override("attn.out@delta=fresh"))
  assert hash(num) == hash(nn.Numerics.fp8(str(num.policy)))
  assert num.policy.resolve("attention")["attn.out@delta"] == "fresh"
  with pytest.raises(ValueError, match="no rule for use 'dense.in@dw'"):
    layer = nn.Dense(8, numerics=nn.Numerics(policy="attn.*=rounded"))
    layer.init(jax.random.key(0), X)
  # A tied output head: the kernel comes from outside, no kernel parameter.
  emb = jnp.ones((50, 32)) * 0.01
  head = nn.NormDense(50, use_bias=False)
  p = head.init(jax.random.key(0), X, emb.T)
  assert set(p["params"]) == {"norm_scale", "norm_bias"}
  assert head.apply(p, X, emb.T).shape == (2, 8, 50)

"""Models of the studies (Flax linen).

* `GPT`: decoder with GPT-2 options (pre-LN, learned positions, tied
  embeddings, GELU MLP, scaled residual init) and NeoX-style options (rotary
  positions, parallel attention and MLP, untied embeddings, RMSNorm). The
  124M preset has exactly GPT-2 small's 124,439,808 parameters.
* `MLP`: a two-layer (or deeper) perceptron classifier.
* `CNN`: a small convolutional classifier.
* `Linear`: linear regression on frozen random features.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

PRESETS = {
  # name: (n_layer, n_head, d_model, vocab_size, seq_len)
  "gpt2_124m": (12, 12, 768, 50257, 1024),
  "gpt_390m": (27, 16, 1024, 50304, 1024),
}


def _dense_init(std):
  return nn.initializers.normal(stddev=std)


def rotary(x: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding on [B, T, H, D] (D even), half-split form."""
  t, d = x.shape[1], x.shape[-1]
  inv = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
  cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Norm(nn.Module):
  kind: str = "layernorm"

  @nn.compact
  def __call__(self, x):
    if self.kind == "layernorm":
      return nn.LayerNorm(epsilon=1e-5)(x)
    if self.kind == "rmsnorm":
      return nn.RMSNorm(epsilon=1e-6)(x)
    raise ValueError(f"unknown norm {self.kind!r}; valid: layernorm, rmsnorm")


class Attention(nn.Module):
  n_head: int
  init_std: float
  proj_std: float
  positions: str

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    h = self.n_head
    qkv = nn.Dense(
      3 * d, kernel_init=_dense_init(self.init_std), name="c_attn"
    )(x)
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * h, d // h), 3, axis=2)
    if self.positions == "rotary":
      q, k = rotary(q), rotary(k)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    # exp(s - logsumexp(s)) rather than e / sum(e): XLA may rewrite a division
    # by a broadcast into a reciprocal-multiply in some programs and not in
    # others, which would change bits between device counts.
    probs = jnp.exp(scores - jax.nn.logsumexp(scores, axis=-1, keepdims=True))
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    return nn.Dense(d, kernel_init=_dense_init(self.proj_std), name="c_proj")(
      out
    )


class MLPBlock(nn.Module):
  ratio: int
  init_std: float
  proj_std: float
  activation: str = "gelu"

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    h = nn.Dense(
      self.ratio * d, kernel_init=_dense_init(self.init_std), name="c_fc"
    )(x)
    h = ACTIVATIONS[self.activation](h)
    return nn.Dense(d, kernel_init=_dense_init(self.proj_std), name="c_proj")(h)


ACTIVATIONS = {
  "gelu": lambda x: jax.nn.gelu(x, approximate=True),
  "silu": jax.nn.silu,
  "relu": jax.nn.relu,
}


class Block(nn.Module):
  cfg: dict

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    proj_std = c["init_std"] / (2 * c["n_layer"]) ** 0.5
    attn = Attention(
      c["n_head"], c["init_std"], proj_std, c["positions"], name="attn"
    )
    mlp = MLPBlock(
      c["mlp_ratio"], c["init_std"], proj_std, c["activation"], name="mlp"
    )
    if c["parallel_block"]:
      return (
        x
        + attn(Norm(c["norm"], name="ln_1")(x))
        + mlp(Norm(c["norm"], name="ln_2")(x))
      )
    x = x + attn(Norm(c["norm"], name="ln_1")(x))
    return x + mlp(Norm(c["norm"], name="ln_2")(x))


class GPT(nn.Module):
  """Decoder-only transformer; `cfg` is the config's `model` section."""

  cfg: dict

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    b, t = tokens.shape
    if t > c["seq_len"]:
      raise ValueError(f"sequence of {t} tokens exceeds model.seq_len")
    wte = nn.Embed(
      c["vocab_size"],
      c["d_model"],
      embedding_init=_dense_init(c["init_std"]),
      name="wte",
    )
    x = wte(tokens)
    if c["positions"] == "learned":
      wpe = self.param(
        "wpe", _dense_init(c["init_std"]), (c["seq_len"], c["d_model"])
      )
      x = x + wpe[None, :t]
    elif c["positions"] != "rotary":
      raise ValueError(
        f"unknown model.positions {c['positions']!r}; valid: learned, rotary"
      )
    for i in range(c["n_layer"]):
      x = Block(c, name=f"h_{i}")(x)
    x = Norm(c["norm"], name="ln_f")(x)
    if c["tie_embeddings"]:
      return wte.attend(x)
    return nn.Dense(
      c["vocab_size"],
      use_bias=False,
      kernel_init=_dense_init(c["init_std"]),
      name="lm_head",
    )(x)


class MLP(nn.Module):
  hidden: tuple[int, ...]
  n_out: int
  activation: str = "relu"

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.hidden):
      x = ACTIVATIONS[self.activation](nn.Dense(width, name=f"fc_{i}")(x))
    return nn.Dense(self.n_out, name="out")(x)


class CNN(nn.Module):
  channels: tuple[int, ...]
  n_out: int

  @nn.compact
  def __call__(self, x):
    for i, ch in enumerate(self.channels):
      x = nn.relu(nn.Conv(ch, (3, 3), name=f"conv_{i}")(x))
      if min(x.shape[1:3]) >= 4:
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.mean(axis=(1, 2))
    return nn.Dense(self.n_out, name="out")(x)


class Linear(nn.Module):
  """y = phi . w + b on frozen features phi, zero init."""

  @nn.compact
  def __call__(self, phi):
    w = self.param("w", nn.initializers.zeros, (phi.shape[-1],))
    b = self.param("b", nn.initializers.zeros, ())
    return phi @ w + b

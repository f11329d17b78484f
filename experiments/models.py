"""Models of the studies (Flax linen).

* `GPT`: decoder built on `lowprec.nn` (per-use backward policies, rounded
  saved tensors, emulated FP8) with GPT-2 options (pre-LN, learned
  positions, tied embeddings, GELU MLP, scaled residual init) and NeoX-style
  options (rotary positions, parallel attention and MLP, untied embeddings,
  RMSNorm). The 124M preset has exactly GPT-2 small's 124,439,808
  parameters.
* `MLP`: a two-layer (or deeper) perceptron classifier.
* `CNN`: a small convolutional classifier.
* `Linear`: linear regression on frozen random features.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax

from lowprec import nn as lpnn
from lowprec import ops as lpops
from lowprec import policy as lppolicy
from lowprec.backward.ops.scaled_dense import recipe as block_recipe
from lowprec.grids import choices as names


def _dense_init(std):
  return nn.initializers.normal(stddev=std)


NORMS = {"layernorm": "layer", "rmsnorm": "rms"}
POSITIONS = ("learned", "rotary")


def numerics_from(lp) -> lpnn.Numerics:
  """The `lowprec.nn.Numerics` of a config's `lowprec` section.

  `fwd_format:fwd_rounding` rounds the saved activations (dense inputs, norm
  outputs, attention probabilities and outputs, activation inputs),
  `weight_format` the kernels (nearest), `bwd_format:bwd_rounding` the
  gradients entering the backward's matmuls; `attn_fresh_out` what a
  fresh read of attention's output redraws; `policy` overrides what
  backward uses read, on top of what the reference gradient reads (e.g.
  `"attn.out@delta=fresh"`; "" = the reference reads everywhere);
  `compute` a block-scaled recipe for every dense layer
  (`lowprec.ops.scaled_dense.recipe`).
  """

  def rounding(fmt, mode):
    return None if fmt == "float32" else lpnn.Rounding(fmt, mode)

  compute = None
  if lp.get("compute", ""):
    compute = block_recipe(lp.compute, lp.compute_changes)
  return lpnn.Numerics(
    policy=lpops.REFERENCE.override(lp.policy) if lp.policy else None,
    saved=rounding(lp.fwd_format, lp.fwd_rounding),
    weights=rounding(lp.weight_format, "nearest"),
    grads=rounding(lp.bwd_format, lp.bwd_rounding),
    attn_fresh_out=lp.attn_fresh_out,
    compute=compute,
    native_fp8=bool(lp.get("native_fp8", False)),
  )


def check_policy(lp) -> None:
  """Resolves the config's policy against every op (unknown uses raise)."""
  num = numerics_from(lp)
  for op in lppolicy.USES:
    num.policy.resolve(op)


class Block(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); or, with
  `parallel_block`, x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX)."""

  cfg: dict
  numerics: lpnn.Numerics

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    init = _dense_init(c["init_std"])
    proj = _dense_init(c["init_std"] / (2 * c["n_layer"]) ** 0.5)
    norm = _norm(c["norm"])
    attn = lpnn.CausalSelfAttention(
      c["n_head"],
      norm=norm,
      rotary_base=10000.0 if c["positions"] == "rotary" else None,
      numerics=self.numerics,
      kernel_init=init,
      out_kernel_init=proj,
      name="attn",
    )
    mlp = lpnn.MLP(
      c["mlp_ratio"] * x.shape[-1],
      c["activation"],
      norm=norm,
      numerics=self.numerics,
      kernel_init=init,
      out_kernel_init=proj,
      name="mlp",
    )
    if c["parallel_block"]:
      return x + attn(x) + mlp(x)
    x = x + attn(x)
    return x + mlp(x)


def _norm(name: str) -> str:
  names.check_choice("model.norm", name, NORMS)
  return NORMS[name]


class GPT(nn.Module):
  """Decoder-only transformer; `cfg` is the config's `model` section.

  Built on `lowprec.nn`, so every rounded tensor and backward read comes
  from `numerics`; with the default `Numerics()` it is the plain float32
  model.
  """

  cfg: dict
  numerics: lpnn.Numerics = lpnn.Numerics()

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
      names.check_choice("model.positions", c["positions"], POSITIONS)
    # With `remat`, each block's backward recomputes its forward (the same
    # draws: the rng of a block is the same on recompute), so a backward
    # pass holds one block's activations rather than every block's.
    remat = bool(c.get("remat"))
    # The last `compute_keep_last` blocks and the head keep the numerics
    # without a block-scaled recipe (as FP4 recipes keep their last layers).
    plain = dataclasses.replace(self.numerics, compute=None)
    first_plain = c["n_layer"] - c.get("compute_keep_last", 0)
    for num, layers in (
      (self.numerics, range(first_plain)),
      (plain, range(max(first_plain, 0), c["n_layer"])),
    ):
      names_ = [f"h_{i}" for i in layers]
      if c.get("scan_layers", True):
        # One compiled body for every block (the same bits and parameter
        # paths as the loop below; lowprec.nn.rolled).
        make = functools.partial(Block, c, num)
        x = lpnn.rolled(self, make, names_, x, remat=remat, rng=num.rng)
        continue
      block = nn.remat(Block) if remat else Block
      for name in names_:
        x = block(c, num, name=name)(x)
    # Final norm and the head as one NormDense: its output is a saved
    # tensor read by the head's weight gradient and the norm's gain gradient.
    head = lpnn.NormDense(
      c["vocab_size"],
      _norm(c["norm"]),
      use_bias=False,
      numerics=plain,
      kernel_init=_dense_init(c["init_std"]),
      name="ln_f",
    )
    if c["tie_embeddings"]:
      return head(x, kernel=wte.embedding.T)
    return head(x)


def layer_groups(cfg: dict) -> list[tuple[str, int, int]]:
  """The GPT's runs of blocks that share a body, as `(prefix, start,
  stop)` (`lowprec.engine.stacked`): the blocks with the config's
  numerics, then the `compute_keep_last` blocks that keep the plain ones."""
  n = cfg["n_layer"]
  first_plain = max(n - cfg.get("compute_keep_last", 0), 0)
  runs = [(0, first_plain), (first_plain, n)]
  return [("h", a, b) for a, b in runs if b > a]


ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu}


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

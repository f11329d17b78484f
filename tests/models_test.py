"""Model shapes and exact parameter counts (nothing allocated)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common, presets
from experiments import models, tasks
from lowprec import nn as lpnn


def _shape(name):
  """(layers, heads, width, vocabulary, length) of a model preset."""
  keys = ("n_layer", "n_head", "d_model", "vocab_size", "seq_len")
  return tuple(presets.PRESETS[name][k] for k in keys)


def _gpt_config(preset=None, **kw):
  c = common.get_config()
  if preset:
    n_layer, n_head, d, vocab, seq = _shape(preset)
    kw = (
      dict(
        n_layer=n_layer, n_head=n_head, d_model=d, vocab_size=vocab, seq_len=seq
      )
      | kw
    )
  c.model.update(kw)
  return tasks._gpt_cfg(c.model)


def _count(module, example):
  shapes = jax.eval_shape(module.init, jax.random.key(0), example)
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def test_gpt2_small_has_exactly_124439808_parameters():
  cfg = _gpt_config("gpt2_124m")
  n = _count(models.GPT(cfg), jax.ShapeDtypeStruct((1, 1024), jnp.int32))
  assert n == 124_439_808


def test_gpt_390m_preset_count():
  cfg = _gpt_config("gpt_390m")
  n = _count(models.GPT(cfg), jax.ShapeDtypeStruct((1, 1024), jnp.int32))
  # 27 blocks of 12*d^2 + 13*d, tied 50304-token embedding, learned
  # positions, final norm: computed independently of the module.
  d, v, t, layers = 1024, 50304, 1024, 27
  assert n == layers * (12 * d * d + 13 * d) + v * d + t * d + 2 * d
  assert 385e6 < n < 395e6


@pytest.mark.parametrize(
  "kw",
  [
    {},
    {
      "positions": "rotary",
      "parallel_block": True,
      "tie_embeddings": False,
      "norm": "rmsnorm",
      "activation": "silu",
    },
  ],
  ids=["gpt2-style", "neox-style"],
)
def test_gpt_forward_shapes_and_causality(kw):
  cfg = _gpt_config(**kw)
  model = models.GPT(cfg)
  x = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  params = model.init(jax.random.key(1), x)["params"]
  y = model.apply({"params": params}, x)
  assert y.shape == (2, 16, 256)
  # Changing a later token never changes an earlier position's logits.
  x2 = x.at[:, 10].set((x[:, 10] + 1) % 256)
  y2 = model.apply({"params": params}, x2)
  np.testing.assert_array_equal(np.asarray(y[:, :10]), np.asarray(y2[:, :10]))
  assert not np.allclose(np.asarray(y[:, 10:]), np.asarray(y2[:, 10:]))
  assert ("kernel" in params["ln_f"]) == (not cfg["tie_embeddings"])


def test_rotary_preserves_norms_and_relative_positions():
  x = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
  r = lpnn.rotary(x)
  np.testing.assert_allclose(
    jnp.linalg.norm(r, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
  )
  # Same vector at every position: dot products depend on the offset only.
  v = jnp.broadcast_to(x[:, :1], x.shape)
  rv = lpnn.rotary(v)[0, :, 0]
  dots = rv @ rv.T
  np.testing.assert_allclose(dots[0, 2], dots[3, 5], rtol=1e-4)


@pytest.mark.parametrize(
  "module, shape",
  [
    (models.MLP((32,), 10), (4, 8, 8, 1)),
    (models.CNN((4, 8), 10), (4, 8, 8, 1)),
    (models.Linear(), (4, 12)),
  ],
  ids=["mlp", "cnn", "linear"],
)
def test_small_models(module: nn.Module, shape):
  x = jnp.ones(shape)
  params = module.init(jax.random.key(0), x)["params"]
  y = module.apply({"params": params}, x)
  assert y.shape == ((4, 10) if len(shape) == 4 else (4,))

"""The gradient probe's rows in chunks: same statistics, bounded memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import probes


def _losses():
  def loss(p, batch, key):
    x, y = batch
    noise = 0.1 * jax.random.normal(key, y.shape)
    return jnp.mean((x @ p["w"] - y + noise) ** 2)

  def ref(p, batch, key):
    x, y = batch
    return jnp.mean((x @ p["w"] - y) ** 2)

  return loss, ref


@pytest.mark.parametrize("chunk_rows", [1, 2, 4], ids=lambda n: f"chunks{n}")
def test_probe_in_row_chunks_matches_the_whole_batch(chunk_rows):
  # The reference loss reads no randomness, so its gradient over the batch
  # is the mean of its chunks' gradients: rel_err and cos of a run whose
  # loss equals the reference are the same in any chunking.
  rng = np.random.default_rng(0)
  batch = (
    jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
    jnp.asarray(rng.normal(size=(8,)), jnp.float32),
  )
  params = {"w": jnp.asarray([0.3, -0.2, 0.1], jnp.float32)}
  _, ref = _losses()
  key = jax.random.key(1)
  groups = {"all": ".*"}
  whole = jax.jit(probes.gradient_probe(ref, ref, batch, groups, 4))(
    params, key
  )
  parts = jax.jit(
    probes.gradient_probe(ref, ref, batch, groups, 4, chunk_rows)
  )(params, key)
  assert float(parts["probe/all/rel_err"]) == 0.0
  assert float(parts["probe/all/cos"]) == pytest.approx(1.0)
  assert float(parts["probe/all/norm_ratio"]) == pytest.approx(
    float(whole["probe/all/norm_ratio"])
  )


def test_probe_chunks_must_divide_the_batch():
  loss, ref = _losses()
  batch = (jnp.zeros((6, 3)), jnp.zeros((6,)))
  with pytest.raises(ValueError, match="probe_chunk_rows=4 must divide"):
    probes.gradient_probe(loss, ref, batch, {"all": ".*"}, 2, 4)


def test_chunked_run_gradient_is_the_mean_of_its_chunks():
  # A noisy run loss: each chunk draws its own key, and the probe still
  # sees the full-batch mean gradient up to that noise (bias near zero).
  loss, ref = _losses()
  rng = np.random.default_rng(2)
  batch = (
    jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
    jnp.asarray(rng.normal(size=(16,)), jnp.float32),
  )
  params = {"w": jnp.zeros(3, jnp.float32)}
  out = jax.jit(probes.gradient_probe(loss, ref, batch, {"all": ".*"}, 64, 4))(
    params, jax.random.key(3)
  )
  assert float(out["probe/all/cos"]) > 0.99
  assert float(out["probe/all/bias"]) < 0.05

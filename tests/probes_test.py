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


@pytest.mark.slow
def test_lean_probe_gives_the_bits_of_the_one_program_probe_on_a_gpt():
  # The attention-reuse arm (biased reads, stochastic roundings) on a
  # small GPT, perturbed off init: the lean probe (separate programs, a
  # host loop over draws) reads the same draws and sums in the same order,
  # so every statistic has the same bits; each of its programs needs fewer
  # temporaries than the one program.
  from configs import attention_reuse
  from experiments import study, tasks

  c = study.resolve(attention_reuse.get_config(), "reuse", 0)
  c.unlock()
  c.model.update(dict(n_layer=2, d_model=32, seq_len=32))
  c.train.probe_draws, c.train.probe_batch_size = 2, 4
  c.train.probe_chunk_rows = 2
  out, temps, params = {}, {}, None
  noise = jax.random.key(3)
  for lean in (False, True):
    c.train.probe_lean = lean
    task = tasks.build(c)
    if params is None:
      init = jax.jit(task.init)(jax.random.key(0))
      params = jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(noise, x.shape), init
      )
    out[lean] = jax.device_get(task.probe(params, jax.random.key(1)))
    temps[lean] = [
      p.memory_analysis().temp_size_in_bytes
      for p in task.probe.programs(params, jax.random.key(1))
    ]
  assert out[False].keys() == out[True].keys()
  assert float(out[False]["probe/qkv/rel_err"]) > 0  # the reads differ
  for k, v in out[False].items():
    assert np.asarray(v).tobytes() == np.asarray(out[True][k]).tobytes(), k
  assert len(temps[True]) == 3 and max(temps[True]) < temps[False][0]

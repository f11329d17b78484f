"""`lowprec.nn.rolled`: blocks compiled once, as the unrolled loop computes.

Oracle: the same GPT with `scan_layers=False` (the loop of linen modules).
Every stochastic draw is the loop's (each layer draws its own keys), and
the loss and gradients equal the loop's to float32 rounding: XLA compiles
a scan body with other fusions than the unrolled layers, so the last bits
may differ (the plain float32 loss by one ulp here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from experiments import models, tasks
from lowprec import nn as lpnn
from lowprec import ops
from lowprec.engine import stacked


def _cfg(**kw):
  c = common.get_config()
  c.model.update(dict(n_layer=3, n_head=2, d_model=32, seq_len=16))
  c.model.vocab_size = 64
  return tasks._gpt_cfg(c.model) | kw


TOKENS = jax.random.randint(jax.random.key(3), (2, 16), 0, 64)


def _run(cfg, numerics, key=7):
  model = models.GPT(cfg, numerics)
  params = model.init(jax.random.key(0), TOKENS)["params"]

  def loss(p):
    y = model.apply(
      {"params": p}, TOKENS, rngs={"lowprec": jax.random.key(key)}
    )
    return jnp.sum(y**2)

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return params, value, grads


CASES = {
  # Draws per layer at a cost the default run affords; the FP8 cases
  # (several roundings and scales a block) take minutes here.
  "bf16_sr": dict(numerics=lpnn.Numerics(saved="bfloat16:stochastic"), cfg={}),
  "fp8_sr": dict(numerics=lpnn.Numerics.fp8(), cfg={}),
  "fp8_sr_remat_keep_last": dict(
    numerics=lpnn.Numerics.fp8(), cfg={"remat": True, "compute_keep_last": 1}
  ),
  "neox": dict(
    numerics=lpnn.Numerics.fp8(),
    cfg={"positions": "rotary", "parallel_block": True, "norm": "rmsnorm"},
  ),
  "mxfp8_recipe": dict(
    numerics=lpnn.Numerics(compute=ops.ScaledDense.mxfp8()), cfg={}
  ),
  "float32": dict(numerics=lpnn.Numerics(), cfg={}),
}


SLOW = {"neox", "mxfp8_recipe"}  # other block shapes: the slow suite


@pytest.mark.parametrize(
  "case",
  [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW)) for c in CASES],
  ids=list(CASES),
)
def test_rolled_blocks_compute_what_the_loop_computes(case):
  numerics, extra = CASES[case]["numerics"], CASES[case]["cfg"]
  p0, l0, g0 = _run(_cfg(scan_layers=False, **extra), numerics)
  p1, l1, g1 = _run(_cfg(scan_layers=True, **extra), numerics)
  assert jax.tree.structure(p0) == jax.tree.structure(p1)
  assert "h_2" in p1 and "h_0" in p1  # per-layer paths, not a stacked h
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
    np.testing.assert_array_equal(a, b)  # init runs the loop
  # A draw taken with another layer's key would move the loss by ~1e-3.
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  flat = jax.tree_util.tree_flatten_with_path(g0)[0]
  for (path, a), b in zip(flat, jax.tree.leaves(g1), strict=True):
    scale = float(np.max(np.abs(a))) or 1.0
    np.testing.assert_allclose(
      b, a, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
    )


def test_each_rolled_layer_draws_its_own_keys():
  """A different stream key changes the rolled forward (it draws), and
  the rolled forward matches the loop for each of two keys: the keys are
  taken per layer from the stream, not fixed or shared."""
  numerics = lpnn.Numerics.fp8()
  losses = {}
  for scan in (False, True):
    for key in (7, 8):
      losses[scan, key] = float(_run(_cfg(scan_layers=scan), numerics, key)[1])
  assert abs(losses[True, 7] / losses[True, 8] - 1) > 1e-4
  for key in (7, 8):
    np.testing.assert_allclose(losses[True, key], losses[False, key], rtol=1e-5)


def test_rolled_blocks_read_stacked_params_as_they_are():
  """Params storing the blocks stacked (`h_0:3`, lowprec.engine.stacked)
  give the per-layer params' loss and gradients bit for bit (the same
  scan over the same values), the gradient stacked as they are."""
  cfg = _cfg(scan_layers=True)
  numerics = lpnn.Numerics(saved="bfloat16:stochastic")
  params, value, grads = _run(cfg, numerics)
  model = models.GPT(cfg, numerics)
  together = stacked.stack(params, [("h", 0, 3)])

  def loss(p):
    y = model.apply({"params": p}, TOKENS, rngs={"lowprec": jax.random.key(7)})
    return jnp.sum(y**2)

  value_s, grads_s = jax.jit(jax.value_and_grad(loss))(together)
  np.testing.assert_array_equal(value_s, value)
  assert "h_0:3" in grads_s and "h_0" not in grads_s
  for a, b in zip(
    jax.tree.leaves(stacked.unstack(grads_s)),
    jax.tree.leaves(grads),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)


def _program_size(n_layer, scan):
  cfg = _cfg(scan_layers=scan, n_layer=n_layer)
  model = models.GPT(cfg, lpnn.Numerics.fp8())
  params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]

  def loss(p):
    y = model.apply({"params": p}, TOKENS, rngs={"lowprec": jax.random.key(1)})
    return jnp.sum(y**2)

  return len(jax.jit(jax.grad(loss)).lower(params).as_text().splitlines())


def test_the_rolled_program_does_not_grow_with_depth():
  """The lowered program (what XLA compiles) for 8 layers is within 1.3x
  of the one for 2 when rolled; the loop's grows about 4x."""
  rolled = _program_size(8, True) / _program_size(2, True)
  loop = _program_size(8, False) / _program_size(2, False)
  assert rolled < 1.3, rolled
  assert loop > 2.5, loop


def test_full_scale_presets_roll_their_layers():
  from configs import presets

  c = common.get_config()
  assert not c.model.scan_layers  # CPU scale: the documented numbers' loop
  presets.use(c, "gpt2_124m")
  assert c.model.scan_layers

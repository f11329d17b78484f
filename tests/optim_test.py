"""Clipping by a gradient norm summed in a fixed order."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import optim


def _tree(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "a": jnp.asarray(rng.normal(size=(37, 5)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    "c": jnp.asarray(rng.normal(size=()), jnp.float32),
  }


def test_global_norm_is_the_norm():
  t = _tree()
  want = float(optax.tree.norm(t))
  assert float(optim.global_norm(t)) == pytest.approx(want, rel=1e-6)
  assert float(optim.global_norm({})) == 0.0


def test_global_norm_is_the_same_bits_on_one_and_eight_devices():
  t = {**_tree(1), "a": _tree(1)["a"][:32]}
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  t8 = {**t, "a": jax.device_put(t["a"], spec)}
  norm = jax.jit(optim.global_norm)
  assert np.asarray(norm(t)).tobytes() == np.asarray(norm(t8)).tobytes()


@pytest.mark.parametrize("max_norm", [0.5, 100.0], ids=["clips", "passes"])
def test_clip_matches_optax(max_norm):
  t = _tree(2)
  ours, _ = optim.clip_by_global_norm(max_norm).update(t, optax.EmptyState())
  theirs, _ = optax.clip_by_global_norm(max_norm).update(t, optax.EmptyState())
  for k in t:
    np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6)
  assert float(optim.global_norm(ours)) <= max_norm * (1 + 1e-6) or (
    max_norm == 100.0
  )


def _stored_state_config(tmp_path, state):
  from configs import smoke
  from experiments import study

  c = smoke.get_config()
  c.lowprec.state = state
  c.train.steps = 4
  c.log.results_dir = str(tmp_path)
  return study.resolve(c, "sr_bf16", 0)


@pytest.mark.slow  # about 80 s on 2 CPU cores, most of it compiling
def test_a_stored_state_arm_trains_with_narrow_moments_and_telemetry(
  tmp_path,
):
  from experiments import results, train

  state = ("mu=bfloat16:stochastic", "nu=float8_e5m2:stochastic:block128")
  config = _stored_state_config(tmp_path, state)
  tx = optim.build(config, jax.random.key(0))
  params = {"w": jax.ShapeDtypeStruct((4, 256), jnp.float32)}
  adam = jax.eval_shape(tx.init, params)[1].inner[0]
  assert adam.mu["w"].dtype == jnp.bfloat16
  assert adam.nu["w"].dtype == jnp.float8_e5m2
  summary = train.train_and_evaluate(config)
  assert np.isfinite(summary["final_loss"])
  path = os.path.join(results.run_dir(config), "metrics.jsonl")
  last = results.read_metrics(path)[-1]
  assert last["state/steps"] == 4 and last["state/changed"] > 0
  assert "moved" in last  # the write-back's telemetry next to it


def test_bad_stored_state_entries_are_rejected_before_training(tmp_path):
  with pytest.raises(ValueError, match=r"'mu' is not 'regex=spec'"):
    _stored_state_config(tmp_path, ("mu",))
  with pytest.raises(ValueError, match=r"'mu=bfloat6'.*Did you mean"):
    _stored_state_config(tmp_path, ("mu=bfloat6",))


# ---- compensated write-back arms --------------------------------------------


def _config(**lp):
  from configs import common

  c = common.get_config()
  c.lowprec.writeback = "bfloat16"
  c.opt.warmup_steps = 0  # a first step that moves the weights
  c.lowprec.update(lp)
  return c


@pytest.mark.parametrize(
  "compensation, buffer_dtype",
  [
    ("kahan", jnp.float8_e5m2),
    ("two_component", jnp.bfloat16),
    ("remainder", jnp.uint16),
  ],
)
def test_a_config_picks_the_compensated_write_back(compensation, buffer_dtype):
  import lowprec
  from experiments import study

  buffer = {"buffer": "float8_e5m2"} if compensation == "kahan" else {}
  c = _config(compensation=compensation, **buffer)
  study.validate(c)
  params = lowprec.to_grid(_tree(3), "bfloat16")
  tx = optim.build(c, jax.random.key(0))
  updates, state = tx.update(_tree(4), tx.init(params), params)
  (wb,) = [s for s in state if isinstance(s, lowprec.CompensatedState)]
  assert wb.buffer["a"].dtype == buffer_dtype
  lowprec.check_on_grid(optax.apply_updates(params, updates), "bfloat16")
  assert lowprec.telemetry(state)["moved"] > 0


def test_compensation_names_and_combinations_are_checked():
  from experiments import study

  with pytest.raises(ValueError, match="Did you mean 'kahan'"):
    study.validate(_config(compensation="kahn"))
  c = _config(compensation="kahan")
  c.lowprec.writeback = ""
  with pytest.raises(ValueError, match="set lowprec.writeback"):
    study.validate(c)
  with pytest.raises(ValueError, match="lowprec.buffer: unknown format"):
    study.validate(_config(compensation="kahan", buffer="bf16x"))
  c = _config(compensation="remainder", rounding="stochastic")
  with pytest.raises(ValueError, match="rounding='nearest'"):
    optim.build(c, jax.random.key(0))
  assert optim.compensation(_config()) == "none"


# ---- compensated-write-back prediction in a float32 arm --------------------


def _fp32_config(**lp):
  c = _config(**lp)
  c.lowprec.writeback = ""
  return c


def test_a_float32_config_predicts_the_compensated_write_backs():
  import lowprec
  from experiments import study

  remedies = (
    "bfloat16:kahan:bfloat16",
    "bfloat16:kahan:float8_e5m2",
    "bfloat16:two_component",
  )
  c = _fp32_config(trace_targets=("bfloat16",), trace_remedies=remedies)
  study.validate(c)
  assert optim.has_telemetry(c.lowprec)
  params = lowprec.to_grid(_tree(3), "bfloat16")
  tx = optim.build(c, jax.random.key(0))
  updates, state = tx.update(_tree(4), tx.init(params), params)
  tel = lowprec.telemetry(state)
  for name in (
    "bfloat16_kahan_bfloat16",
    "bfloat16_kahan_float8_e5m2",
    "bfloat16_two_component",
  ):
    assert tel[f"pred/{name}/proposals"] == 37 * 5 + 3 + 1
  assert "pred/bfloat16/erased_fraction" in tel
  # keep_float32 leaves the matching parameters out, as the write-back does.
  c.lowprec.keep_float32 = "c"
  tx = optim.build(c, jax.random.key(0))
  _, state = tx.update(_tree(4), tx.init(params), params)
  tel = lowprec.telemetry(state)
  assert tel["pred/bfloat16_two_component/proposals"] == 37 * 5 + 3


@pytest.mark.parametrize(
  "remedies, match",
  [
    (("bfloat16",), "not 'weights:kind\\[:buffer\\]'; e.g."),
    (("bfloat16:kahn",), "Did you mean 'kahan'"),
    (("bfloat16:kahan:bf16",), "unknown format"),
    (("bfloat6:kahan",), "unknown format"),
    (("bfloat16:two_component:bfloat16",), "write 'bfloat16:two_component'"),
    (("bfloat16:kahan:float64",), "wider than float32"),
    (("bfloat16:kahan", "bfloat16:kahan:bfloat16"), "twice"),
  ],
  ids=["form", "kind", "buffer", "weights", "buffer-two", "wide", "twice"],
)
def test_bad_trace_remedies_are_rejected_before_training(remedies, match):
  from experiments import study

  with pytest.raises(ValueError, match=match) as e:
    study.validate(_fp32_config(trace_remedies=remedies))
  assert "lowprec.trace_remedies" in str(e.value)


def test_trace_remedies_in_a_low_precision_arm_is_refused():
  from experiments import study

  c = _config(trace_remedies=("bfloat16:kahan",))
  with pytest.raises(ValueError, match="float32 reference arm"):
    study.validate(c)


def test_state_targets_build_a_state_trace_and_bad_ones_are_rejected():
  import lowprec
  from experiments import study

  good = ("rn: mu=bfloat16; nu=bfloat16", "sr: nu=bfloat16:stochastic")
  c = _fp32_config(state_targets=good)
  study.validate(c)
  assert optim.has_telemetry(c.lowprec)
  params = _tree(3)
  tx = optim.build(c, jax.random.key(0))
  _, state = tx.update(_tree(4), tx.init(params), params)
  tel = lowprec.telemetry(state)
  assert tel["pred_state/rn/changed"] > 0 and "pred_state/sr/erased" in tel
  for entries, match in [
    (("mu=bfloat16",), "not 'name: regex=spec"),
    (("rn:",), "not 'name: regex=spec"),
    (("rn: mu=bfloat16", "rn: nu=bfloat16"), "names 'rn' twice"),
    (("rn: mu=bfloat17",), "lowprec.state_targets 'rn' entry"),
  ]:
    with pytest.raises(ValueError, match=match):
      study.validate(_fp32_config(state_targets=entries))
  stored = _fp32_config(state_targets=good, state=("mu=bfloat16",))
  with pytest.raises(ValueError, match="arm without lowprec.state"):
    study.validate(stored)

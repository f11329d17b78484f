"""The optimizer chain a config builds: clipping by a gradient norm summed
in a fixed order, stored state, the compensated write-backs (eco and split
among them) and their checks, and runs of them through the entry point."""

import json
import os
import platform
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import lowprec_config, optim


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


def test_the_fixed_order_sum_is_the_padded_halving_tree():
  # Oracle: numpy float32, the vector zero-padded to a power of two and
  # its halves added until one is left. Sizes around powers of two, huge
  # and tiny magnitudes, signed zeros; seed 0.
  def oracle(x):
    n = 1 << max(0, (x.size - 1).bit_length())
    x = np.concatenate([x, np.zeros(n - x.size, np.float32)])
    while x.size > 1:
      x = x[: x.size // 2] + x[x.size // 2 :]
    return x[0]

  rs = np.random.default_rng(0)
  fn = jax.jit(optim._pairwise_sum)
  for n in [*range(0, 40), 63, 64, 65, 1023, 1025, 4097, 100_003]:
    scale = np.float32(10.0) ** rs.integers(-30, 30, n).astype(np.float32)
    for x in (rs.standard_normal(n).astype(np.float32) * scale, -np.zeros(n)):
      x = x.astype(np.float32)
      got = np.asarray(fn(jnp.asarray(x)), np.float32)
      assert got.tobytes() == np.float32(oracle(x)).tobytes(), n


def test_global_norm_compiles_one_program_per_kind_of_leaf():
  # 2 and 16 layers of the same leaves give as many fusions: the leaves
  # are squared and summed stacked and their sums come back as one vector
  # (squared leaf by leaf, or sliced out of the stack leaf by leaf, the
  # program grew from 21 to 110 fusions).
  def fusions(n_layer):
    rs = np.random.default_rng(0)
    tree = {
      f"h_{i}": {"w": rs.standard_normal((24, 72)), "b": rs.standard_normal(24)}
      for i in range(n_layer)
    } | {"wte": rs.standard_normal((40, 24))}
    tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    hlo = jax.jit(optim.global_norm).lower(tree).compile().as_text()
    return len(re.findall(r" fusion\(", hlo))

  n2, n16 = fusions(2), fusions(16)
  assert n16 <= n2 + 4, (n2, n16)


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


def test_a_step_whose_every_proposal_is_not_finite_stops_the_run(tmp_path):
  # A NaN learning rate (here past the config checks, which refuse it)
  # makes every proposal NaN: the write-back keeps every weight, so the
  # loss stays finite and the loss guard would never fire. The loop stops
  # after writing the step's record, naming opt.lr; no summary is written.
  import math

  from experiments import results, train

  config = _stored_state_config(tmp_path, ())
  config.unlock()
  config.opt.lr = float("nan")
  with pytest.raises(train.NonFiniteLoss) as e:
    train.train_and_evaluate(config)
  msg = str(e.value)
  assert "every proposal of step 1 was non-finite" in msg
  assert "--config.opt.lr" in msg and "\n" not in msg
  d = results.run_dir(config)
  recs = results.read_metrics(os.path.join(d, "metrics.jsonl"))
  last = recs[-1]
  assert last["step"] == 1 and math.isfinite(last["loss"])
  assert last["proposals"] == 0 and last["nonfinite"] > 0
  assert f"({last['nonfinite']} NaN or inf" in msg
  assert not os.path.exists(os.path.join(d, "summary.json"))


@pytest.mark.parametrize(
  "record, want",
  [
    ({"proposals": 0, "nonfinite": 7, "nonfinite/w": 7}, 7),
    ({"proposals": 3, "nonfinite": 7}, 0),  # some proposals were finite
    ({"proposals": 0, "nonfinite": 0}, 0),  # nothing proposed (lr 0)
    (
      {"a/proposals": 0, "a/nonfinite": 2, "b/proposals": 0, "b/nonfinite": 3},
      5,
    ),
    ({"a/proposals": 0, "a/nonfinite": 2, "b/proposals": 1}, 0),
    ({"proposals": 0, "nonfinite": 1, "proposals#1": 4, "nonfinite#1": 0}, 0),
    ({"proposals": 0, "nonfinite": 0, "nonfinite/w": 3}, 0),
    ({"proposals": 0, "nonfinite": 0, "state/nonfinite": 9}, 0),
    ({"pred/bfloat16/proposals": 0, "pred/bfloat16/nonfinite": 4}, 0),
    ({"loss": 2.0, "lr": 1e-3}, 0),  # a float32 run: no write-back
  ],
)
def test_nonfinite_step_reads_the_write_backs_totals_only(record, want):
  assert optim.nonfinite_step(record) == want


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
  assert lowprec_config.compensation(_config()) == "none"


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


# ---- eco and split weights ---------------------------------------------------


def test_eco_wraps_the_clipped_adamw_with_its_schedule_and_decay():
  # The chain is clip -> eco(AdamW): the same bits as built by hand, with
  # the config's schedule (warmup, cosine), betas and decoupled decay.
  import lowprec
  from experiments import study

  c = _config(compensation="eco", rounding="stochastic")
  c.opt.warmup_steps, c.opt.clip_norm = 2, 0.5
  study.validate(c)
  key = jax.random.key(0)
  tx = optim.build(c, key)
  lr = optim.schedule(c.opt, c.train.steps)
  adamw = optax.adamw(
    lr, b1=c.opt.b1, b2=c.opt.b2, eps=c.opt.eps, weight_decay=0.1
  )
  wb_key = jax.random.split(key)[0]
  eco = lowprec.eco(adamw, "bfloat16", "stochastic", key=wb_key)
  by_hand = optax.chain(optim.clip_by_global_norm(0.5), eco)
  params = lowprec.to_grid(_tree(3), "bfloat16")
  states = [tx.init(params), by_hand.init(params)]
  for step in range(3):
    grads = _tree(4 + step)
    outs = [
      t.update(grads, s, params)
      for t, s in zip((tx, by_hand), states, strict=True)
    ]
    for a, b in zip(*(jax.tree.leaves(o[0]) for o in outs), strict=True):
      np.testing.assert_array_equal(a, b)
    params = optax.apply_updates(params, outs[0][0])
    states = [o[1] for o in outs]
  (state,) = [s for s in states[0] if isinstance(s, lowprec.EcoState)]
  assert state.inner[0].mu["a"].dtype == jnp.float32
  lowprec.check_on_grid(params, "bfloat16")
  tel = lowprec.telemetry(states[0])
  assert tel["carried"] > 0 and tel["moved"] > 0


@pytest.mark.parametrize("bits, dtype", [(8, jnp.int8), (16, jnp.int16)])
def test_split_keeps_a_correction_of_the_configured_width(bits, dtype):
  import lowprec
  from experiments import study

  c = _config(compensation="split", correction_bits=bits)
  study.validate(c)
  params = lowprec.to_grid(_tree(3), "bfloat16")
  tx = optim.build(c, jax.random.key(0))
  updates, state = tx.update(_tree(4), tx.init(params), params)
  (split,) = [s for s in state if isinstance(s, lowprec.SplitState)]
  assert split.correction["a"].dtype == dtype
  lowprec.check_on_grid(optax.apply_updates(params, updates), "bfloat16")
  assert {"lost", "carried", "moved"} <= set(lowprec.telemetry(state))


def test_eco_takes_a_stored_first_moment_only_with_stochastic_rounding():
  # The store wraps eco and rounds the moment after the fold: nearest
  # rounding would drop the folds, so it is refused when the chain is
  # built on the params (the dry build), naming the stochastic spec.
  import lowprec

  params = lowprec.to_grid(_tree(3), "bfloat16")
  ok = ("mu=dynamic8:stochastic:block256", "nu=dynamic8u:block256")
  c = _config(compensation="eco", state=ok)
  tx = optim.build(c, jax.random.key(0))
  state = tx.init(params)
  assert state[1].inner.inner[0].mu["a"].dtype == jnp.uint8
  updates, state = tx.update(_tree(4), state, params)
  tel = lowprec.telemetry(state)
  assert tel["carried"] > 0 and tel["state/changed"] > 0
  for spec, fix in [
    ("mu=dynamic8:block256", "{'mu': 'dynamic8:stochastic:block256'}"),
    ("mu=bfloat16", "{'mu': 'bfloat16:stochastic'}"),
    ("mu=bfloat16:deadzone", "{'mu': 'bfloat16:stochastic'}"),
  ]:
    tx = optim.build(
      _config(compensation="eco", state=(spec,)), jax.random.key(0)
    )
    with pytest.raises(ValueError, match="inner/0/mu/a") as e:
      jax.eval_shape(tx.init, params)
    assert fix in str(e.value)


SPLIT, ECO = {"compensation": "split"}, {"compensation": "eco"}
MX = {"writeback": "mxfp8_e4m3"}
# id -> (lowprec overrides of a bfloat16 write-back, what the error says)
BAD_COMPENSATIONS = {
  "unknown": (
    {"compensation": "ecoo"},
    "valid: none, kahan, two_component, remainder, split, eco",
  ),
  "split-fp8": (
    {**SPLIT, "writeback": "float8_e4m3fn"},
    "--config.lowprec.writeback=bfloat16",
  ),
  "split-int8": ({**SPLIT, "writeback": "int8"}, "writeback='bfloat16'"),
  "split-mx": ({**SPLIT, **MX}, "--config.lowprec.compensation=none"),
  "split-sr": (
    {**SPLIT, "rounding": "stochastic"},
    "--config.lowprec.rounding=nearest",
  ),
  "split-deadzone": (
    {**SPLIT, "rounding": "deadzone"},
    "--config.lowprec.rounding=nearest",
  ),
  "split-ieee": (
    {**SPLIT, "overflow": "ieee"},
    "--config.lowprec.overflow=saturate",
  ),
  "bits-12": (
    {**SPLIT, "correction_bits": 12},
    "--config.lowprec.correction_bits=8",
  ),
  "bits-without-split": (
    {"correction_bits": 16},
    "--config.lowprec.compensation=split",
  ),
  "eco-deadzone": (
    {**ECO, "rounding": "deadzone"},
    "--config.lowprec.rounding=nearest",
  ),
  "eco-float32": ({**ECO, "writeback": ""}, "set lowprec.writeback"),
  "eco-keep-scales": (
    {**ECO, **MX, "writeback_scales": "keep"},
    "--config.lowprec.writeback_scales=recompute",
  ),
  "eco-decay-erasure": (
    {**ECO, "decay_erasure": True},
    "lowprec.decay_erasure counts",
  ),
  "eco-state-targets": (
    {**ECO, "state_targets": ("rn: mu=bfloat16",)},
    "lowprec.state_targets wraps eco",
  ),
}


@pytest.mark.parametrize(
  "lp, needle",
  BAD_COMPENSATIONS.values(),
  ids=BAD_COMPENSATIONS,
)
def test_eco_and_split_combinations_are_refused_naming_the_fix(lp, needle):
  from experiments import study

  with pytest.raises(ValueError) as e:
    study.validate(_config(**lp))
  assert needle in str(e.value)


def test_eco_on_sgd_needs_momentum():
  from experiments import study

  c = _config(compensation="eco")
  c.opt.name = "sgd"
  with pytest.raises(ValueError, match="--config.opt.momentum=0.9"):
    study.validate(c)
  c.opt.momentum = 0.9
  study.validate(c)
  tx = optim.build(c, jax.random.key(0))
  params = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
  jax.eval_shape(tx.init, params)  # the trace is the moment eco folds into


def test_eco_takes_mx_weights_with_recomputed_scales():
  from experiments import study

  study.validate(_config(compensation="eco", writeback="mxfp8_e4m3"))


E4M3_AMAX = "float8_e4m3fn:nearest:block256:amax"
NEW_STATE_SPECS = [
  (f"mu={E4M3_AMAX}", f"nu={E4M3_AMAX}"),
  ("mu=dynamic8:block256", "nu=dynamic8u:block256"),
  ("mu=dynamic8:block2048", "nu=dynamic8u:block256"),
  ("mu=companded8:block32", "nu=sqrt8:block32"),
  ("mu=dynamic4:block128", "nu=uint4nz:block128"),
  ("mu=int4:nearest:block128:amax", "nu=uint4nz:block128"),
  (f"mu={E4M3_AMAX}:float16", "nu=dynamic8u:block256"),
]


@pytest.mark.parametrize(
  "state", NEW_STATE_SPECS, ids=[s[0][3:] for s in NEW_STATE_SPECS]
)
def test_the_8_and_4_bit_state_specs_pass_the_checks_and_the_dry_build(state):
  from configs import smoke
  from experiments import study

  c = smoke.get_config()
  c.study.arm = "rn_bf16"
  c.lowprec.state = state
  (run,) = study.resolve_all(c)
  assert tuple(run.lowprec.state) == state


def test_an_unsigned_map_on_the_first_moment_is_refused_by_the_dry_build():
  from configs import smoke
  from experiments import study

  c = smoke.get_config()
  c.study.arm = "rn_bf16"
  c.lowprec.state = ("mu=sqrt8:block32",)
  with pytest.raises(study.ConfigError, match="lowprec.state.*'companded8"):
    study.resolve_all(c)


# ---- through the entry point ------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(results_dir, *args, xla_flags=""):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=1 {xla_flags}"
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, "-m", "experiments.run", *args]
  cmd.append(f"--config.log.results_dir={results_dir}")
  return subprocess.run(
    cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )


# id -> (overrides, telemetry the last metrics line must hold)
LP = "--config.lowprec."
RECIPES = {
  "eco": ([f"{LP}compensation=eco"], ["carried", "moved", "erased"]),
  "split": (
    [f"{LP}compensation=split", f"{LP}correction_bits=16"],
    ["lost", "lost_mass", "carried"],
  ),
  "dynamic8u-nu": (
    [f"{LP}state=('nu=dynamic8u:block256',)"],
    ["state/changed", "state/erased", "moved"],
  ),
}


@pytest.mark.parametrize("overrides, keys", RECIPES.values(), ids=RECIPES)
def test_a_recipe_trains_through_the_entry_point_and_logs_its_telemetry(
  overrides, keys, tmp_path
):
  # About 20 s each on 2 CPU cores, most of it compiling.
  args = ["--config=configs/smoke.py:arm=rn_bf16", "--config.train.steps=4"]
  out = _run(tmp_path, *args, *overrides)
  assert out.returncode == 0, out.stdout + out.stderr
  d = tmp_path / "smoke" / "rn_bf16" / "seed0"
  summary = json.loads((d / "summary.json").read_text())
  assert np.isfinite(summary["final_loss"])
  lines = (d / "metrics.jsonl").read_text().splitlines()
  last = json.loads(lines[-1])
  assert last["step"] == 4
  for key in keys:
    assert key in last, (key, sorted(last)[:20])
  assert last["proposals"] > 0 and last["erased"] + last["moved"] > 0


def test_an_mx_writeback_takes_its_scale_rule_from_the_config():
  # lowprec.writeback_rule picks the MX rule (noclip against the OCP
  # floor default); on a grid without block scales it is refused with
  # the fix.
  from configs import common

  c = common.get_config()
  c.lowprec.writeback = "mxfp8_e4m3"
  assert lowprec_config.writeback_format(c.lowprec).rule == "ocp"
  c.lowprec.writeback_rule = "noclip"
  assert lowprec_config.writeback_format(c.lowprec).rule == "noclip"
  c.lowprec.writeback = "bfloat16"
  with pytest.raises(ValueError, match="has no block scales"):
    lowprec_config.writeback_format(c.lowprec)


# ---- lowprec.state_kernel: AdamW's moments by lowprec.scale_by_stored_adam --

Q8 = ("mu=dynamic8:stochastic:block64", "nu=dynamic8u:stochastic:block64")


def _kernel_config(arm="sr_bf16", **lp):
  """The smoke study's `arm` with q8-style moments (`lowprec.state`),
  then the `lowprec` keys `lp`."""
  from configs import smoke

  c = smoke.get_config()
  c.study.arm = arm
  c.lowprec.state = Q8
  for k, v in lp.items():
    c.lowprec[k] = v
  return c


def test_state_kernel_builds_adamw_around_the_stored_moments_kernel():
  """`lowprec.state_kernel="pallas"`: the optimizer's update holds one
  kernel for the leaf the kernel takes (a call for CUDA and one
  interpreted, picked by platform; the bias of 96 is no whole number of
  blocks of 64 and takes the XLA path), none with "xla"; the two give
  the same updates bit for bit (2 steps)."""
  from experiments import study

  params = {"w": jnp.ones((4, 128)) * 0.1, "b": jnp.zeros((96,))}
  grads = {"w": jnp.full((4, 128), 0.01), "b": jnp.full((96,), -0.02)}
  out = {}
  for kernel in ("pallas", "xla"):
    (run,) = study.resolve_all(_kernel_config(state_kernel=kernel))
    tx = optim.stored_adamw(
      run, 1e-3, lowprec_config.state_rules(run.lowprec), jax.random.key(1)
    )
    state = tx.init(params)
    jaxpr = str(jax.make_jaxpr(tx.update)(grads, state, params))
    assert jaxpr.count("pallas_call") == (2 if kernel == "pallas" else 0)
    step = jax.jit(tx.update)
    for _ in range(2):
      updates, state = step(grads, state, params)
    out[kernel] = [np.asarray(x).tobytes() for x in jax.tree.leaves(updates)]
  assert out["pallas"] == out["xla"]


@pytest.mark.parametrize(
  "lp, match",
  [
    ({"state": ()}, "lowprec.state is empty"),
    ({"state": ("mu=dynamic8:stochastic:block64",)}, "one 'mu=<spec>'"),
    ({"compensation": "eco"}, "wraps the optimizer"),
    ({"state_kernel": "triton"}, "valid: none, auto, pallas, xla"),
  ],
)
def test_state_kernel_refuses_what_it_cannot_run_naming_the_fix(lp, match):
  from experiments import study

  c = _kernel_config(**{"state_kernel": "auto", **lp})
  with pytest.raises(study.ConfigError, match=match):
    study.resolve_all(c)


def test_state_kernel_refuses_sgd():
  from experiments import study

  c = _kernel_config(state_kernel="auto")
  c.opt.name = "sgd"
  c.opt.momentum = 0.9
  c.lowprec.state = ("mu=dynamic8:stochastic:block64", "nu=dynamic8u:block64")
  with pytest.raises(study.ConfigError, match="opt.name='adamw'"):
    study.resolve_all(c)


def _kernel_runs(tmp_path, key: str, *overrides, xla_flags="") -> dict:
  """The smoke arm `sr_bf16`, 4 steps through `experiments.run` with
  `lowprec.<key>` "pallas" (Pallas's interpreter here) and "xla":
  {kernel: (parameter digest, losses, last metrics line)}, each run's
  config recording its kernel."""
  runs = {}
  for kernel in ("pallas", "xla"):
    out = _run(
      tmp_path / kernel,
      "--config=configs/smoke.py:arm=sr_bf16",
      "--config.train.steps=4",
      *overrides,
      f"{LP}{key}={kernel}",
      xla_flags=xla_flags,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    d = tmp_path / kernel / "smoke" / "sr_bf16" / "seed0"
    summary = json.loads((d / "summary.json").read_text())
    config = json.loads((d / "config.json").read_text())
    assert config["lowprec"][key] == kernel
    lines = [
      json.loads(line)
      for line in (d / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r.get("loss") for r in lines]
    runs[kernel] = (summary["param_digest"], losses, lines[-1])
  return runs


def test_state_kernel_trains_through_the_entry_point_as_the_xla_path(
  tmp_path,
):
  """The smoke arm with q8-style moments, stored by the kernel and by
  the XLA path: the same losses and the same final parameters (their
  digest), and the store's telemetry logged; about 30 s on 2 CPU
  cores."""
  runs = _kernel_runs(tmp_path, "state_kernel", f"{LP}state={Q8!r}")
  for _, losses, last in runs.values():
    # The store's telemetry, as store_state logs it.
    assert last["state/changed"] > 0 and "state/erased" in last
    assert losses[-1] is not None
  assert runs["pallas"][:2] == runs["xla"][:2]


# ---- lowprec.writeback_kernel: the plain write-back by one kernel a leaf --


def test_writeback_kernel_builds_the_write_back_with_its_kernel():
  """`lowprec.writeback_kernel="pallas"`: the run's optimizer holds one
  kernel a leaf on the weights' grid (a call for CUDA and one
  interpreted, picked by platform; the bias of 96 is no whole number of
  128-element rows and takes the XLA path), none with "xla"; the two
  give the same updates and state bit for bit (2 steps)."""
  import lowprec
  from experiments import study

  params = lowprec.to_grid(
    {"w": jnp.linspace(-1, 1, 512).reshape(4, 128), "b": jnp.zeros((96,))},
    "bfloat16",
  )
  grads = {"w": jnp.full((4, 128), 0.01), "b": jnp.full((96,), -0.02)}
  out = {}
  for kernel in ("pallas", "xla"):
    c = _kernel_config(state=(), writeback_kernel=kernel)
    (run,) = study.resolve_all(c)
    tx = optim.build(run, jax.random.key(1), params)
    state = tx.init(params)
    jaxpr = str(jax.make_jaxpr(tx.update)(grads, state, params))
    assert jaxpr.count("pallas_call") == (2 if kernel == "pallas" else 0)
    step = jax.jit(tx.update)
    for _ in range(2):
      updates, state = step(grads, state, params)
    out[kernel] = [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]
    out[kernel] += [np.asarray(x).tobytes() for x in jax.tree.leaves(updates)]
  assert out["pallas"] == out["xla"]


@pytest.mark.parametrize(
  "lp, match",
  [
    ({"compensation": "kahan"}, "compensation=none"),
    ({"arm": "fp32_reference"}, "lowprec.writeback is empty"),
    ({"writeback_kernel": "triton"}, "valid: auto, pallas, xla"),
  ],
)
def test_writeback_kernel_refuses_what_it_cannot_run_naming_the_fix(lp, match):
  from experiments import study

  c = _kernel_config(**{"state": (), "writeback_kernel": "auto", **lp})
  with pytest.raises(study.ConfigError, match=match):
    study.resolve_all(c)


def test_writeback_kernel_trains_through_the_entry_point_as_the_xla_path(
  tmp_path,
):
  """The smoke arm (bfloat16 weights, stochastic write-back) with its
  write-back by the kernel and by the XLA path: the same losses, the
  same final parameters (their digest) and the same telemetry."""
  runs = _kernel_runs(tmp_path, "writeback_kernel")
  assert runs["xla"][2]["moved"] > 0 and "erased" in runs["xla"][2]
  assert runs["pallas"] == runs["xla"]


def test_both_kernels_step_as_one_kernel_a_leaf():
  """`lowprec.state_kernel` and `lowprec.writeback_kernel` both "pallas":
  AdamW, its stored moments and the write-back are one transform
  (`lowprec.stored_adamw_writeback`), one kernel for the leaf it takes;
  with the write-back on "xla", the chain of two."""
  import lowprec
  from experiments import study

  params = lowprec.to_grid(
    {"w": jnp.linspace(-1, 1, 512).reshape(4, 128), "b": jnp.zeros((96,))},
    "bfloat16",
  )
  grads = {"w": jnp.full((4, 128), 0.01), "b": jnp.full((96,), -0.02)}
  for wb, fused in (("pallas", 2), ("xla", 0)):
    c = _kernel_config(state_kernel="pallas", writeback_kernel=wb)
    (run,) = study.resolve_all(c)
    names = [k for k, _ in optim.parts(run, jax.random.key(1), params)]
    assert names.count("lowprec.writeback") == (0 if fused else 1)
    tx = optim.build(run, jax.random.key(1), params)
    jaxpr = str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
    assert jaxpr.count("name=stored_adamw_writeback\n") == fused


@pytest.mark.skipif(
  platform.machine().lower() not in ("x86_64", "amd64"),
  reason="--xla_cpu_max_isa=AVX names an x86 instruction set",
)
def test_one_kernel_trains_through_the_entry_point_as_the_chain(tmp_path):
  """The smoke arm with q8 moments and bf16 SR weights, both kernels on
  (one kernel a leaf, interpreted) against the moments' kernel with the
  write-back on XLA's ops: the same losses, final parameters (their
  digest) and telemetry, in processes without FMA instructions (where
  XLA:CPU contracts the decay's product and sum depends on the
  program: docs/state.md)."""
  runs = _kernel_runs(
    tmp_path,
    "writeback_kernel",
    f"{LP}state={Q8!r}",
    f"{LP}state_kernel=pallas",
    xla_flags="--xla_cpu_max_isa=AVX",
  )
  last = runs["xla"][2]
  assert last["moved"] > 0 and last["state/changed"] > 0
  assert runs["pallas"] == runs["xla"]

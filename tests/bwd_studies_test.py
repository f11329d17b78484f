"""Backward-state studies: probe, operator checks, tables, smoke runs.

The gradient probe is checked on losses whose gradients are known; the
single-operator table is checked to agree with the requirements on every
canonical operator (CPU-scale config: 4096 forward draws, seed 0, |z| >= 4
is biased; the biased cells must reach |z| >= 8); the table code on
hand-made result files with known answers; each study's smoke variant runs
through the runner and makes its table and figure (the training studies'
take 20-45 s each on 8 fake CPU devices, so they are marked slow, as is the
kill-and-resume check of a run with probes).
"""

import importlib
import json
import math
import os
import pkgutil
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from configs import common, presets
from experiments import (
  models,
  operator_checks,
  probes,
  results,
  study,
  tasks,
  train,
)
from experiments.analysis import bwd_tables, figures, tables

STUDIES = ["bwd_operator_checks", "attention_reuse", "norm_store"]
CONFIGS = sorted(
  m.name
  for m in pkgutil.iter_modules(configs.__path__)
  if m.name not in ("common", "presets") and not m.ispkg
)


def _shape(name):
  """(layers, heads, width, vocabulary, length) of a model preset."""
  keys = ("n_layer", "n_head", "d_model", "vocab_size", "seq_len")
  return tuple(presets.PRESETS[name][k] for k in keys)


def _load(name, arg=None):
  return importlib.import_module(f"configs.{name}").get_config(arg)


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("name", STUDIES)
def test_configs_default_to_cpu_scale_and_name_their_analysis(name):
  c = _load(name)
  assert c.study.scale == "cpu"
  assert c.study.analysis in bwd_tables.ANALYSES
  assert c.study.figure in figures.FIGURES


def test_attention_full_scale_is_the_390m_preset():
  c = _load("attention_reuse", "scale=full")
  n_layer, n_head, d, vocab, seq = _shape("gpt_390m")
  m = c.model
  assert (m.n_layer, m.n_head, m.d_model, m.vocab_size, m.seq_len) == (
    n_layer,
    n_head,
    d,
    vocab,
    seq,
  )
  assert c.data.name == "tokens"
  assert c.study.seeds == (0, 1, 2)


@pytest.mark.parametrize(
  "name",
  [pytest.param("attention_reuse", marks=pytest.mark.slow), "norm_store"],
)
def test_full_scale_probe_groups_name_parameters_of_the_model(name):
  c = _load(name, "scale=full")
  c = study.resolve(c, next(iter(c.study.arms)), 0)
  model = models.GPT(tasks._gpt_cfg(c.model), models.numerics_from(c.lowprec))
  shapes = jax.eval_shape(
    model.init,
    jax.random.key(0),
    jax.ShapeDtypeStruct((1, c.model.seq_len), jnp.int32),
  )["params"]
  groups = probes.parse_groups(c.train.probe_groups)
  members = probes._members(shapes, groups)
  assert all(members.values()), members
  assert c.train.probe_batch_size and c.train.probe_every_steps


def test_arm_policies_differ_from_the_reference_where_stated():
  c = _load("attention_reuse")
  want = {
    "reuse": ("rounded", "redraw"),
    "redraw": ("fresh", "redraw"),
    "outonly": ("fresh", "output"),
  }
  for arm, (value, fresh_out) in want.items():
    num = models.numerics_from(study.resolve(c, arm, 0).lowprec)
    got = num.policy.resolve("attention")
    assert got["attn.out@delta"] == value
    assert num.attn_fresh_out == fresh_out
    assert got["attn.probs@dscores"] == "original"
    assert num.policy.resolve("norm_dense")["norm.out@dw"] == "rounded"
  c = _load("norm_store")
  want = {
    "per_use": ("original", "rounded"),
    "original_both": ("original", "original"),
    "rounded_both": ("rounded", "rounded"),
  }
  for arm, (gain, w) in want.items():
    num = models.numerics_from(study.resolve(c, arm, 0).lowprec)
    got = num.policy.resolve("norm_dense")
    assert (got["norm.out@dgain"], got["norm.out@dw"]) == (gain, w)


def test_unknown_study_kind_is_rejected():
  c = _load("smoke")
  c.study.kind = "operator_check"
  with pytest.raises(ValueError, match="operator_checks"):
    study.run_study(c)


# ------------------------------------------------------------------ probe


def _probe(run_grad_extra, draws=4):
  """A probe of loss <w, a> (reference) vs <w, a + extra(key)> (run)."""
  a = jnp.arange(1.0, 7.0)
  params = {"x": {"kernel": jnp.zeros(4)}, "y": {"bias": jnp.zeros(2)}}

  def flat(p):
    return jnp.concatenate([p["x"]["kernel"], p["y"]["bias"]])

  def ref_loss(p, batch, key):
    return jnp.vdot(flat(p), a)

  def run_loss(p, batch, key):
    return jnp.vdot(flat(p), a + run_grad_extra(key))

  groups = {"all": ".*", "kernel": "x/kernel"}
  fn = probes.gradient_probe(run_loss, ref_loss, None, groups, draws)
  return jax.jit(fn)(params, jax.random.key(0)), a


def test_probe_of_an_exact_gradient():
  out, _ = _probe(lambda k: jnp.zeros(6))
  assert float(out["probe/all/cos"]) == pytest.approx(1.0)
  assert float(out["probe/all/norm_ratio"]) == pytest.approx(1.0)
  for stat in ("rel_err", "bias2", "bias", "noise"):
    assert float(out[f"probe/all/{stat}"]) == 0.0


def test_probe_of_a_deterministic_bias():
  b = jnp.array([0.5, 0.0, 0.0, 0.0, 0.0, -1.0])
  out, a = _probe(lambda k: b)
  rel = float(jnp.linalg.norm(b) / jnp.linalg.norm(a))
  assert float(out["probe/all/rel_err"]) == pytest.approx(rel, rel=1e-5)
  assert float(out["probe/all/bias"]) == pytest.approx(rel, rel=1e-4)
  assert float(out["probe/all/noise"]) == pytest.approx(0.0, abs=1e-6)
  cos = float(jnp.vdot(a + b, a) / jnp.linalg.norm(a + b) / jnp.linalg.norm(a))
  assert float(out["probe/all/cos"]) == pytest.approx(cos, rel=1e-6)
  # The kernel group holds the first four coordinates only.
  rel_k = 0.5 / float(jnp.linalg.norm(a[:4]))
  assert float(out["probe/kernel/rel_err"]) == pytest.approx(rel_k, rel=1e-5)


def test_probe_bias2_is_unbiased_for_pure_noise():
  # Zero-mean noise: bias2 averages to zero (sd of the mean over 200 probes
  # is about 0.007 here; tolerance 0.03), while rel_err stays positive.
  def noise(k):
    return jax.random.normal(k, (6,))

  a = jnp.arange(1.0, 7.0)
  params = {"w": jnp.zeros(6)}
  fn = jax.jit(
    probes.gradient_probe(
      lambda p, b, k: jnp.vdot(p["w"], a + noise(k)),
      lambda p, b, k: jnp.vdot(p["w"], a),
      None,
      {"w": "w"},
      8,
    )
  )
  outs = [fn(params, jax.random.key(i)) for i in range(200)]
  b2 = np.array([float(o["probe/w/bias2"]) for o in outs])
  assert abs(b2.mean()) < 0.03
  # E|mean d|^2 = 6 / 8 per probe, relative to |a|^2 = 91.
  err2 = np.mean([float(o["probe/w/rel_err"]) ** 2 for o in outs])
  assert err2 == pytest.approx(6 / 8 / 91, rel=0.15)


def test_probe_groups_parse_and_errors():
  assert probes.parse_groups("a=x.*, b = y") == {"a": "x.*", "b": "y"}
  with pytest.raises(ValueError, match="name=regex"):
    probes.parse_groups("nothing")
  fn = probes.gradient_probe(
    lambda p, b, k: p["w"].sum(),
    lambda p, b, k: p["w"].sum(),
    None,
    {"g": "nope"},
    2,
  )
  with pytest.raises(ValueError, match="matches no parameter; paths: w"):
    fn({"w": jnp.zeros(2)}, jax.random.key(0))
  with pytest.raises(ValueError, match="at least 2"):
    probes.gradient_probe(None, None, None, {"g": "w"}, 1)


# ---------------------------------------------------- single-operator table


@pytest.mark.parametrize("op", list(operator_checks.OPERATORS))
def test_operator_table_prediction_equals_verification(op):
  # CPU-scale config (4096 forward draws x 1 backward draw), seed 0, the
  # all-rounded (reuse) policy; every value of every use is checked too.
  c = study.resolve(_load("bwd_operator_checks"), "rounded", 0)
  rows, values, report = operator_checks.check(op, c, 0)
  assert all(r["agrees"] for r in rows), report
  assert all(v["agrees"] for v in values), report
  assert rows[-1]["reference_error"] < 1e-4, report
  for v in values:
    if v["predicted"] == "biased":
      assert abs(float(v["z"])) >= 8, report
    else:
      assert abs(float(v["z"])) < 4, report
  assert {r["n_forward"] for r in rows} == {4096}


def test_operator_inputs_and_ops_follow_the_config():
  c = _load("bwd_operator_checks")
  num = models.numerics_from(c.lowprec)
  op = operator_checks.build_op("norm_dense:rms", num)
  assert op.norm == "rms" and op.out.mode == "stochastic"
  x, gain, shift, kernel, bias = operator_checks.make_inputs(
    "norm_dense:rms", c.checks, 0
  )
  assert shift is None and bias is None and kernel.shape == (16, 8)
  q, _, _ = operator_checks.make_inputs("attention", c.checks, 0)
  assert q.shape == (1, 8, 2, 8)
  with pytest.raises(ValueError, match="valid: dense"):
    operator_checks.build_op("conv", num)


# -------------------------------------------------------- hand-made results


def _write_run(root, name, arm, seed, config, metrics=None, summary=None):
  d = os.path.join(root, name, arm, f"seed{seed}")
  os.makedirs(d)
  results.write_json(os.path.join(d, "config.json"), config)
  if metrics is not None:
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
      for rec in metrics:
        f.write(json.dumps(rec) + "\n")
  if summary is not None:
    results.write_json(os.path.join(d, "summary.json"), summary)


def _use_row(op, use, reads, predicted, verified, z, reuse=None, **kw):
  return dict(
    op=op,
    use=use,
    reads=reads,
    must_read="original",
    predicted=predicted,
    verified=verified,
    gradient="q",
    rel_bias=0.01,
    se=0.001,
    z=z,
    exact=False,
    n_forward=64,
    n_backward=1,
    n_test=32,
    reuse_predicted=reuse,
    reuse_verified=reuse,
    reuse_z=None if reuse is None else 9.0,
    reuse_exact=None if reuse is None else False,
    agrees=(predicted == "biased") == (verified == "biased"),
    **kw,
  )


def test_operator_table_counts_agreement(tmp_path):
  root = str(tmp_path)
  cfg = {"study": {}, "checks": {"z_threshold": 4.0}}
  value = dict(op="attention", use="attn.out@delta", n_forward=64)
  for arm, reads, verified, z in (
    ("rounded", "rounded", "biased", 30.0),
    ("per_use", "original", "biased", 5.0),  # a wrong verdict
  ):
    rows = [
      _use_row("attention", "attn.out@delta", reads, "biased"
               if reads == "rounded" else "unbiased", verified, z, True),
      _use_row("attention", "(all uses)", "policy", "biased"
               if reads == "rounded" else "unbiased", verified, z),
    ]  # fmt: skip
    values = [
      dict(value, value="rounded", predicted="biased", verified="biased",
           z=30.0, exact=False, agrees=True),
      dict(value, value="original", predicted="unbiased",
           verified="unbiased", z=1.0, exact=False, agrees=True),
    ]  # fmt: skip
    summary = {"kind": "operator_checks", "rows": rows, "values": values}
    _write_run(root, "ops", arm, 0, cfg, summary=summary)
  runs = tables.load_runs(root, "ops")
  rows, lines = bwd_tables.operator_table(runs)
  assert [r["use"] for r in rows] == ["attn.out@delta", "(all uses)"]
  assert rows[0]["rounded"] == "rounded: biased -> biased (z=+30.0)"
  assert rows[0]["per_use"] == "original: unbiased -> biased (z=+5.0)"
  assert rows[0]["agrees"] is False
  assert rows[0]["reuse differs: predicted / verified"] == "yes / yes (z=+9.0)"
  # Per use: 1 of 2 agrees; whole policy 1 of 2; the value cells are the
  # same in both runs (same seed) and count once; reuse once per use.
  assert lines[0] == (
    "- prediction = verification, per use and policy: 1/2; whole policy: "
    "1/2; every value of every use: 2/2; reuse vs an independent copy: 1/1"
  )
  assert "smallest |z| 30.0 (1 cells)" in lines[2]


def _probe_run(root, arm, seed, val, b2, rel, margin=None, group="g"):
  cfg = {
    "study": {} if margin is None else {"loss_margin": margin},
    "train": {"probe_groups": f"{group}=.*"},
  }
  recs = [{"step": 0, "val_loss": 3.0}]
  for i, (b, e) in enumerate(zip(b2, rel, strict=True)):
    recs.append(
      {
        "step": i + 1,
        "loss": 2.0 + 0.1 * i,
        f"probe/{group}/bias2": b,
        f"probe/{group}/rel_err": e,
        f"probe/{group}/cos": 1 - e,
        f"probe/{group}/norm_ratio": 1.0,
      }
    )
  recs[-1]["val_loss"] = val
  _write_run(root, "p", arm, seed, cfg, metrics=recs)


def test_probe_table_losses_margin_and_bias_test(tmp_path):
  root = str(tmp_path)
  for seed, (v_base, v_arm) in enumerate(((2.0, 2.01), (2.1, 2.15))):
    _probe_run(root, "base", seed, v_base, [0.0] * 4, [0.0] * 4, margin=0.02)
    _probe_run(
      root, "arm", seed, v_arm, [1e-4, 3e-4, 1e-4, 3e-4], [0.01] * 4, 0.02
    )
  rows, lines = bwd_tables.probe_table(tables.load_runs(root, "p"), "base")
  arm0 = next(r for r in rows if r["arm"] == "arm" and r["seed"] == 0)
  assert arm0["val_minus_base"] == pytest.approx(0.01)
  assert arm0["within_margin"] is True
  arm1 = next(r for r in rows if r["arm"] == "arm" and r["seed"] == 1)
  assert arm1["within_margin"] is False
  # bias2 = 1e-4, 3e-4, 1e-4, 3e-4: mean 2e-4, sd 1.155e-4, se 5.77e-5.
  assert arm0["g_bias_rms"] == pytest.approx(math.sqrt(2e-4))
  assert arm0["g_bias_z"] == pytest.approx(2e-4 / (1.1547e-4 / 2), rel=1e-3)
  assert arm0["g_rel_err"] == pytest.approx(0.01)
  assert arm0["g_last_rel_err"] == pytest.approx(0.01)
  assert arm0["train_loss_last10%"] == pytest.approx(2.3)
  base0 = next(r for r in rows if r["arm"] == "base" and r["seed"] == 0)
  assert base0["g_bias_z"] == 0.0 and "within_margin" not in base0
  arm_line = next(x for x in lines if x.startswith("- arm"))
  assert "within the margin 0.02: 1/2" in arm_line
  assert "minus base +0.0300 (per seed +0.0100, +0.0500)" in arm_line
  # Pooled over both seeds: 8 probes, same mean, se halves with sqrt(8/4).
  assert "8 probes" in arm_line


def test_fp4_bias_gets_seed_intervals_and_paired_differences(tmp_path):
  # Three seeds of bf16, nvfp4 and nvfp4_1d, each probe's bias2 set so a
  # run's bias (rms) is sqrt(mean bias2): nvfp4 0.04, 0.05, 0.06;
  # nvfp4_1d 0.07, 0.07, 0.08. The interval is over seeds (t(2) = 4.303),
  # and nvfp4_1d minus nvfp4 pairs each seed: 0.03, 0.02, 0.02.
  root = str(tmp_path)
  biases = {
    "bf16": (0.001, 0.001, 0.001),
    "nvfp4": (0.04, 0.05, 0.06),
    "nvfp4_1d": (0.07, 0.07, 0.08),
  }
  for arm, per_seed in biases.items():
    for seed, b in enumerate(per_seed):
      _probe_run(root, arm, seed, 2.0, [b * b] * 3, [0.1] * 3)
  runs = tables.load_runs(root, "p")
  rows, _ = bwd_tables.probe_table(runs, "bf16")
  text = "\n".join(bwd_tables._bias_intervals(runs, rows))
  hw = 4.303 * 0.01 / math.sqrt(3)
  assert (
    f"- nvfp4: g bias (rms, relative) 0.0500 [{0.05 - hw:.4f}, "
    f"{0.05 + hw:.4f}] over 3 seeds" in text
  )
  d = np.array([0.03, 0.02, 0.02])
  dhw = 4.303 * d.std(ddof=1) / math.sqrt(3)
  assert (
    f"- g bias, nvfp4_1d minus nvfp4: {d.mean():+.4f} "
    f"[{d.mean() - dhw:+.4f}, {d.mean() + dhw:+.4f}] over 3 seed pairs: "
    "higher" in text
  )
  assert "mxfp8_floor minus" not in text  # an arm that did not run


# ---------------------------------------------------- smoke, end to end


@pytest.mark.slow
def test_probe_metrics_and_params_survive_a_resume(tmp_path):
  # The smoke variant of one arm, then the same run "killed" after step 2
  # (its last checkpoint and summary removed) and resumed: same bits, same
  # probes; then its table and figure.
  c = _load("attention_reuse", "scale=smoke,arm=reuse,seed=0")
  c.ckpt.every_steps = 2
  c.log.results_dir = str(tmp_path)
  c = study.resolve(c, "reuse", 0)
  full = train.train_and_evaluate(c)
  d = results.run_dir(c)
  before = results.read_metrics(os.path.join(d, "metrics.jsonl"))
  os.remove(os.path.join(d, "summary.json"))
  shutil.rmtree(os.path.join(d, "checkpoints", "4"))
  resumed = train.train_and_evaluate(c)
  assert resumed["resumed_from"] == 2
  assert resumed["param_digest"] == full["param_digest"]
  after = results.read_metrics(os.path.join(d, "metrics.jsonl"))
  assert after == before
  assert [r["step"] for r in after if "probe/qkv/bias2" in r] == [0, 2, 4]
  # The table and the figure read these files.
  md = tables.make("attention_reuse", str(tmp_path))
  assert "- reuse (1 seeds): final val loss" in md
  assert os.path.getsize(figures.plot("attention_reuse", str(tmp_path))) > 1000


def test_every_common_field_the_studies_use_exists():
  base = common.get_config()
  for name in CONFIGS:
    c = _load(name)
    assert c.study.kind in study.RUNNERS
    assert set(c.train.keys()) == set(base.train.keys())

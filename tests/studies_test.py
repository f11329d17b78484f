"""Study configs, their smoke variants end to end, and the study tables.

The table code is checked on hand-made result files whose answers are
known; every shipped config is loaded at every scale and resolved for every
arm and seed; the smoke variant of each study runs through the runner and
produces its table and figure.
"""

import csv
import importlib
import json
import math
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import lowprec
from configs import common, presets
from experiments import (
  checkpoint,
  lowprec_config,
  models,
  optim,
  results,
  study,
  tasks,
  train,
)
from experiments.analysis import bwd_tables, figures, plotting, studies, tables
from lowprec.freeze import leaf_paths
from tests.train_test import _run as train_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = sorted(
  f[:-3]
  for f in os.listdir(os.path.join(ROOT, "configs"))
  if f.endswith(".py") and f not in ("__init__.py", "common.py", "presets.py")
)


def _shape(name):
  """(layers, heads, width, vocabulary, length) of a model preset."""
  keys = ("n_layer", "n_head", "d_model", "vocab_size", "seq_len")
  return tuple(presets.PRESETS[name][k] for k in keys)


def _load(name, arg=None):
  return importlib.import_module(f"configs.{name}").get_config(arg)


# ----------------------------------------------------------------- configs


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("scale", common.SCALES)
def test_every_config_loads_and_resolves_every_arm(name, scale):
  c = _load(name, f"scale={scale}")
  assert c.study.scale == scale
  doc = importlib.import_module(f"configs.{name}").__doc__
  assert f"configs/{name}.py" in doc, "the docstring gives the command"
  for arm in study.arms_of(c):
    for seed in study.seeds_of(c, arm):
      r = study.resolve(c, arm, seed)
      ref = r.study.reference_arm
      assert not ref or ref in c.study.arms, (arm, ref)
      src = r.train.init_from_arm
      assert not src or src in c.study.arms, (arm, src)


@pytest.mark.parametrize("name", CONFIGS)
def test_each_study_is_declared_in_its_config(name):
  # The config names its analysis and figure (runs carry them in their
  # config.json); the registries know them; studies default to CPU scale.
  c = _load(name)
  assert c.study.name == name
  assert c.study.scale == "cpu"
  assert c.study.analysis in tables.ANALYSES, c.study.analysis
  assert c.study.figure in figures.FIGURES, c.study.figure
  arm = c.study.plan_arm
  assert not arm or arm in _load(name, "scale=full").study.arms


def test_fp8_full_scale_is_gpt2_small():
  c = _load("freeze_gpt2_fp8", "scale=full")
  n_layer, n_head, d, vocab, seq = _shape("gpt2_124m")
  m = c.model
  assert (m.n_layer, m.n_head, m.d_model, m.vocab_size, m.seq_len) == (
    n_layer,
    n_head,
    d,
    vocab,
    seq,
  )
  shapes = jax.eval_shape(
    models.GPT(tasks._gpt_cfg(m)).init,
    jax.random.key(0),
    jax.ShapeDtypeStruct((1, seq), jnp.int32),
  )
  assert sum(x.size for x in jax.tree.leaves(shapes)) == 124_439_808
  assert c.data.name == "tokens"
  assert (c.opt.lr, c.opt.b1, c.opt.b2, c.opt.weight_decay) == (
    6e-4,
    0.9,
    0.95,
    0.1,
  )


@pytest.mark.parametrize(
  "name, arm",
  [
    ("freeze_gpt2_fp8", "rn_e4m3"),
    ("freeze_mx", "rn_mxfp8_e4m3"),
    ("e4m3_audit", "rn_e4m3"),
    ("e4m3_audit", "rn_e4m3_b64"),
    ("int3_replay", "int3m_from_2"),
  ],
)
def test_studies_keep_only_norms_and_biases_in_float32(name, arm):
  c = _load(name, "scale=smoke")
  r = study.resolve(c, arm, study.seeds_of(c, arm)[0])
  paths = leaf_paths(jax.eval_shape(tasks.build(r).init, jax.random.key(0)))
  kept = [p for p in paths if re.fullmatch(r.lowprec.keep_float32, p)]
  assert kept and all(p.endswith(("bias", "scale")) for p in kept)
  dense = [p for p in paths if p.endswith(("kernel", "embedding"))]
  assert dense and not set(dense) & set(kept)


def test_grid_has_72_cells_and_a_reference_for_each():
  c = _load("freeze_grid")
  cells = [a for a, o in c.study.arms.items() if "writeback" in o.lowprec]
  assert len(cells) == 72
  assert len({c.study.arms[a].study.cell for a in cells}) == 72


def test_int_scales_are_powers_of_two_covering_the_tensor_or_model():
  lp = ml_collections.ConfigDict(
    {"writeback": "int3", "keep_float32": "", "int_scale_scope": "tensor"}
  )
  params = {
    "a": {"kernel": jnp.array([0.3, -0.1]), "bias": jnp.array([0.01])},
    "b": jnp.array([[-2.0, 1.0]]),
  }
  fmts = lowprec_config.int_formats(lp, params)
  assert fmts["a"]["kernel"].scale == 0.125  # 0.3 / 3 = 0.1 -> 0.125
  assert fmts["a"]["bias"].scale == 2.0**-8  # 0.01 / 3 -> 2^-8
  assert fmts["b"].scale == 1.0  # 2 / 3 -> 1
  # One step for the model: the largest |w| (2.0) sets it everywhere.
  lp.int_scale_scope = "model"
  fmts = lowprec_config.int_formats(lp, params)
  assert [f.scale for f in jax.tree.leaves(fmts)] == [1.0, 1.0, 1.0]
  grid = lowprec.to_grid(params, fmts)
  np.testing.assert_array_equal(grid["a"]["kernel"], [0.0, 0.0])  # zeroed
  np.testing.assert_array_equal(grid["b"], [[-2.0, 1.0]])
  lp.keep_float32 = r"b"  # left out of the grid and of the model's max
  fmts = lowprec_config.int_formats(lp, params)
  assert fmts["b"] is None and fmts["a"]["bias"].scale == 0.125
  lp.keep_float32 = r".*bias"
  lp.int_scale_scope = "tensor"
  assert lowprec_config.int_formats(lp, params)["a"]["bias"] is None
  with pytest.raises(ValueError, match="keep_float32"):
    lowprec_config.int_formats(lp, {"z": jnp.zeros(3)})
  lp.int_scale_scope = "model"
  with pytest.raises(ValueError, match="the model has max"):
    lowprec_config.int_formats(lp, {"z": jnp.zeros(3), "y": jnp.zeros(2)})
  assert lowprec_config.int_formats(lp, {"z": jnp.zeros(3), "y": jnp.ones(2)})


def test_unknown_int_scale_scope_is_refused_with_a_suggestion():
  c = _load("int3_replay", "scale=smoke")
  arm = next(a for a in c.study.arms if a != "fp32_reference")
  c.study.arms[arm].lowprec.int_scale_scope = "modle"
  with pytest.raises(ValueError, match="Did you mean 'model'"):
    study.resolve(c, arm, 0)


@pytest.mark.parametrize(
  "key, value, match",
  [
    (
      "writeback",
      "nvfp4",
      "lowprec.writeback: write-back onto nvfp4 is not supported.*"
      "Use 'mxfp4_e2m1'",
    ),
    (
      "trace_targets",
      ("float8_e4m3fn:tensor",),
      "lowprec.trace_targets: write-back onto float8_e4m3fn:tensor is not "
      "supported.*Use the element format itself",
    ),
    ("writeback", "mxfp8_e4m", "Did you mean 'mxfp8_e4m3'"),
  ],
  ids=["nvfp4", "tensor", "typo"],
)
def test_scaled_formats_other_than_mx_are_refused_with_the_fix(
  key, value, match
):
  c = _load("freeze_mx", "scale=smoke")
  c.study.arms["rn_mxfp8_e4m3"].lowprec[key] = value
  with pytest.raises(ValueError, match=match):
    study.resolve(c, "rn_mxfp8_e4m3", 0)


@pytest.mark.parametrize("scales, want", [("recompute", 4.5), ("keep", 3.5)])
def test_writeback_scales_reach_the_write_back(scales, want):
  # A block at the top of its grid (3.5 = 448 * 2^-7), one Adam step of
  # lr 1 up: recomputed scales take it to 4.5, kept ones saturate it.
  c = _load("freeze_mx", "scale=smoke")
  c.opt.update(dict(lr=1.0, warmup_steps=0, schedule="constant"))
  c.opt.update(dict(weight_decay=0.0, clip_norm=0.0))
  c.study.arms["rn_mxfp8_e4m3"].lowprec.writeback_scales = scales
  c.study.arms["rn_mxfp8_e4m3"].lowprec.trace_sample = 8
  r = study.resolve(c, "rn_mxfp8_e4m3", 0)
  opt = optim.build(r, jax.random.key(0))
  w = {"params": {"w": jnp.full((1, 32), 0.5).at[0, 0].set(3.5)}}
  g = {"params": {"w": -jnp.ones((1, 32))}}
  updates, state = opt.update(g, opt.init(w), w)
  new = jax.tree.map(lambda a, b: a + b, w, updates)["params"]["w"]
  assert float(new[0, 0]) == want
  assert lowprec.telemetry(state)["saturated"] == (scales == "keep")


def test_init_from_arm_needs_a_step():
  c = _load("int3_replay", "scale=smoke")
  c.train.init_from_arm = "int3_from_2"
  with pytest.raises(ValueError, match="go together"):
    study.resolve(c, "fp32_reference", 0)
  c.study.arms["int3_from_2"].train.init_from_arm = "int3_from_2"
  with pytest.raises(ValueError, match="its own checkpoint"):
    study.resolve(c, "int3_from_2", 0)


# ----------------------------------------------------- hand-made results


def _run_dir(root, study_name, arm, seed, config, metrics, summary=None):
  d = os.path.join(root, study_name, arm, f"seed{seed}")
  os.makedirs(d)
  base = {
    "study": {"reference_arm": "", "cell": ""},
    "lowprec": {"writeback": "", "rounding": "nearest"},
    "train": {"steps": len(metrics), "init_from_arm": "", "init_from_step": 0},
    "model": {"hidden": [8]},
    "opt": {"lr": 0.1, "schedule": "cosine"},
  }
  for k, v in config.items():
    base[k] = {**base.get(k, {}), **v}
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(base, f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for rec in metrics:
      f.write(json.dumps(rec) + "\n")
  if summary is not None:
    with open(os.path.join(d, "summary.json"), "w") as f:
      json.dump(summary, f)


def _reference(
  root, name, fmt, pred, seed=0, arm="ref", extra=None, batch=None
):
  recs = [{"step": 0, "val_loss": 3.0}]
  for i, p in enumerate(pred):
    rec = {"step": i + 1, f"pred/{fmt}/erased_fraction": p}
    recs.append({**rec, **(extra or {}).get(i + 1, {})})
  config = {"lowprec": {"trace_targets": [fmt]}}
  if batch is not None:
    config["data"] = {"batch_size": batch}
  _run_dir(root, name, arm, seed, config, recs)


def _lowprec(root, name, arm, fmt, erased, seed=0, props=None, cell="", **cfg):
  recs = [{"step": 0, "val_loss": 3.0}]
  for i, e in enumerate(erased):
    n = 100 if props is None else props[i]
    recs.append(
      {
        "step": i + 1,
        "erased_fraction": e,
        "proposals": n,
        "moved": round(n * (1 - e)),
      }
    )
  config = {
    "lowprec": {"writeback": fmt, "rounding": "nearest"},
    "study": {"reference_arm": "ref", "cell": cell or arm},
  }
  for k, v in cfg.items():
    config[k] = {**config.get(k, {}), **v}
  _run_dir(root, name, arm, seed, config, recs)


def _curve(n, cross):
  """0.1 before step `cross` (1-based), 0.9 from it on."""
  return [0.9 if s >= cross else 0.1 for s in range(1, n + 1)]


def test_step_without_proposals_does_not_count_as_unfrozen(tmp_path):
  # Warmup from lr 0: no proposals at step 1. The write-back reports 0.0,
  # the trace NaN; both are "no value", so both cross at init.
  root = str(tmp_path)
  _reference(root, "s", "e8m3", [float("nan"), 0.8, 0.9, 0.9])
  _lowprec(root, "s", "rn", "e8m3", [0.0, 0.8, 0.9, 0.95], props=[0, 9, 9, 9])
  rows, _ = tables.freeze_table(tables.load_runs(root, "s"))
  assert rows[0]["predicted_crossing"] == "2 (at_init)"
  assert rows[0]["measured_crossing"] == "2 (at_init)"
  assert rows[0]["category_agrees"] is True


def test_grid_table_counts_crossings_span_and_categories(tmp_path):
  root = str(tmp_path)
  n = 40
  # (predicted crossing, measured crossing): within 15%, outside, a
  # category disagreement (at_init predicted, post-init measured), and two
  # measured at step 2 (the first post-init step), one predicted there.
  cells = {"a": (10, 11), "b": (20, 30), "c": (1, 4), "d": (2, 2), "e": (3, 2)}
  for i, (name, (p, m)) in enumerate(cells.items()):
    arm = f"ref_{name}"
    _reference(root, "g", "e8m3", _curve(n, p), arm=arm)
    _lowprec(
      root,
      "g",
      name,
      "e8m3",
      _curve(n, m),
      cell=name,
      study={"reference_arm": arm, "cell": name},
      model={"hidden": [8 * (i + 1)]},
    )
  rows, lines = tables.ANALYSES["grid"](tables.load_runs(root, "g"))
  text = "\n".join(lines)
  assert [r["width"] for r in rows] == [8, 16, 24, 32, 40]
  assert "post-init crossings: 4/5" in text
  assert "steps span 15x (step 2 to 30)" in text
  assert "measured crossing at step 2: 2/4 (predicted at step 2: 1/4)" in text
  assert "crossings after step 2: 2/4, spanning 3x (step 11 to 30)" in text
  assert "within 15%: 2/4" in text
  assert "categories differ: 1/5" in text
  by = {r["cell"]: r for r in rows}
  assert by["a"]["error_steps"] == -1 and by["a"]["within_tol"]
  assert by["b"]["error_steps"] == -10 and not by["b"]["within_tol"]
  assert by["c"]["predicted_crossing"] == "1 (at_init)"


def test_transfer_table_summarizes_each_task(tmp_path):
  root = str(tmp_path)
  for task, m in (("reg", 10), ("mlp", 20)):
    _reference(root, "t", "e8m3", _curve(30, 10), arm=f"{task}_fp32")
    _lowprec(
      root,
      "t",
      f"{task}_e8m3",
      "e8m3",
      _curve(30, m),
      study={"reference_arm": f"{task}_fp32", "cell": f"{task}/e8m3"},
    )
  _, lines = tables.ANALYSES["transfer"](tables.load_runs(root, "t"))
  text = "\n".join(lines)
  assert "- reg: categories agree in 1/1 cells" in text
  assert (
    "reg: categories agree in 1/1 cells, post-init crossings within " in text
  )
  assert "within 15%: 1/1, macro RMSE 0.00000" in text
  assert (
    "- mlp: categories agree in 1/1 cells, post-init crossings within "
    "15%: 0/1" in text
  )


def test_state_table_against_float32_state_and_erased_share(tmp_path):
  """Measured and predicted erased shares per moment, summed over state
  paths per step, averaged over the second half (steps 3 and 4 of 4)."""
  root = str(tmp_path)
  paths = ("0/mu/a", "0/mu/b", "0/nu/a")
  for seed, (l32, lrn) in {0: (2.0, 2.5), 1: (2.2, 2.3)}.items():
    ref = [{"step": 0, "val_loss": 5.0}]
    for t in range(1, 5):
      # Predicted: mu 1/4 erased at every step, nu 1/2.
      r = {"step": t}
      for p in paths:
        r[f"pred_state/rn/changed/{p}"] = 4
        r[f"pred_state/rn/erased/{p}"] = 1.0 if "/mu/" in p else 2.0
      ref.append(r)
    ref[-1]["val_loss"] = l32
    _run_dir(
      root,
      "st",
      "fp32",
      seed,
      {"lowprec": {"state": [], "state_targets": ["rn: mu=bfloat16"]}},
      ref,
      summary={"steps_per_s": 10.0},
    )
    recs = [{"step": 0, "val_loss": 5.0}]
    for t, e in enumerate([0, 1, 2, 3], start=1):
      r = {"step": t, "state/flushed": t}
      # mu: a with e of 4 erased, b with 0 of 4: e / 8; nu: 4 of 4.
      r.update({f"state/changed/{p}": 4 for p in paths})
      r.update({"state/erased/0/mu/a": e, "state/erased/0/mu/b": 0})
      r["state/erased/0/nu/a"] = 4
      recs.append(r)
    recs[-1]["val_loss"] = lrn
    _run_dir(
      root,
      "st",
      "rn",
      seed,
      {
        "lowprec": {
          "state": ["mu=bfloat16", "nu=float8_e5m2:nearest:block128"]
        },
        "study": {"reference_arm": "fp32", "cell": "rn"},
      },
      recs,
      summary={"steps_per_s": 8.0},
    )
  rows, lines = tables.ANALYSES["state"](tables.load_runs(root, "st"))
  by = {(r["arm"], r["seed"]): r for r in rows}
  assert by[("rn", 0)]["val_minus_fp32"] == pytest.approx(0.5)
  assert by[("rn", 1)]["val_minus_fp32"] == pytest.approx(0.1)
  assert by[("rn", 0)]["mu_erased_2nd_half"] == pytest.approx((2 + 3) / 16)
  assert by[("rn", 0)]["nu_erased_2nd_half"] == pytest.approx(1.0)
  assert by[("rn", 0)]["mu_predicted_2nd_half"] == pytest.approx(0.25)
  assert by[("rn", 0)]["nu_predicted_2nd_half"] == pytest.approx(0.5)
  assert by[("rn", 0)]["state_flushed_last"] == 4
  assert (
    by[("rn", 0)]["state"] == "mu=bfloat16, nu=float8_e5m2:nearest:block128"
  )
  # float32 weights 4, mu bf16 2, nu one byte and a float32 scale per 128.
  assert by[("rn", 0)]["bytes_per_param"] == pytest.approx(4 + 2 + 1 + 4 / 128)
  assert by[("fp32", 0)]["bytes_per_param"] == pytest.approx(12.0)
  assert by[("rn", 0)]["steps_per_s"] == 8.0
  assert by[("fp32", 0)]["state"] == "float32"
  assert "mu_erased_2nd_half" not in by[("fp32", 0)]
  text = "\n".join(lines)
  assert "- rn: final val loss minus float32 state +0.3000 " in text
  assert "(range +0.1000 to +0.5000) nats, 2 seeds" in text
  assert "mu updates erased (2nd half) 0.312, predicted 0.250" in text
  assert "nu updates erased (2nd half) 1.000, predicted 0.500" in text


def test_recovery_table_per_seed_means_and_ratio(tmp_path):
  root = str(tmp_path)
  losses = {  # seed: fp32, nearest, stochastic, deadzone
    0: (2.0, 3.0, 2.1, 2.2),
    1: (2.0, 2.5, 2.1, 2.0),
  }
  for seed, ls in losses.items():
    for arm, rounding, loss in zip(
      ("fp32", "rn", "sr", "dzsr"),
      ("nearest", "nearest", "stochastic", "deadzone"),
      ls,
      strict=True,
    ):
      wb = "" if arm == "fp32" else "e8m4"
      _run_dir(
        root,
        "d",
        arm,
        seed,
        {"lowprec": {"writeback": wb, "rounding": rounding}},
        [{"step": 0, "val_loss": 5.0}, {"step": 1, "val_loss": loss}],
      )
  rows, lines = tables.ANALYSES["recovery"](tables.load_runs(root, "d"))
  assert rows[0]["recovery_full_sr"] == pytest.approx(0.9)
  assert rows[0]["recovery_deadzone_sr"] == pytest.approx(0.8)
  assert rows[1]["recovery_full_sr"] == pytest.approx(0.8)
  assert rows[1]["recovery_deadzone_sr"] == pytest.approx(1.0)
  text = "\n".join(lines)
  assert "full SR / dead-zone SR: 0.8500 / 0.9000" in text
  assert "ratio dead-zone / full: 1.0588" in text
  assert "mean 0.7500 nats over 2 seeds" in text
  assert "above 1 (the stochastic run ends below fp32): full SR 0/2" in text
  # Matched seeds: dead-zone minus full SR, +0.1 and -0.1 nats.
  d = [rows[0]["deadzone_minus_full_sr"], rows[1]["deadzone_minus_full_sr"]]
  assert d == pytest.approx([0.1, -0.1])
  sd = np.std([0.1, -0.1], ddof=1)
  assert (
    "dead-zone minus full SR, final val loss per matched seed: +0.1000, "
    f"-0.1000 nats; mean +0.0000, sd {sd:.4f} (2 seeds); negative "
    "(dead-zone lower) in 1/2 seeds, positive in 1/2" in text
  )


def test_remedies_table_sets_predicted_against_measured_fractions(tmp_path):
  root = str(tmp_path)
  e5m2 = "bfloat16_kahan_float8_e5m2"
  pred = {  # the float32 run's prediction, steps 1..3
    "bfloat16/erased_fraction": [0.5, 0.6, 0.7],
    f"{e5m2}/erased_fraction": [0.2, 0.3, 0.4],
    f"{e5m2}/lost_fraction": [0.1, 0.1, float("nan")],
  }
  recs = [{"step": 0, "val_loss": 5.0}]
  for t in range(3):
    recs.append({"step": t + 1, "val_loss": 2.0})
    recs[-1].update({f"pred/{k}": v[t] for k, v in pred.items()})
  _run_dir(root, "p", "fp32", 0, {"lowprec": {}}, recs)
  arms = {  # arm: (lowprec overrides, erased, lost, proposals per step)
    "rn_bf16": ({"writeback": "bfloat16"}, [0.5, 0.6, 0.8], None, None),
    "kahan_e5m2": (
      {"writeback": "bfloat16", "compensation": "kahan",
       "buffer": "float8_e5m2"},
      [0.2, 0.2, 0.4], [1, 2, 0], [10, 10, 0],
    ),
    "remainder": (
      {"writeback": "bfloat16", "compensation": "remainder"},
      [0.1, 0.1, 0.1], [0, 0, 0], [10, 10, 10],
    ),
  }  # fmt: skip
  for arm, (lp, erased, lost, props) in arms.items():
    recs = [{"step": 0, "val_loss": 5.0}]
    for t in range(3):
      rec = {"step": t + 1, "val_loss": 3.0, "erased_fraction": erased[t]}
      if lost is not None:
        rec.update(lost=lost[t], proposals=props[t])
      recs.append(rec)
    _run_dir(root, "p", arm, 0, {"lowprec": lp}, recs)
  rows, lines = tables.ANALYSES["remedies"](tables.load_runs(root, "p"))
  by = {r["arm"]: r for r in rows}
  k = by["kahan (float8_e5m2 buffer)"]
  assert k["pred_erased_mean"] == pytest.approx(0.3)
  assert k["erased_mean"] == pytest.approx(0.8 / 3)
  assert k["erased_rmse"] == pytest.approx(np.sqrt(0.01 / 3))
  # Step 3 has no proposals (and a NaN prediction): left out.
  assert k["pred_lost_mean"] == pytest.approx(0.1)
  assert k["lost_mean"] == pytest.approx(0.15)
  assert k["lost_rmse"] == pytest.approx(np.sqrt((0 + 0.01) / 2))
  n = by["nearest"]
  assert n["pred_erased_mean"] == pytest.approx(0.6)
  assert n["erased_rmse"] == pytest.approx(np.sqrt(0.01 / 3))
  assert n.get("pred_lost_mean") is None
  assert "pred_erased_mean" not in by["remainder"]
  assert "pred_erased_mean" not in by["fp32"]
  text = "\n".join(lines)
  assert (
    "- kahan (float8_e5m2 buffer), float32 prediction vs measured (mean "
    "over steps): erased 0.3000 vs 0.2667 (curve RMSE 0.0577); lost "
    "0.1000 vs 0.1500 (curve RMSE 0.0707)" in text
  )
  assert "- nearest, float32 prediction vs measured" in text


def _replay_run(root, arm, start, rounding, v0, v1, **lowprec):
  _run_dir(
    root,
    "r",
    arm,
    0,
    {
      "lowprec": {"writeback": "int3", "rounding": rounding, **lowprec},
      "train": {
        "steps": 3,
        "init_from_arm": "fp32_reference",
        "init_from_step": start,
      },
      "model": {"vocab_size": 256},
    },
    [{"step": 0, "val_loss": v0}, {"step": 3, "val_loss": v1}],
  )


def test_remedies_table_recovers_the_nearest_gap_per_kind(tmp_path):
  root = str(tmp_path)
  arms = {  # arm: (lowprec overrides, final loss for seeds 0 and 1)
    "fp32": ({}, (2.0, 2.0)),
    "mixed_bf16": ({"weight_format": "bfloat16"}, (2.1, 2.0)),
    "rn_bf16": ({"writeback": "bfloat16"}, (3.0, 2.5)),
    "kahan_e5m2": (
      {"writeback": "bfloat16", "compensation": "kahan",
       "buffer": "float8_e5m2"},
      (2.5, 2.25),
    ),
    "remainder": (
      {"writeback": "bfloat16", "compensation": "remainder"}, (2.1, 2.05)
    ),
  }  # fmt: skip
  for arm, (lp, losses) in arms.items():
    for seed, loss in enumerate(losses):
      last = {"step": 1, "val_loss": loss}
      if lp.get("writeback"):
        last.update(erased_fraction=0.5, carried=0.25 * seed)
      rate = {"rn_bf16": 10.0, "kahan_e5m2": 8.0 - seed}.get(arm, 9.0)
      _run_dir(
        root, "m", arm, seed, {"lowprec": lp},
        [{"step": 0, "val_loss": 5.0}, last], summary={"steps_per_s": rate},
      )  # fmt: skip
  rows, lines = tables.ANALYSES["remedies"](tables.load_runs(root, "m"))
  by = {r["arm"]: r for r in rows}
  assert set(by) == {
    "fp32", "mixed", "nearest", "kahan (float8_e5m2 buffer)", "remainder"
  }  # fmt: skip
  assert by["kahan (float8_e5m2 buffer)"]["recovery"] == pytest.approx(0.5)
  assert by["remainder"]["recovery"] == pytest.approx((0.9 + 0.9) / 2)
  assert by["mixed"]["recovery"] == pytest.approx((0.9 + 1.0) / 2)
  assert by["remainder"]["final_val_loss"] == pytest.approx(2.075)
  assert by["remainder"]["carried"] == pytest.approx(0.125)
  assert by["fp32"]["erased_fraction"] is None
  assert by["nearest"]["seeds"] == 2
  # Weights bf16 (2), e5m2 buffer (1), remainder (2), AdamW moments (8).
  assert by["kahan (float8_e5m2 buffer)"]["bytes_per_param"] == 11.0
  assert by["remainder"]["bytes_per_param"] == 12.0
  assert by["nearest"]["bytes_per_param"] == 10.0
  assert by["fp32"]["bytes_per_param"] == by["mixed"]["bytes_per_param"] == 12
  assert by["kahan (float8_e5m2 buffer)"]["step_time_vs_nearest"] == (
    pytest.approx((10 / 8 + 10 / 7) / 2)
  )
  assert by["nearest"]["step_time_vs_nearest"] == 1.0
  assert "- remainder: recovers 0.900 of the nearest-rounding loss gap " in (
    "\n".join(lines)
  )


def test_replay_table_relative_reduction_and_sr_minus_rn(tmp_path):
  root = str(tmp_path)
  ref = [{"step": s, "val_loss": 5.0 - s / 10} for s in range(0, 11)]
  _run_dir(root, "r", "fp32_reference", 0, {}, ref)
  for start, rounding, (v0, v1) in (
    (2, "stochastic", (6.0, 4.5)),
    (2, "nearest", (6.0, 5.7)),
    (4, "stochastic", (5.0, 4.0)),
    (4, "nearest", (5.0, 5.0)),
  ):
    _replay_run(root, f"{rounding}_{start}", start, rounding, v0, v1)
  # A second quantizer, one step for the model: only a stochastic replay.
  _replay_run(root, "m_4", 4, "stochastic", 5.5, 2.75, int_scale_scope="model")
  rows, lines = tables.ANALYSES["replay"](tables.load_runs(root, "r"))
  assert [(r["quantizer"], r["checkpoint"]) for r in rows] == [
    ("one step for the model", 4),
    ("per tensor", 2),
    ("per tensor", 4),
  ]
  first = rows[1]
  assert first["fp32_at_checkpoint"] == pytest.approx(4.8)
  assert first["after_quantizing"] == 6.0
  assert first["start_over_uniform"] == pytest.approx(6.0 / np.log(256))
  assert first["stochastic_final"] == 4.5 and first["nearest_final"] == 5.7
  assert first["stochastic_change"] == pytest.approx(-1.5)
  assert first["stochastic_reduction"] == pytest.approx(0.25)
  assert first["nearest_reduction"] == pytest.approx(0.05)
  assert first["sr_minus_rn"] == pytest.approx(-1.2)
  assert first["sr_minus_rn_rel"] == pytest.approx(-0.2)
  assert first["fp32_same_data_step"] == pytest.approx(4.5)
  assert rows[2]["nearest_change"] == 0 and rows[2]["sr_minus_rn"] == -1.0
  model = rows[0]
  assert model["stochastic_reduction"] == pytest.approx(0.5)
  assert model["nearest_final"] is None and model["sr_minus_rn"] is None
  text = "\n".join(lines)
  assert (
    "- per tensor, stochastic write-back, 2 checkpoint(s): relative "
    "reduction 20.00% to 25.00% (mean 22.50%); change -1.5000 to -1.0000 "
    "(mean -1.2500) nats" in text
  )
  assert (
    "- per tensor, nearest write-back, 2 checkpoint(s): relative reduction "
    "0.00% to 5.00% (mean 2.50%)" in text
  )
  assert (
    "- per tensor, stochastic minus nearest final val loss, 2 "
    "checkpoint(s): -1.2000 to -1.0000 (mean -1.1000) nats; -20.00% to "
    "-20.00% (mean -20.00%) of the start" in text
  )
  assert (
    "- one step for the model, stochastic write-back, 1 checkpoint(s): "
    "relative reduction 50.00% to 50.00%" in text
  )
  assert "- one step for the model: start / ln V 0.992 to 0.992" in text
  assert "69.71%" in text


def test_audit_table_rmse_skill_and_template(tmp_path):
  root = str(tmp_path)
  pred = [0.5, 0.7]
  _reference(root, "a", "float8_e4m3fn", pred, seed=0)
  for seed, meas in ((1, [0.5, 0.7]), (2, [0.6, 0.8])):
    _lowprec(root, "a", "rn", "float8_e4m3fn", meas, seed=seed)
  rows, lines = tables.ANALYSES["audit"](tables.load_runs(root, "a"))
  assert [r["seed"] for r in rows] == [1, 2]
  assert all(r["reference_seed"] == 0 for r in rows)
  assert rows[0]["rmse"] == pytest.approx(0.0)
  assert rows[1]["rmse"] == pytest.approx(0.1)
  assert rows[0]["naive_rmse"] == pytest.approx(0.1)
  assert rows[1]["naive_rmse"] == pytest.approx(math.sqrt(0.02))
  naive = (0.1 + math.sqrt(0.02)) / 2
  text = "\n".join(lines)
  assert "vs 2 unseen seeds: 0.05000" in text
  assert f"macro RMSE {naive:.5f}; skill" in text
  assert f"= {1 - 0.05 / naive:.3f}" in text
  # Template: each seed predicted by the other's measured curve.
  assert (
    "template (mean measured curve of the other seeds): macro RMSE "
    "0.10000" in text
  )


def _audit_variant(root, suffix, batch, dev_scale):
  """Source trace (seed 0), matched fp32 runs and e4m3 runs (seeds 1-3):
  measured e_k = base + d_k (deviations summing to zero over k), source
  p = base + d_1 / 2 for every seed, matched p_k = base + d_k / 2."""
  t = np.arange(8)
  base = 0.5 + 0.05 * t
  d1 = dev_scale * np.sin(t)
  d2 = dev_scale * np.cos(t)
  dev = {1: d1, 2: d2, 3: -(d1 + d2)}
  fmt = "float8_e4m3fn"
  ref, matched = f"ref{suffix}", f"fp32_matched{suffix}"
  _reference(root, "a", fmt, list(base + d1 / 2), seed=0, arm=ref, batch=batch)
  for k, d in dev.items():
    pk = list(base + d / 2)
    _reference(root, "a", fmt, pk, seed=k, arm=matched, batch=batch)
    _lowprec(
      root,
      "a",
      f"rn_e4m3{suffix}",
      fmt,
      list(base + d),
      seed=k,
      study={"reference_arm": ref},
      data={"batch_size": batch},
    )
  e = np.stack([base + dev[k] for k in (1, 2, 3)])
  return base + d1 / 2, np.stack([base + dev[k] / 2 for k in (1, 2, 3)]), e


def _rms(x):
  return float(np.sqrt(np.mean(np.square(x))))


def test_audit_table_matched_references_floor_specificity_common_time(
  tmp_path,
):
  root = str(tmp_path)
  want = {
    16: _audit_variant(root, "", 16, 0.04),
    64: _audit_variant(root, "_b64", 64, 0.01),
  }
  rows, lines = tables.ANALYSES["audit"](tables.load_runs(root, "a"))
  text = "\n".join(lines)
  assert [(r["batch_size"], r["seed"]) for r in rows] == [
    (16, 1),
    (16, 2),
    (16, 3),
    (64, 1),
    (64, 2),
    (64, 3),
  ]
  for r in rows:
    p, pk, e = want[r["batch_size"]]
    k = r["seed"] - 1
    c = e.mean(0)
    assert r["reference_seed"] == 0
    assert r["rmse"] == pytest.approx(_rms(p - e[k]))
    assert r["matched_rmse"] == pytest.approx(_rms(pk[k] - e[k]))
    assert r["noise_floor"] == pytest.approx(_rms(p - pk[k]))
    assert r["source_specificity_corr"] == pytest.approx(
      np.corrcoef(p - c, e[k] - c)[0, 1]
    )
    assert r["matched_specificity_corr"] == pytest.approx(1.0)
  # The reused trace is right for seed 1 only: it fails; matched passes.
  assert rows[0]["source_specificity_corr"] == pytest.approx(1.0)
  assert min(r["source_specificity_corr"] for r in rows[:3]) < 0
  assert text.count("source trace (reused): corr +1.000, ") == 2
  assert text.count(": fails") == 2
  assert (
    text.count("matched references: corr +1.000, +1.000, +1.000: passes") == 2
  )
  for batch, suffix in ((16, ""), (64, "_b64")):
    p, pk, e = want[batch]
    share = len(e) * np.sum((e.mean(0) - e.mean()) ** 2)
    share /= np.sum((e - e.mean()) ** 2)
    assert f"- rn_e4m3{suffix} (batch {batch}): macro RMSE" in text
    floor = np.mean([_rms(p - x) for x in pk])
    assert f"{floor:.5f}" in text
    assert f"variation that is common time: {share:.2%}" in text
  floors = [np.mean([_rms(want[b][0] - x) for x in want[b][1]]) for b in want]
  assert f"  - noise floor (mean): {floors[0]:.5f} vs {floors[1]:.5f}" in text
  assert "- batch 16 vs 64:" in text and "99.65%" in text


def test_fp8_table_frozen_coordinates_and_loss_change(tmp_path):
  root = str(tmp_path)
  n = 4
  _reference(
    root,
    "f",
    "float8_e4m3fn",
    [0.9] * n,
    extra={s: {"pred/float8_e4m3fn_sr/move_prob": 0.2} for s in range(1, 5)},
  )
  # the reference's val loss improves; the RN run's does not
  with open(os.path.join(root, "f", "ref", "seed0", "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 2, "val_loss": 2.5}) + "\n")
    f.write(json.dumps({"step": 4, "val_loss": 2.0}) + "\n")
  # three sampled coordinates on the grid: one never moves, one moves only
  # early; a fourth, off the grid (kept float32), moves and is left out
  u = [[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]]
  w = [0.5, 1.0, 0.25, 0.1234]
  recs = [{"step": 0, "val_loss": 3.0}]
  for s in range(1, n + 1):
    recs.append(
      {
        "step": s,
        "erased_fraction": 0.95,
        "proposals": 100,
        "moved": 5,
        "pred/sample/u": u[s - 1],
        "pred/sample/w": w,
        **({"val_loss": 2.9} if s in (2, 4) else {}),
      }
    )
  _run_dir(
    root,
    "f",
    "rn_e4m3",
    0,
    {
      "lowprec": {"writeback": "float8_e4m3fn", "rounding": "nearest"},
      "study": {"reference_arm": "ref", "cell": "e4m3"},
    },
    recs,
  )
  rows, lines = tables.ANALYSES["fp8"](tables.load_runs(root, "f"))
  rn = next(r for r in rows if r["arm"] == "rn_e4m3")
  assert rn["predicted_crossing"] == rn["measured_crossing"] == "1 (at_init)"
  assert rn["frozen_whole_run"] == pytest.approx(1 / 3)
  assert rn["frozen_second_half"] == pytest.approx(2 / 3)
  assert rn["second_half_change"] == pytest.approx(0.0)
  ref = next(r for r in rows if r["arm"] == "ref")
  assert ref["second_half_change"] == pytest.approx(-0.5)
  assert rn["measured_mean_erased"] == pytest.approx(0.95)
  assert any("never moved: 33.3%" in x for x in lines)


def test_fp8_table_keeps_each_seed_of_a_scaled_format_apart(tmp_path):
  # Two seeds of an MX arm crossing at different steps: each row has its
  # own crossing and RMSE. Sampled coordinates on the MX grid (e4m3
  # mantissas under any scale) count; one with a float32 mantissa does not.
  root, n = str(tmp_path), 6
  u = [[0, 1, 1]] * 3 + [[0, 0, 1]] * 3
  w = [0.5 * 2.0**-20, 1.75 * 2.0**9, 0.1234]
  for seed, cross in ((0, 2), (1, 4)):
    _reference(root, "m", "mxfp8_e4m3", _curve(n, cross), seed=seed)
    _lowprec(root, "m", "rn_mx", "mxfp8_e4m3", _curve(n, cross), seed=seed)
    path = os.path.join(root, "m", "rn_mx", f"seed{seed}", "metrics.jsonl")
    with open(path) as f:
      recs = [json.loads(line) for line in f]
    for rec in recs[1:]:
      rec.update({"pred/sample/u": u[rec["step"] - 1], "pred/sample/w": w})
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in recs)
  rows, _ = tables.ANALYSES["fp8"](tables.load_runs(root, "m"))
  rn = {r["seed"]: r for r in rows if r["arm"] == "rn_mx"}
  assert rn[0]["measured_crossing"] == "2 (post_init)"
  assert rn[1]["measured_crossing"] == "4 (post_init)"
  assert rn[0]["predicted_crossing"] == "2 (post_init)"
  assert rn[1]["predicted_crossing"] == "4 (post_init)"
  assert rn[0]["frozen_whole_run"] == rn[1]["frozen_whole_run"] == 0.5
  assert rn[0]["frozen_second_half"] == 1.0


# -------------------------------------------------------- smoke, end to end


# The study whose smoke runs through `scripts.reproduce` (every arm, then
# the table and figure, in one command) rather than the entry point alone.
REPRODUCED = "e4m3_audit"


def _reproduce(name, root):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  return subprocess.run(
    [
      sys.executable, "-m", "scripts.reproduce", name,
      "--arg", "scale=smoke", "--results", str(root),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=1800,
  )  # fmt: skip


def _smoke(name, root):
  """Runs study `name` at smoke scale under `root` through the entry point
  (`REPRODUCED` through `scripts.reproduce`, its output kept beside the
  runs; one device: the programs of one device compile in about 60% of the
  time of eight), makes its table and figure (an illegible figure is an
  error: plotting.problems). Returns the config, the table's markdown
  and the figure's path."""
  c = _load(name, "scale=smoke")
  if name == REPRODUCED:
    run = _reproduce(name, root)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    (root / name / "reproduce.out").write_text(run.stdout)
  else:
    arg = f"--config=configs/{name}.py:scale=smoke"
    run = train_run(root, arg, devices=1, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
  for path in (root / name).glob("*/seed*/summary.json"):
    assert json.loads(path.read_text())["status"] == "finished", path
  md = tables.make(name, str(root))
  with warnings.catch_warnings():
    warnings.simplefilter("error", plotting.IllegibleFigure)
    png = figures.plot(name, str(root))
  assert os.path.getsize(png) > 1000
  assert os.path.exists(os.path.join(root, name, "tables", f"{name}.csv"))
  c.log.results_dir = str(root)
  return c, md, png


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  """`smoke(name) -> (config, table markdown, results root)`: each study's
  smoke runs once per module (several tests read the same run)."""
  root = tmp_path_factory.mktemp("smokes")
  done = {}

  def run(name):
    if name not in done:
      done[name] = _smoke(name, root)[:2]
    return (*done[name], root)

  return run


@pytest.mark.slow
def test_int3_replay_smoke_restores_checkpoints_and_tabulates(smoke):
  c, md, root = smoke("int3_replay")
  model = "one step for the model (norms, biases float32)"
  for q in ("per tensor", model):
    for rounding in ("stochastic", "nearest"):
      assert f"- {q}, {rounding} write-back, 2 checkpoint(s)" in md
    assert f"- {q}, stochastic minus nearest final val loss, 2 " in md
    assert f"- {q}: start / ln V " in md
  table = root / "int3_replay" / "tables" / "int3_replay.csv"
  rows = list(csv.DictReader(open(table)))
  assert len(rows) == 4  # 2 quantizers x 2 checkpoints
  for r in rows:
    sr, rn, v0 = (
      float(r[k])
      for k in ("stochastic_final", "nearest_final", "after_quantizing")
    )
    assert float(r["sr_minus_rn"]) == pytest.approx(sr - rn)
    assert float(r["sr_minus_rn_rel"]) == pytest.approx((sr - rn) / v0)
    assert float(r["stochastic_reduction"]) == pytest.approx((v0 - sr) / v0)
    assert float(r["start_over_uniform"]) == pytest.approx(v0 / math.log(256))
  # The parameters a replay starts from are the reference's, bit for bit.
  ref = study.resolve(c, "fp32_reference", 0)
  run = train.build_run(ref)
  d = os.path.join(root, "int3_replay", "fp32_reference", "seed0")
  params = checkpoint.restore_params(
    os.path.join(d, "checkpoints"), ref.train.steps, run.state.params
  )
  with open(os.path.join(d, "summary.json")) as f:
    assert train.params_digest(params) == json.load(f)["param_digest"]
  with pytest.raises(FileNotFoundError, match="saved steps"):
    checkpoint.restore_params(
      os.path.join(d, "checkpoints"), 3, run.state.params
    )
  # The replay's weights are on their per-tensor int3 grids.
  rep = study.resolve(c, "int3_from_2", 0)
  state = train.build_run(rep).state
  for x in jax.tree.leaves(state.params):
    x = np.asarray(x)
    scale = 2.0 ** math.ceil(math.log2(np.abs(x).max() / 3))
    assert np.all(np.abs(x / scale - np.round(x / scale)) == 0)
    assert np.abs(x / scale).max() <= 3
  # One step for the model: from the largest |w| of the checkpoint's grid
  # tensors; norms and biases as saved, every other weight a multiple of it.
  rep = study.resolve(c, "int3m_from_2", 0)
  src = checkpoint.restore_params(
    os.path.join(d, "checkpoints"), 2, run.state.params
  )
  got = train.build_run(rep).state.params
  keep = rep.lowprec.keep_float32
  flat_src = dict(zip(leaf_paths(src), jax.tree.leaves(src), strict=True))
  flat_got = dict(zip(leaf_paths(got), jax.tree.leaves(got), strict=True))
  on_grid = [p for p in flat_src if not re.fullmatch(keep, p)]
  amax = max(float(np.abs(np.asarray(flat_src[p])).max()) for p in on_grid)
  scale = 2.0 ** math.ceil(math.log2(amax / 3))
  zeroed = []
  for p, x in flat_got.items():
    x, x0 = np.asarray(x), np.asarray(flat_src[p])
    if p not in on_grid:
      np.testing.assert_array_equal(x, x0)
      continue
    np.testing.assert_array_equal(
      x, np.clip(np.round(x0 / scale), -3, 3) * scale
    )
    zeroed.append(np.mean(x == 0))
  assert np.mean(zeroed) > 0.5  # most small weights are zeroed


@pytest.mark.slow
def test_grid_smoke_makes_its_table(smoke):
  _, md, root = smoke("freeze_grid")
  assert "cells with predicted and measured post-init crossings: " in md
  assert "categories differ" in md
  assert re.search(r"measured crossing at step 2: \d+/\d+ \(predicted", md)
  assert "measured crossings after step 2: " in md
  assert "freeze_grid.png" in os.listdir(root / "freeze_grid" / "tables")


@pytest.mark.slow
@pytest.mark.parametrize(
  "name",
  [
    "freeze_gpt2_fp8",
    "freeze_mx",
    "freeze_transfer",
    "deadzone_vs_sr",
    "frontier_confirm",
  ],
)
def test_slow_smoke_study_makes_its_table(name, smoke):
  _, md, root = smoke(name)
  expect = {
    "freeze_gpt2_fp8": "validation loss fp32_reference",
    "freeze_mx": "rn_mxfp8_e4m3 (mxfp8_e4m3): predicted crossing",
    "freeze_transfer": "- all tasks:",
    "deadzone_vs_sr": "mean recovery, full SR / dead-zone SR",
    "frontier_confirm": "| bf16_eco_sr | bfloat16 | eco (stochastic) | - |",
  }[name]
  assert expect in md
  if name == "deadzone_vs_sr":
    rows = list(csv.DictReader(open(root / name / "tables" / f"{name}.csv")))
    d = float(rows[0]["deadzone_minus_full_sr"])
    want = float(rows[0]["val_loss_deadzone"]) - float(
      rows[0]["val_loss_stochastic"]
    )
    assert d == pytest.approx(want)
    assert f"per matched seed: {d:+.4f} nats" in md


@pytest.mark.slow
def test_state_precision_smoke_stores_narrow_state_and_tabulates(smoke):
  _, md, root = smoke("state_precision")
  assert "- bf16w_sr_fp8: final val loss minus float32 state" in md
  rows = list(
    csv.DictReader(
      open(root / "state_precision" / "tables" / "state_precision.csv")
    )
  )
  assert {r["arm"] for r in rows} == {"bf16w_fp32", "bf16w_sr_fp8"}
  for r in rows:
    if r["arm"] != "bf16w_fp32":
      for m in ("mu", "nu"):
        assert 0.0 <= float(r[f"{m}_erased_2nd_half"]) <= 1.0
        assert 0.0 <= float(r[f"{m}_predicted_2nd_half"]) <= 1.0


@pytest.mark.slow
def test_user_reports_smoke_predicts_the_stuck_gains(smoke):
  _, md, root = smoke("freeze_user_reports")
  rows = {
    (r["group"], r["step"]): r
    for r in csv.DictReader(
      open(root / "freeze_user_reports" / "tables" / "freeze_user_reports.csv")
    )
  }
  # Six steps of lr <= 6.5e-4: no bf16 gain of 1.0 can move under nearest
  # write-back; the trace predicts it, the checkpoints show it.
  for step in ("3", "6"):
    gains = rows[("norm gains", step)]
    assert float(gains["at_init_predicted"]) == 1.0
    assert float(gains["at_init_nearest"]) == 1.0
    assert float(gains["at_init_stochastic"]) < 1.0
  assert float(rows[("MLP kernels", "6")]["at_init_nearest"]) < 0.1
  assert "tolerance 0.05 (met)" in md


@pytest.mark.parametrize("scale", ["cpu", "smoke"])
def test_failing_reuse_study_is_the_searchs_e2m1_runs(scale):
  # Same numerics, data, probe and seeds: the study's runs are the search's.
  one = _load("attention_reuse_e2m1", f"scale={scale}")
  search = _load("attention_reuse_search", f"scale={scale}")
  for arm in ("reuse", "redraw", "outonly"):
    for seed in study.seeds_of(one, arm):
      a = study.resolve(one, arm, seed).to_dict()
      b = study.resolve(search, f"e2m1_{arm}", seed).to_dict()
      for key in ("lowprec", "opt", "train", "model", "data"):
        assert a[key] == b[key], (arm, key)


@pytest.mark.parametrize("scale", common.SCALES)
def test_search_mx_settings_validate_and_fit_the_blocks(scale):
  c = _load("attention_reuse_search", f"scale={scale}")
  arms = [a for a in study.arms_of(c) if a.startswith("mx_")]
  assert arms  # the smoke variant keeps mx_e2m1
  for arm in arms:
    r = study.resolve(c, arm, 0)
    study.validate(r)
    saved = models.numerics_from(r.lowprec).saved
    assert saved.is_scaled_format and saved.format.block == 32
    # Blocked axes: the keys (seq_len), the width (attention's output as
    # heads x head_dim, dense and norm outputs), the MLP's hidden width.
    m = r.model
    hidden = m.mlp_ratio * m.d_model
    assert all(n % 32 == 0 for n in (m.seq_len, m.d_model, hidden))
    bad = ml_collections.ConfigDict(r.to_dict())
    bad.lowprec.fwd_format = "mxfp4_e2m2"
    with pytest.raises(ValueError, match="lowprec.fwd_format"):
      study.validate(bad)


@pytest.mark.slow
def test_attention_search_smoke_tabulates_each_setting(smoke):
  _, md, root = smoke("attention_reuse_search")
  rows = list(
    csv.DictReader(
      open(
        root
        / "attention_reuse_search"
        / "tables"
        / "attention_reuse_search.csv"
      )
    )
  )
  # By dose, then MX: the config's order (study.settings).
  assert [r["setting"] for r in rows] == ["e2m1", "mx_e2m1"]
  for r in rows:
    for arm in ("reuse", "redraw", "outonly"):
      assert float(r[f"{arm}_val_loss"]) > 0
    for copy in ("redraw", "outonly"):
      assert r[f"reuse_minus_{copy}_fails"] in ("True", "False")
  assert "failure criterion (fixed before the runs)" in md
  assert "reuse vs redraw: settings that fail" in md


@pytest.mark.slow
def test_reproduce_runs_the_audit_smoke_through_the_entry_point(smoke):
  # The smoke fixture runs this study through `scripts.reproduce`.
  _, _, root = smoke(REPRODUCED)
  md = (root / REPRODUCED / "reproduce.out").read_text()
  for arm, batch in (("rn_e4m3", 16), ("rn_e4m3_b64", 64)):
    assert (
      f"- {arm} (batch {batch}): macro RMSE, one fp32 trace (seed 0) vs 2 "
      "unseen seeds" in md
    )
  assert md.count("matched reference (each seed's own fp32 trace)") == 2
  assert md.count("noise floor, RMSE between the seed-0 trace") == 2
  assert md.count("source trace (reused): corr ") == 2
  assert md.count("matched references: corr ") == 2
  assert md.count("variation that is common time: ") == 2
  assert "- batch 16 vs 64:" in md
  # With two unseen seeds, e_1 - c = -(e_2 - c): one reused trace's two
  # correlations have opposite signs (or are undefined).
  table = root / "e4m3_audit" / "tables" / "e4m3_audit.csv"
  rows = list(csv.DictReader(open(table)))
  assert len(rows) == 4
  for arm in ("rn_e4m3", "rn_e4m3_b64"):
    r = [float(x["source_specificity_corr"]) for x in rows if x["arm"] == arm]
    assert r[0] == pytest.approx(-r[1]) or all(map(math.isnan, r))
  assert (root / "e4m3_audit" / "tables" / "e4m3_audit.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["remedies", "remedies_fp8"])
def test_remedies_smoke_runs_and_tabulates(name, smoke):
  _, md, root = smoke(name)
  assert "| kahan (float8_e5m2 buffer) |" in md
  assert (
    "- kahan (float8_e5m2 buffer), float32 prediction vs measured (mean "
    "over steps): erased " in md
  )


# A snake_case identifier outside backticks: a row key, not words.
_IDENTIFIER = re.compile(r"[A-Za-z0-9]_[A-Za-z0-9]")


@pytest.mark.slow
@pytest.mark.parametrize("name", studies.names())
def test_every_study_writes_worded_tables_and_legible_figures(name, smoke):
  # At smoke scale, where curves are a few points and arms often agree to
  # the last digit: every column is named in words, and the figure has no
  # text cut or overlapping, no point off its axes, no hidden line and no
  # empty panel (plotting.problems, an error in `_smoke`).
  _, md, _ = smoke(name)
  head = next(line for line in md.splitlines() if line.startswith("| "))
  cells = [c.strip() for c in re.split(r"(?<!\\)\|", head)[1:-1]]
  words = [c for c in cells if not _IDENTIFIER.search(re.sub("`[^`]*`", "", c))]
  assert words == cells, f"not in words: {sorted(set(cells) - set(words))}"


def test_frontier_table_pairs_seeds_with_intervals_front_and_convergence(
  tmp_path,
):
  # Three seeds of float32, nearest and Kahan write-back whose final val
  # losses are set: paired differences, their t-interval (t(2) = 4.303),
  # recovery of the nearest gap, bytes, the Pareto front, and float32's
  # convergence over the last 20% of the steps, per seed.
  root = str(tmp_path)
  base = common.get_config().to_dict()
  base["train"]["steps"] = 10
  fp32 = {0: 2.0, 1: 2.1, 2: 2.05}
  arms = {
    "fp32": ({}, [0.0, 0.0, 0.0]),
    "bf16_rn": ({"writeback": "bfloat16"}, [0.1, 0.12, 0.11]),
    "bf16_kahan": (
      {"writeback": "bfloat16", "compensation": "kahan"},
      [-0.001, -0.001, 0.0],
    ),
  }
  before = {0: 2.005, 1: 2.13, 2: 2.055}  # val loss at step 8
  for arm, (lp, diffs) in arms.items():
    for s, d in zip(fp32, diffs, strict=True):
      recs = [{"step": 0, "val_loss": 5.0}]
      for t in range(1, 11):
        rec = {"step": t, "loss": 3.0}
        if t == 8:
          rec["val_loss"] = before[s] + d
        if t == 10:
          rec["val_loss"] = fp32[s] + d
        recs.append(rec)
      config = {**base, "lowprec": {**base["lowprec"], **lp}}
      summary = {"final_val_loss": fp32[s] + d, "steps_per_s": 10.0}
      _run_dir(root, "f", arm, s, config, recs, summary)
  rows, lines = tables.ANALYSES["frontier"](tables.load_runs(root, "f"))
  by = {r["arm"]: r for r in rows}
  rn = by["bf16_rn"]
  assert rn["loss_vs_fp32"] == pytest.approx(0.11)
  assert rn["half_width_95"] == pytest.approx(4.303 * 0.01 / math.sqrt(3))
  assert (
    rn["bytes_per_param"] == 10.0
    and by["bf16_kahan"]["bytes_per_param"] == 12.0
  )
  want = np.mean([0.101 / 0.1, 0.121 / 0.12, 1.0])
  assert by["bf16_kahan"]["recovery"] == pytest.approx(want)
  assert [r["arm"] for r in rows if r["on_front"]] == ["bf16_rn", "bf16_kahan"]
  assert by["fp32"]["on_front"] == ""  # Kahan: same bytes, lower mean
  text = "\n".join(lines)
  assert "float32 seed 0: val loss 2.0050 at step 8 -> 2.0000 at 10" in text
  assert "(-0.0050 nats): converged" in text
  assert "float32 seed 1" in text and "NOT converged" in text
  assert (
    "- bf16_rn (10.00 B/param): +0.1100 [+0.0852, +0.1348] nats, costs loss"
    in text
  )
  assert "- fp32 (" not in text  # the reference is not compared to itself


# ------------------------------------------------ the backward-pass studies


def _bwd_smoke(smoke, name):
  """The study's smoke (the module's one run), with a figure of a
  sensible size."""
  c, md, root = smoke(name)
  (png,) = (root / name / "tables").glob("*.png")
  assert 1000 < os.path.getsize(png) < 200_000
  return c, md, root


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention_reuse", "norm_store"])
def test_training_study_smoke_logs_the_probe(name, smoke):
  c, md, root = _bwd_smoke(smoke, name)
  arm = next(iter(c.study.arms))
  path = os.path.join(root, name, arm, "seed0", "metrics.jsonl")
  recs = results.read_metrics(path)
  group = bwd_tables.probe_groups(tables.load_runs(str(root), name)[0])[0]
  probed = [r["step"] for r in recs if f"probe/{group}/bias2" in r]
  assert probed == [0, 2, 4]
  assert all(f"probe/{group}/cos" in r for r in recs if r["step"] in probed)
  assert "final val loss" in md


@pytest.mark.slow
def test_operator_checks_smoke_writes_the_layout(smoke):
  c, md, root = _bwd_smoke(smoke, "bwd_operator_checks")
  for arm in c.study.arms:
    d = os.path.join(root, "bwd_operator_checks", arm, "seed0")
    for f in ("config.json", "env.json", "summary.json", "report.md"):
      assert os.path.exists(os.path.join(d, f)), (arm, f)
    s = results.read_json(os.path.join(d, "summary.json"))
    assert len(s["rows"]) == 14 + 5  # every use of every op, and totals
    assert len(s["values"]) == 14 * 4
  assert "prediction = verification" in md
  # Finished runs are skipped on a second call.
  c2 = _load("bwd_operator_checks", "scale=smoke,arm=per_use")
  c2.log.results_dir = str(root)
  assert study.run_study(c2)[0]["status"] == "finished"


@pytest.mark.slow
def test_fp4_recipe_smoke_tabulates_gaps_and_the_kernel_probe(smoke):
  c, md, root = _bwd_smoke(smoke, "fp4_recipe")
  assert set(c.study.arms) == {"bf16", "nvfp4_all", "mxfp8_up"}
  assert "- nvfp4_all minus bf16: " in md
  assert "kernels: 1 - cos" in md
  runs = tables.load_runs(str(root), "fp4_recipe")
  path = os.path.join(root, "fp4_recipe", "nvfp4_all", "seed0", "metrics.jsonl")
  probed = [
    r["step"] for r in results.read_metrics(path) if "probe/kernels/bias2" in r
  ]
  assert probed == [0, 2, 4] and len(runs) == 3

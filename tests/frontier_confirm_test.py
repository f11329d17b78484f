"""The confirmatory frontier's statistics and table
(experiments/analysis/frontier_confirm.py): Holm's step-down, the
one-sided t-test and bound it uses, and the table on run directories
whose losses are set."""

import json
import math
import os

import numpy as np
import pytest

from configs import common
from experiments.analysis import figures, tables
from experiments.analysis import frontier_confirm as fc


def test_holm_steps_down_and_stops_at_the_first_kept_hypothesis():
  # m = 4: levels 0.05/4, 0.05/3, 0.05/2, 0.05/1 by rank. 0.005 and 0.01
  # pass theirs (0.0125, 0.0167); 0.03 fails 0.025, so 0.04 is kept too
  # although it is below 0.05.
  out = fc.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
  assert {k: v["rejected"] for k, v in out.items()} == {
    "a": True,
    "b": False,
    "c": False,
    "d": True,
  }
  assert out["d"]["level"] == pytest.approx(0.0125)
  assert out["a"]["level"] == pytest.approx(0.05 / 3)
  assert out["b"]["level"] == pytest.approx(0.05)


def test_one_sided_p_and_bound_agree_and_match_the_t_statistic():
  # Seed 0, 200 samples of 8 differences: the bound at level a is below
  # the margin exactly when the p-value is at or below a (the test and
  # its bound are one decision), and p is Student's t CDF of the float64
  # statistic, computed here from its definition.
  from scipy import stats

  rng = np.random.default_rng(0)
  for _ in range(200):
    d = rng.normal(rng.uniform(-0.01, 0.02), 0.006, size=8)
    p = fc.one_sided(d, 0.01)
    t = (d.mean() - 0.01) / (d.std(ddof=1) / math.sqrt(8))
    assert p == pytest.approx(stats.t.cdf(t, 7), rel=1e-12)
    for level in (0.05, 0.05 / 21):
      assert (fc.bound(d, level) < 0.01) == (p < level)
    lo = fc.bound(d, 0.05, upper=False)
    assert (lo > 0) == (fc.one_sided(d, 0.0, upper=False) < 0.05)


def test_non_inferiority_claims_hold_their_level_at_the_margin():
  # Seed 0, 20,000 draws of 8 normal differences whose true mean is the
  # margin: the share declared non-inferior (p <= 0.05) is the test's
  # size, 0.05 within 4 binomial standard errors (0.0062).
  rng = np.random.default_rng(0)
  d = rng.normal(0.01, 0.005, size=(20_000, 8))
  se = d.std(axis=1, ddof=1) / math.sqrt(8)
  from scipy import stats

  p = stats.t.cdf((d.mean(axis=1) - 0.01) / se, 7)
  share = float(np.mean(p <= 0.05))
  assert abs(share - 0.05) < 4 * math.sqrt(0.05 * 0.95 / 20_000)
  # and the module's function decides the same on a sample of them
  for row in d[:200]:
    assert (fc.one_sided(row, 0.01) <= 0.05) == (
      stats.t.cdf((row.mean() - 0.01) / (row.std(ddof=1) / math.sqrt(8)), 7)
      <= 0.05
    )


def test_exact_arms_have_a_zero_bound():
  # Every difference 0 (float32 bit for bit): non-inferior, not worse.
  assert fc.one_sided([0.0] * 4, 0.01) == 0.0
  assert fc.one_sided([0.0] * 4, 0.0, upper=False) == 1.0


def _write(root, arm, seed, config, val, train, steps, saturated=None):
  d = os.path.join(root, "fc", arm, f"seed{seed}")
  os.makedirs(d)
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for t in range(1, steps + 1):
      rec = {"step": t, "loss": train + (1.0 if t <= steps // 2 else 0.0)}
      if saturated is not None:
        rec["saturated"] = saturated
      if t == steps:
        rec["val_loss"] = val
      f.write(json.dumps(rec) + "\n")
  with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump({"final_val_loss": val, "status": "finished"}, f)


def test_confirm_table_pairs_each_horizon_and_applies_holm(tmp_path):
  # 8 seeds. At 10 steps: float32; bf16 SR +0.002 with sd 0.004
  # (non-inferior at 0.01, not worse than 0); bf16 nearest +0.1 (costs
  # loss); MX SR with noclip scales, +0.009 with a wide spread (not
  # non-inferior). At 20 steps: float32 0.03 lower (not converged by
  # doubling); bf16 nearest +0.02 against fp32_2x (its cost shrank).
  # Training loss (mean of the last 10% of steps) set per arm; MX
  # saturates 3 weights a step.
  root = str(tmp_path)
  base = common.get_config().to_dict()
  base["study"].update(margin=0.01, new_arms=("mx_sr_noclip",), name="fc")
  spread = np.array([-3, -2, -1, 0, 0, 1, 2, 3], float)
  fp32 = 2.0 + 0.01 * spread
  arms = {
    "fp32": ({}, 10, 0 * spread, 0.0),
    "bf16_sr": (
      {"writeback": "bfloat16", "rounding": "stochastic"},
      10,
      0.002 + 0.002 * spread,
      0.001,
    ),
    "bf16_rn": ({"writeback": "bfloat16"}, 10, 0.1 + 0.001 * spread, 0.2),
    "mx_sr_noclip": (
      {"writeback": "mxfp8_e4m3", "rounding": "stochastic"}
      | {"writeback_rule": "noclip"},
      10,
      0.009 + 0.01 * spread,
      0.0,
    ),
    "fp32_2x": ({}, 20, -0.03 + 0.001 * spread, -0.1),
    "bf16_rn_2x": ({"writeback": "bfloat16"}, 20, 0.02 + 0.001 * spread, 0.1),
  }
  for arm, (lp, steps, diffs, tdiff) in arms.items():
    config = json.loads(json.dumps(base))
    config["lowprec"].update(lp)
    config["train"]["steps"] = steps
    sat = 3 if arm.startswith("mx") else None
    for s in range(8):
      # the 2x arms pair with fp32_2x: their val is fp32_2x's plus diff
      ref = fp32[s] + (arms["fp32_2x"][2][s] if arm == "bf16_rn_2x" else 0)
      _write(root, arm, s, config, ref + diffs[s], 3.0 + tdiff, steps, sat)
  runs = tables.load_runs(root, "fc")
  rows, lines = tables.ANALYSES["frontier_confirm"](runs)
  by = {r["arm"]: r for r in rows}
  assert by["bf16_sr"]["loss_vs_fp32"] == pytest.approx(0.002)
  assert by["bf16_sr"]["non_inferior"] == "yes"
  assert by["bf16_sr"]["costs_loss"] == ""
  assert by["bf16_rn"]["non_inferior"] == "no"
  assert by["bf16_rn"]["costs_loss"] == "yes"
  assert by["mx_sr_noclip"]["non_inferior"] == "no"
  assert by["mx_sr_noclip"]["scale_rule"] == "noclip"
  assert by["mx_sr_noclip"]["design"] == "added"
  assert by["mx_sr_noclip"]["saturated_per_run"] == 30
  assert by["bf16_sr"]["write_back"] == "stochastic"
  assert by["bf16_sr"]["train_loss_vs_fp32"] == pytest.approx(0.001)
  # Holm over 3 arms at the first horizon: bf16_sr has the smallest p,
  # so its bound is at 0.05 / 3
  want = np.mean(0.002 + 0.002 * spread) + (
    __import__("scipy").stats.t.ppf(1 - 0.05 / 3, 7)
    * np.std(0.002 * spread, ddof=1)
    / math.sqrt(8)
  )
  assert by["bf16_sr"]["holm_upper"] == pytest.approx(want)
  # the long family pairs with fp32_2x: bf16_rn_2x is +0.02 there
  assert by["bf16_rn_2x"]["loss_vs_fp32"] == pytest.approx(0.02)
  text = "\n".join(lines)
  assert "3 arms against float32 at the first horizon and 1 at twice it" in text
  assert "-0.0300" in text and "NOT converged by the doubling criterion" in text
  assert "- bf16_rn: +0.1000" in text and "+0.0200" in text
  assert "change -0.0800" in text and ": shrank" in text
  assert "mx_sr_noclip (noclip): 30 weights saturated per run" in text
  png = figures.plot("fc", root, figure="frontier_confirm")
  assert os.path.getsize(png) > 1000

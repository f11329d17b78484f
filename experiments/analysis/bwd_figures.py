"""Figures of the backward-state studies (PNG).

`FIGURES` names each figure a study can declare:

  operator_z            |z| of every value of every use, by prediction
                        (biased / exact or unbiased), with the threshold;
  attention_curves      per arm and seed: relative bias of the attention
                        QKV gradient (running mean of the probe's bias2,
                        square root), its cosine with the reference,
                        validation loss;
  norm_store_curves     relative error of the gain gradients and of the
                        norm-fed weight gradients vs step, and validation
                        loss with per_use's margin band;
  search_dose_response  per setting, each arm's pooled QKV bias and reuse
                        minus each copy's final validation loss.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.analysis import bwd_tables as ba  # noqa: E402
from experiments.analysis import plotting  # noqa: E402
from experiments.analysis.runs import load_runs  # noqa: E402

COLORS = {"reuse": "C3", "redraw": "C0", "outonly": "C2", "per_use": "C0"}
Z_BIASED = 3.0  # |z| of the pooled bias test drawn as biased
COLORS.update({"original_both": "C1", "rounded_both": "C3"})


def _save(fig, study, results, out) -> str:
  out = out or os.path.join(results, study, "tables")
  return plotting.save(fig, os.path.join(out, f"{study}.png"))


def _legend(ax):
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)


def _color(arm, i):
  return COLORS.get(arm, f"C{i % 10}")


def _style(arm, i, points):
  """The arm's colour, with a line style and markers of its own (arms with
  the same curve, e.g. two exact policies, still show as two lines)."""
  return {**plotting.arm_style(i, points), "color": _color(arm, i)}


def _arms(runs):
  return list(dict.fromkeys(r.arm for r in sorted(runs, key=lambda r: r.arm)))


def operator_z(study, results="results", out=None) -> str:
  """|z| of every value of every use, by prediction (first seed)."""
  runs = [r for r in load_runs(results, study) if r.summary.get("values")]
  if not runs:
    raise ValueError(f"{study} has no finished operator checks")
  run = min(runs, key=lambda r: r.seed)
  cells = run.summary["values"]
  keys = list(dict.fromkeys((x["op"], x["use"]) for x in cells))
  z_th = run.config["checks"]["z_threshold"]
  lo, hi = 0.1, 1e4
  fig, ax = plt.subplots(figsize=(10, 5))
  jitter = np.random.default_rng(0)
  for i, key in enumerate(keys):
    for x in (x for x in cells if (x["op"], x["use"]) == key):
      biased = x["predicted"] == "biased"
      z = lo if x.get("exact") else min(max(abs(float(x["z"])), lo), hi)
      ax.scatter(
        i + (0.15 if biased else -0.15) + jitter.normal(0, 0.04),
        z,
        marker="x" if x.get("exact") else ("o" if biased else "s"),
        color="C3" if biased else "C0",
        s=22,
      )
      if not x["agrees"]:
        ax.scatter(i, z, marker="o", s=120, facecolor="none", edgecolor="k")
  ax.axhline(z_th, color="k", lw=0.8, ls="--")
  ax.set_yscale("log")
  ax.set_ylim(lo / 2, hi * 30)
  ax.set_xticks(range(len(keys)), [f"{u}\n{o}" for o, u in keys], rotation=60)
  ax.set_ylabel(f"|z| (clipped to [{lo:g}, {hi:g}])")
  ax.scatter([], [], marker="o", color="C3", label="predicted biased")
  ax.scatter([], [], marker="s", color="C0", label="predicted unbiased")
  ax.scatter([], [], marker="x", color="C0", label="exact (zero difference)")
  ax.plot([], [], "k--", lw=0.8, label=f"|z| = {z_th:g}")
  ax.legend(fontsize=8, loc="upper center", ncol=4)
  n = run.summary["rows"][0]["n_forward"]
  ax.set_title(
    f"every value of every use: verified |z|, {n} forward draws (seed "
    f"{run.seed}); circled: prediction != verification"
  )
  return _save(fig, study, results, out)


def _running_rms(steps, b2, window=5):
  """sqrt(max(0, running mean of bias2)) over `window` probes."""
  k = np.ones(window) / window
  m = np.convolve(b2, k, mode="valid")
  return steps[window - 1 :], np.sqrt(np.maximum(m, 0.0))


def attention_curves(study, results="results", out=None) -> str:
  runs = load_runs(results, study)
  group = ba.probe_groups(runs[0])[0]
  fig, grid = plt.subplots(2, 2, figsize=(9, 7))
  axes = list(grid.flat)
  for i, arm in enumerate(_arms(runs)):
    for j, run in enumerate(r for r in runs if r.arm == arm):
      label = arm if j == 0 else None
      s, b2 = run.curve(f"probe/{group}/bias2")
      s, b2 = s[s >= 1], b2[s >= 1]
      if b2.size >= 5:
        x, y = _running_rms(s, b2)
        axes[0].plot(x, y, label=label, **_style(arm, i, len(x)))
      s, cos = run.curve(f"probe/{group}/cos")
      y = np.maximum(1 - cos, 1e-9)
      axes[1].plot(s, y, label=label, **_style(arm, i, len(s)))
      s, v = run.curve("val_loss")
      axes[2].plot(s, v, label=label, **_style(arm, i, len(s)))
  if not axes[0].lines:
    axes[0].text(
      0.5, 0.5, "fewer than 5 probes per run:\nno running mean",
      ha="center", va="center", transform=axes[0].transAxes,
    )  # fmt: skip
  axes[0].set_title(f"{group} gradient: relative bias (5-probe mean)")
  axes[1].set_title(f"{group} gradient: 1 - cos(mean g, mean g_ref)")
  axes[1].set_yscale("log")
  axes[2].set_title("validation loss")
  for ax in axes[:3]:
    ax.set_xlabel("step")
    _legend(ax)
  axes[3].set_visible(False)
  return _save(fig, study, results, out)


def search_dose_response(study, results="results", out=None) -> str:
  """attention_reuse_search: per setting, the pooled QKV bias of each arm
  (log scale), and per seed the final validation loss of reuse minus each
  copy with its failure threshold (3 sd of the copy over seeds)."""
  runs = load_runs(results, study)
  rows, _ = ba.attention_search_table(runs)
  names = [r["setting"] for r in rows]
  x = np.arange(len(names))
  fig, axes = plt.subplots(2, 1, figsize=(8, 7.5))
  offsets = dict(zip(ba.SEARCH_ARMS, (-0.15, 0.0, 0.15), strict=True))
  for kind, dx in offsets.items():
    color = COLORS[kind]
    for xi, r in zip(x, rows, strict=True):
      b, z = r.get(f"{kind}_qkv_bias_rms"), r.get(f"{kind}_qkv_bias_z")
      if not b:
        continue
      biased = z is not None and abs(z) >= Z_BIASED
      axes[0].plot(
        xi + dx, b, "o", color=color, mfc=color if biased else "none"
      )
    axes[0].plot([], [], "o", color=color, mfc="none", label=kind)
  axes[0].plot([], [], "o", color="grey", label=f"filled: |z| >= {Z_BIASED:g}")
  axes[0].set_yscale("log")
  axes[0].set_title("QKV gradient: pooled relative bias (z in the table)")
  for copy, dx in (("redraw", -0.1), ("outonly", 0.1)):
    key = f"reuse_minus_{copy}"
    color = COLORS[copy]
    for i, (xi, r) in enumerate(zip(x, rows, strict=True)):
      per = r.get(f"{key}_per_seed") or ""
      diffs = [float(d) for d in per.split()]
      label = f"reuse - {copy}" if i == 0 else None
      axes[1].plot(
        [xi + dx] * len(diffs), diffs, "o", color=color, mfc="none",
        label=label,
      )  # fmt: skip
      if r.get(key) is not None:
        axes[1].plot(xi + dx, r[key], "_", color="k", ms=12)
      if r.get(f"{key}_threshold") is not None:
        axes[1].plot(xi + dx, r[f"{key}_threshold"], "v", color=color, ms=5)
  axes[1].axhline(0, color="grey", lw=0.5)
  axes[1].plot([], [], "_", color="k", ms=12, label="mean over seeds")
  axes[1].plot([], [], "v", color="grey", ms=5, label="3 sd of the copy")
  axes[1].set_title("final val loss, reuse minus copy, per seed")
  axes[1].set_ylabel("nats")
  for ax in axes:
    ax.set_xticks(x, names)
    ax.set_xlabel("setting")
    plotting.legend_outside(ax)
  return _save(fig, study, results, out)


def norm_store_curves(study, results="results", out=None) -> str:
  runs = load_runs(results, study)
  groups = ba.probe_groups(runs[0])
  n = len(groups) + 1
  ncol = min(n, 2)
  fig, grid = plt.subplots(
    -(-n // ncol), ncol, figsize=(4.6 * ncol, 3.8 * -(-n // ncol)),
    squeeze=False,
  )  # fmt: skip
  axes = list(grid.flat)
  for ax in axes[n:]:
    ax.set_visible(False)
  titles = {"gain": "gain gradients", "w": "weight gradients fed by a norm"}
  arms = _arms(runs)
  floor = 1e-6
  for i, arm in enumerate(arms):
    for j, run in enumerate(r for r in runs if r.arm == arm):
      label = arm if j == 0 else None
      for ax, g in zip(axes, groups, strict=False):
        s, e = run.curve(f"probe/{g}/rel_err")
        y = np.maximum(e, floor)
        ax.plot(s, y, label=label, **_style(arm, i, len(s)))
  for ax, g in zip(axes, groups, strict=False):
    ax.set_yscale("log")
    ax.set_title(
      f"{titles.get(g, g)}: relative error\n(exactly 0 drawn at {floor:g})"
    )
    ax.set_xlabel("step")
    _legend(ax)
  # The planned comparison: final validation loss minus per_use's, per seed.
  ax = axes[n - 1]
  margin = runs[0].config["study"].get("loss_margin")
  base = {r.seed: r.last("val_loss") for r in runs if r.arm == "per_use"}
  others = [a for a in arms if a != "per_use"]
  for i, arm in enumerate(others):
    d = [
      r.last("val_loss") - base[r.seed]
      for r in runs
      if r.arm == arm and r.seed in base
    ]
    ax.scatter([i] * len(d), d, color=_color(arm, arms.index(arm)), zorder=3)
  if margin is not None:
    ax.axhspan(-margin, margin, color="0.88", label=f"margin ±{margin:g}")
  ax.axhline(0, color="k", lw=0.6)
  ax.set_xticks(range(len(others)), others)
  ax.set_xlim(-0.6, len(others) - 0.4)
  ax.set_title("final val loss minus per_use (per seed)")
  ax.set_ylabel("nats")
  _legend(ax)
  return _save(fig, study, results, out)


# figure name (a study's `study.figure`) -> (study, results, out) -> PNG path
FIGURES = {
  "operator_z": operator_z,
  "attention_curves": attention_curves,
  "norm_store_curves": norm_store_curves,
  "search_dose_response": search_dose_response,
}

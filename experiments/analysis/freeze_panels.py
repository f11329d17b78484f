"""Erased fraction vs step, predicted and measured, crossings marked (PNG).

One row per low-precision run (up to 12): its measured erased fraction with
its reference arm's predicted curve, and beside it the validation loss of
both, where the freeze shows.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.analysis import plotting  # noqa: E402
from experiments.analysis.freeze_tables import (  # noqa: E402
  measured,
  predicted,
  reference_for,
)
from experiments.analysis.runs import load_runs  # noqa: E402
from lowprec import freeze  # noqa: E402


def plot(
  study: str,
  results: str = "results",
  out: str | None = None,
  theta: float = 0.5,
  max_panels: int = 12,
) -> str:
  """Draws `figure` for the study's runs; returns the path of the PNG."""
  fig = figure(load_runs(results, study), theta, max_panels)
  out = out or os.path.join(results, study, "tables")
  return plotting.save(fig, os.path.join(out, f"{study}.png"))


def figure(runs, theta: float = 0.5, max_panels: int = 12):
  """One row per low-precision run (up to `max_panels`): erased fraction,
  measured and predicted, with crossings marked; beside it the validation
  loss of the run and of its float32 reference."""
  low = [r for r in runs if r.config["lowprec"]["writeback"]][:max_panels]
  if not low:
    raise ValueError("no write-back runs to plot")
  fig, axes = plt.subplots(
    len(low), 2, figsize=(9.0, 3.2 * len(low)), squeeze=False
  )
  for (ax, lx), run in zip(axes, low, strict=True):
    fmt = run.config["lowprec"]["writeback"]
    rounding = run.config["lowprec"]["rounding"]
    nearest = rounding == "nearest"
    steps, e = measured(run)
    ref = reference_for(run, runs)
    if nearest:
      ax.plot(steps, e, lw=1, label="measured (nearest)")
      crossing = _mark(ax, e, steps, theta, "C0")
      if crossing is not None:
        lx.axvline(crossing, color="C0", lw=0.8, ls=":")
    else:  # a per-step share; every coordinate keeps a chance to move
      ax.plot(steps, e, lw=1, label=f"measured ({rounding}; not a freeze)")
    if ref is not None:
      ps, p = predicted(ref, fmt, rounding)
      if p.size and nearest:
        ax.plot(ps, p, lw=1, ls="--", color="C1", label="predicted (fp32)")
        _mark(ax, p, ps, theta, "C1")
      elif p.size:  # the trace predicts P(move) under stochastic rounding
        ax.plot(ps, 1 - p, lw=1, ls="--", color="C1", label="1 - P(move)")
      ref_style = {"ls": "--", "marker": "s", "mfc": "none", "ms": 5}
      _val_line(lx, ref, "C1", "fp32 reference", **ref_style)
    _val_line(lx, run, "C0", run.arm, marker=".")
    ax.axhline(theta, color="grey", lw=0.5)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{run.arm} seed{run.seed}: {fmt}, {rounding}", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("erased fraction")
    ax.legend(fontsize=8)
    plotting.loss_axes(lx)
    title = "validation loss" + (" (dotted: the crossing)" if nearest else "")
    lx.set_title(title, fontsize=10)
    lx.set_xlabel("step")
    lx.set_ylabel("validation loss")
    lx.legend(fontsize=8, loc="lower left")
  return fig


def _val_line(ax, run, color, label, **style) -> None:
  """Plots a run's validation loss (final value in the label)."""
  pts = [(r["step"], r["val_loss"]) for r in run.metrics if "val_loss" in r]
  if not pts:
    return
  s, v = (np.asarray(x, float) for x in zip(*pts, strict=True))
  ax.plot(s, v, lw=1, color=color, label=f"{label} ({v[-1]:.3f})", **style)
  return v


def _mark(ax, curve, steps, theta, color):
  step, _ = freeze.crossing(curve, theta, steps=steps)
  if step is not None:
    ax.axvline(step, color=color, lw=0.8, ls=":")
  return step

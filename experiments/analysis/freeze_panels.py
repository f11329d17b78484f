"""Erased fraction vs step, predicted and measured, crossings marked (PNG).

One panel per low-precision run (up to 12), its reference arm's predicted
curve beside its measured one, and the loss of both below.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
  runs = load_runs(results, study)
  low = [r for r in runs if r.config["lowprec"]["writeback"]][:max_panels]
  if not low:
    raise ValueError(f"{study} has no write-back runs to plot")
  cols = min(3, len(low))
  rows = -(-len(low) // cols)
  fig, axes = plt.subplots(
    2 * rows, cols, figsize=(4.2 * cols, 4.4 * rows), squeeze=False
  )
  for i, run in enumerate(low):
    ax = axes[2 * (i // cols)][i % cols]
    lx = axes[2 * (i // cols) + 1][i % cols]
    fmt = run.config["lowprec"]["writeback"]
    rounding = run.config["lowprec"]["rounding"]
    steps, e = measured(run)
    ax.plot(steps, e, lw=1, label=f"measured ({rounding})")
    _mark(ax, e, steps, theta, "C0")
    ref = reference_for(run, runs)
    if ref is not None:
      ps, p = predicted(ref, fmt)
      if p.size:
        ax.plot(ps, p, lw=1, ls="--", color="C1", label="predicted (fp32)")
        _mark(ax, p, ps, theta, "C1")
      s, loss = ref.curve("loss")
      lx.plot(s, loss, lw=0.8, color="C1", label="fp32 reference")
    s, loss = run.curve("loss")
    lx.plot(s, loss, lw=0.8, color="C0", label=run.arm)
    ax.axhline(theta, color="grey", lw=0.5)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{run.arm} seed{run.seed}: {fmt}", fontsize=9)
    ax.set_ylabel("erased fraction")
    ax.legend(fontsize=7)
    lx.set_xlabel("step")
    lx.set_ylabel("train loss")
    lx.legend(fontsize=7)
  for j in range(len(low), rows * cols):
    axes[2 * (j // cols)][j % cols].axis("off")
    axes[2 * (j // cols) + 1][j % cols].axis("off")
  fig.tight_layout()
  out = out or os.path.join(results, study, "tables")
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"{study}.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _mark(ax, curve, steps, theta, color):
  step, _ = freeze.crossing(curve, theta, steps=steps)
  if step is not None:
    ax.axvline(step, color=color, lw=0.8, ls=":")

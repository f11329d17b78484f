"""Study tables from result files: Markdown and CSV.

  python scripts/make_tables.py <study> [--results results] [--out DIR]

Reads `results/<study>/<arm>/seed<k>/{config.json,metrics.jsonl,summary.json}`
(never the code's internals) and writes `<out>/<study>.md` and
`<out>/<study>.csv` (default out: `results/<study>/tables`). Each study
names its analysis in `ANALYSES`; the default is the freeze analysis.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowprec import freeze  # noqa: E402


class Run:
  """One `results/<study>/<arm>/seed<k>` directory, read lazily."""

  def __init__(self, path: str):
    self.path = path
    self.arm = os.path.basename(os.path.dirname(path))
    self.seed = int(os.path.basename(path)[len("seed") :])
    with open(os.path.join(path, "config.json")) as f:
      self.config = json.load(f)
    self._metrics = None

  @property
  def metrics(self) -> list[dict]:
    if self._metrics is None:
      self._metrics = []
      with open(os.path.join(self.path, "metrics.jsonl")) as f:
        for line in f:
          try:
            self._metrics.append(json.loads(line))
          except json.JSONDecodeError:
            break
    return self._metrics

  @property
  def summary(self) -> dict:
    p = os.path.join(self.path, "summary.json")
    if not os.path.exists(p):
      return {}
    with open(p) as f:
      return json.load(f)

  def curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a per-step metric (steps >= 1 that have it)."""
    rows = [
      (r["step"], r[key])
      for r in self.metrics
      if r.get("step", 0) >= 1 and key in r
    ]
    if not rows:
      return np.zeros(0, int), np.zeros(0)
    steps, vals = zip(*rows, strict=True)
    return np.asarray(steps), np.asarray(vals, float)

  def last(self, key: str):
    for r in reversed(self.metrics):
      if key in r:
        return r[key]
    return None


def load_runs(results: str, study: str) -> list[Run]:
  paths = sorted(glob.glob(os.path.join(results, study, "*", "seed*")))
  runs = [
    Run(p) for p in paths if os.path.exists(os.path.join(p, "config.json"))
  ]
  if not runs:
    raise FileNotFoundError(
      f"no runs under {os.path.join(results, study)}; run "
      f"`python -m experiments.run --config configs/{study}.py` first"
    )
  return runs


def reference_for(run: Run, runs: list[Run]) -> Run | None:
  """The run of `study.reference_arm`: same seed if there, else the first."""
  arm = run.config["study"].get("reference_arm", "")
  if not arm:
    return None
  cands = [r for r in runs if r.arm == arm]
  same = [r for r in cands if r.seed == run.seed]
  return (same or cands or [None])[0]


def _fmt_step(step, cat) -> str:
  return "never" if step is None else f"{step} ({cat})"


def freeze_table(runs: list[Run], theta: float = 0.5, tol: float = 0.15):
  """Predicted vs measured crossing for every write-back run.

  Returns (rows, summary_lines): one row per low-precision run with the
  predicted curve taken from its reference arm's trace for the same format.
  """
  rows, cells = [], {}
  for run in runs:
    lp = run.config["lowprec"]
    if not lp["writeback"]:
      continue
    fmt, rounding = lp["writeback"], lp["rounding"]
    steps, measured = run.curve("erased_fraction")
    ref = reference_for(run, runs)
    row = {
      "arm": run.arm,
      "cell": run.config["study"].get("cell") or run.arm,
      "seed": run.seed,
      "format": fmt,
      "rounding": rounding,
      "final_val_loss": run.last("val_loss"),
      "reference_val_loss": ref.last("val_loss") if ref else None,
    }
    m_step, m_cat = freeze.crossing(measured, theta, steps=steps)
    row["measured_crossing"] = _fmt_step(m_step, m_cat)
    pred = None
    if ref is not None:
      p_steps, pred = ref.curve(f"pred/{fmt}/erased_fraction")
      if pred.size == 0:
        pred = None
    if pred is not None and rounding == "nearest":
      n = min(len(pred), len(measured))
      c = freeze.compare(
        pred[:n], measured[:n], theta=theta, tol=tol, steps=steps[:n]
      )
      row.update(
        predicted_crossing=_fmt_step(c.predicted_step, c.predicted_category),
        error_steps=c.error_steps,
        relative_error=c.relative_error,
        within_tol=c.within_tol,
        category_agrees=c.category_agrees,
        rmse=c.rmse,
      )
      cells[f"{row['cell']}/seed{run.seed}"] = (pred[:n], measured[:n])
    elif rounding != "nearest":
      # No persistent freeze is predicted; compare the per-step probability
      # that a proposal moves its coordinate, predicted vs measured.
      row["predicted_crossing"] = "none (stochastic)"
      suffix = {"stochastic": "_sr", "deadzone": "_dzsr"}[rounding]
      _, moved = run.curve("moved")
      _, props = run.curve("proposals")
      row["measured_move_prob"] = float(np.mean(moved / np.maximum(props, 1)))
      if ref is not None:
        _, mp = ref.curve(f"pred/{fmt}{suffix}/move_prob")
        if mp.size:
          row["predicted_move_prob"] = float(np.nanmean(mp))
    rows.append(row)
  lines = []
  if cells:
    s = freeze.summarize(cells, theta=theta, tol=tol)
    lines += [
      f"- post-init crossings within {tol:.0%}: {s.within_tol}",
      f"- cells whose categories differ: {s.category_disagree}",
      f"- macro RMSE of predicted vs measured erased fraction: "
      f"{s.macro_rmse:.5f}",
    ]
    if s.skill is not None and np.isfinite(s.skill):
      lines.append(
        f"- skill vs leave-one-out average measured curve: {s.skill:.3f}"
      )
    lines.append(
      f"- category confusion (rows measured, columns predicted, order "
      f"{', '.join(freeze.CATEGORIES)}): {np.asarray(s.confusion).tolist()}"
    )
  return rows, lines


ANALYSES = {
  "freeze": freeze_table,
}
STUDY_ANALYSIS = {}  # study name -> analysis name (default "freeze")


def to_markdown(title: str, rows: list[dict], lines: list[str]) -> str:
  if not rows:
    return f"## {title}\n\n(no rows)\n"
  cols = list(dict.fromkeys(k for r in rows for k in r))
  out = [
    f"## {title}",
    "",
    "| " + " | ".join(cols) + " |",
    "|" + "---|" * len(cols),
  ]
  for r in rows:
    out.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
  if lines:
    out += ["", *lines]
  return "\n".join(out) + "\n"


def _cell(v) -> str:
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def write_csv(path: str, rows: list[dict]) -> None:
  cols = list(dict.fromkeys(k for r in rows for k in r))
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)


def make(study: str, results: str = "results", out: str | None = None) -> str:
  """Writes the study's Markdown and CSV tables; returns the Markdown."""
  runs = load_runs(results, study)
  analysis = ANALYSES[STUDY_ANALYSIS.get(study, "freeze")]
  rows, lines = analysis(runs)
  out = out or os.path.join(results, study, "tables")
  os.makedirs(out, exist_ok=True)
  md = to_markdown(study, rows, lines)
  with open(os.path.join(out, f"{study}.md"), "w") as f:
    f.write(md)
  write_csv(os.path.join(out, f"{study}.csv"), rows)
  return md


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("study")
  ap.add_argument("--results", default="results")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  print(make(args.study, args.results, args.out))


if __name__ == "__main__":
  main()

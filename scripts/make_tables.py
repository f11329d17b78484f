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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bwd_analyses  # noqa: E402
from freeze_analyses import (  # noqa: E402
  audit_table,
  fp8_table,
  freeze_table,
  grid_table,
  recovery_table,
  replay_table,
  transfer_table,
)


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


ANALYSES = {
  "freeze": freeze_table,
  "grid": grid_table,
  "transfer": transfer_table,
  "fp8": fp8_table,
  "audit": audit_table,
  "recovery": recovery_table,
  "replay": replay_table,
  **bwd_analyses.ANALYSES,
}
STUDY_ANALYSIS = {  # study name -> analysis name (default "freeze")
  "freeze_gpt2_fp8": "fp8",
  "freeze_grid": "grid",
  "freeze_transfer": "transfer",
  "deadzone_vs_sr": "recovery",
  "int3_replay": "replay",
  "e4m3_audit": "audit",
  **bwd_analyses.STUDY_ANALYSIS,
}


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

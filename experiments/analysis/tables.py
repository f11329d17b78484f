"""Study tables from result files: Markdown and CSV.

`make(study)` reads `results/<study>/<arm>/seed<k>/` (see `runs`) and writes
`<out>/<study>.md` and `<out>/<study>.csv` (default out:
`results/<study>/tables`). Each study names its analysis in
`STUDY_ANALYSIS`; the default is the freeze analysis. Command line:
`python -m scripts.make_tables <study>`.
"""

from __future__ import annotations

import csv
import os

from experiments.analysis import bwd_tables
from experiments.analysis.freeze_tables import (
  audit_table,
  fp8_table,
  freeze_table,
  grid_table,
  recovery_table,
  replay_table,
  transfer_table,
)
from experiments.analysis.runs import load_runs

ANALYSES = {
  "freeze": freeze_table,
  "grid": grid_table,
  "transfer": transfer_table,
  "fp8": fp8_table,
  "audit": audit_table,
  "recovery": recovery_table,
  "replay": replay_table,
  **bwd_tables.ANALYSES,
}
STUDY_ANALYSIS = {  # study name -> analysis name (default "freeze")
  "freeze_gpt2_fp8": "fp8",
  "freeze_grid": "grid",
  "freeze_transfer": "transfer",
  "deadzone_vs_sr": "recovery",
  "int3_replay": "replay",
  "e4m3_audit": "audit",
  **bwd_tables.STUDY_ANALYSIS,
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

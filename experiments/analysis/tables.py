"""Study tables from result files: Markdown and CSV.

`make(study)` reads `results/<study>/<arm>/seed<k>/` (see `runs`) and writes
`<out>/<study>.md` and `<out>/<study>.csv` (default out:
`results/<study>/tables`). Each study names its analysis in its config
(`study.analysis`, a key of `ANALYSES`), which every run's config.json
carries. Command line:
`python -m scripts.make_tables <study>`.
"""

from __future__ import annotations

import csv
import os
import re

from experiments.analysis import bwd_tables, frontier, frontier_confirm
from experiments.analysis.audit_tables import audit_table
from experiments.analysis.freeze_tables import (
  fp8_table,
  freeze_table,
  grid_table,
  transfer_table,
)
from experiments.analysis.runs import declared, load_runs
from experiments.analysis.state_tables import state_table
from experiments.analysis.user_reports import user_reports_table
from experiments.analysis.writeback_tables import (
  recovery_table,
  remedies_table,
  replay_table,
)
from lowprec.grids import choices as names

ANALYSES = {
  "freeze": freeze_table,
  "grid": grid_table,
  "transfer": transfer_table,
  "fp8": fp8_table,
  "audit": audit_table,
  "recovery": recovery_table,
  "remedies": remedies_table,
  "replay": replay_table,
  "user_reports": user_reports_table,
  "state": state_table,
  "frontier": frontier.frontier_table,
  "frontier_confirm": frontier_confirm.confirm_table,
  **bwd_tables.ANALYSES,
}


# Column headings of the Markdown tables (the CSV keeps the row keys).
HEADINGS = {
  "format": "format",
  "state": "stored state",
  "state_erased_2nd_half": "state erased, 2nd half",
  "state_flushed_last": "state flushed, last step",
  "rounding": "write-back",
  "final_val_loss": "final val loss",
  "reference_val_loss": "fp32 val loss",
  "predicted_crossing": "predicted crossing",
  "measured_crossing": "measured crossing",
  "error_steps": "error (steps)",
  "relative_error": "relative error",
  "within_tol": "within 15%",
  "category_agrees": "categories agree",
  "rmse": "curve RMSE",
  "naive_rmse": "naive RMSE",
  "matched_rmse": "matched-reference RMSE",
  "noise_floor": "noise floor (fp32 seeds' traces)",
  "source_specificity_corr": "specificity corr., source",
  "matched_specificity_corr": "specificity corr., matched",
  "matched_val_loss": "fp32 val loss, same seed",
  "batch_size": "batch",
  "reference_seed": "trace seed",
  "measured_move_prob": "move prob., measured",
  "predicted_move_prob": "move prob., predicted",
  "lr": "learning rate",
  "second_half_change": "val loss change, 2nd half",
  "predicted_mean_erased": "mean not moved, predicted",
  "measured_mean_erased": "mean not moved, measured",
  "frozen_whole_run": "sampled coords never moved",
  "frozen_second_half": "not moved in 2nd half",
  "fp32_at_checkpoint": "fp32 val loss there",
  "after_quantizing": "after the int grid",
  "start_over_uniform": "start / ln V",
  "stochastic_final": "SR: final val loss",
  "stochastic_change": "SR: change (nats)",
  "stochastic_reduction": "SR: reduction",
  "nearest_final": "RN: final val loss",
  "nearest_change": "RN: change (nats)",
  "nearest_reduction": "RN: reduction",
  "sr_minus_rn": "SR - RN (nats)",
  "sr_minus_rn_rel": "SR - RN (of the start)",
  "fp32_same_data_step": "fp32 at the same data step",
  "val_loss_fp32": "L fp32",
  "val_loss_nearest": "L nearest",
  "val_loss_stochastic": "L full SR",
  "val_loss_deadzone": "L dead-zone SR",
  "rn_gap": "nearest gap",
  "recovery_full_sr": "recovery, full SR",
  "recovery_deadzone_sr": "recovery, dead-zone SR",
  "deadzone_minus_full_sr": "dead-zone - full SR",
  "train_loss_last10%": "train loss, last 10%",
  "within_margin": "within the margin",
  "at_init_predicted": "predicted (fp32 trace)",
  "at_init_nearest": "nearest",
  "at_init_stochastic": "stochastic",
  "at_init_deadzone": "dead-zone",
  "error": "|predicted - nearest|",
  "per_seed": "per seed",
  "fails": "fails",
  "pred_erased_mean": "erased, predicted",
  "erased_mean": "erased, measured",
  "erased_rmse": "erased, curve RMSE",
  "pred_lost_mean": "lost, predicted",
  "lost_mean": "lost, measured",
  "lost_rmse": "lost, curve RMSE",
  "bytes_per_param": "bytes / param",
  "steps_per_s": "steps / s",
  "step_time_vs_nearest": "step time / nearest's",
  "erased_fraction": "erased, last step",
  "carried": "carried mass, last step",
  "recovery": "recovery of the nearest gap",
  "loss_vs_fp32": "loss - fp32's (nats)",
  "half_width_95": "95% half-width",
  "pred_erased": "erased, predicted",
  "erased": "erased, measured",
  "pred_lost": "lost, predicted",
  "lost": "lost, measured",
  "pred_nu_stalled": "nu stalled, predicted",
  "nu_stalled": "nu stalled, measured",
  "on_front": "on the front",
  "write_back": "write-back",
  "scale_rule": "scale rule",
  "train_loss_vs_fp32": "train loss - fp32's",
  "train_half_width_95": "95% half-width (train)",
  "holm_upper": "Holm upper bound",
  "non_inferior": "non-inferior at the margin",
  "holm_lower": "Holm lower bound",
  "costs_loss": "costs loss (Holm)",
  "saturated_per_run": "weights saturated per run",
  "design": "against the first design",
}
# attention_reuse_search: per arm, and per contrast `a_minus_b`.
_SEARCH = (
  (r"(\w+)_minus_(\w+)_per_seed", "{0} - {1}, per seed"),
  (r"(\w+)_minus_(\w+)_threshold", "{0} - {1}, threshold (3 sd of {1})"),
  (r"(\w+)_minus_(\w+)_fails", "{0} vs {1} fails"),
  (r"(reuse|redraw|outonly)_minus_(\w+)", "{0} - {1}"),
  (r"(\w+)_qkv_bias_rms", "{0}: QKV bias"),
  (r"(\w+)_qkv_bias_z", "{0}: z"),
  (r"(reuse|redraw|outonly)_val_loss", "{0}: val loss"),
  (r"(reuse|redraw|outonly)_sd", "{0}: sd"),
)
# Per moment `m` of a stored optimizer state (state_precision).
_MOMENT = (
  (r"(mu|nu)_erased_2nd_half", "{0} updates erased, 2nd half"),
  (r"(mu|nu)_predicted_2nd_half", "{0} updates erased, 2nd half, predicted"),
  (r"(mu|nu)_stalled_2nd_half", "{0} updates stalled, 2nd half"),
  (
    r"(mu|nu)_stalled_predicted_2nd_half",
    "{0} updates stalled, 2nd half, predicted",
  ),
)
# Per probe group `g`: `g_<suffix>` -> "g: <words>".
_PROBE = {
  "1-cos": "1 - cos",
  "norm_ratio": "norm ratio",
  "rel_err": "rel. error, mean",
  "last_rel_err": "rel. error, last",
  "bias_rms": "bias (rms)",
  "bias_z": "bias z",
}
# Shown in other columns of the same row (`cell` is arm, or width/lr/...).
_HIDDEN = ("cell",)


def _name(name: str) -> str:
  """An arm or group name inside a heading: as code when it is an
  identifier with an underscore (`per_use`), so that it reads as a name."""
  return f"`{name}`" if "_" in name else name


def heading(key: str) -> str:
  """The Markdown column heading of a row key, in words: names of arms and
  probe groups that hold an underscore appear as code, and a key no rule
  knows has its underscores turned into spaces."""
  if key in HEADINGS:
    return HEADINGS[key]
  m = re.fullmatch(r"val_loss@(\d+)", key)
  if m:
    return f"val loss at step {m.group(1)}"
  m = re.fullmatch(r"after_(\d+)_steps", key)
  if m:
    return f"after {m.group(1)} steps"
  m = re.fullmatch(r"val_minus_(\w+)", key)
  if m:
    return f"val loss minus {_name(m.group(1))}"
  for pattern, words in _SEARCH + _MOMENT:
    m = re.fullmatch(pattern, key)
    if m:
      return words.format(*map(_name, m.groups()))
  for suffix in sorted(_PROBE, key=len, reverse=True):  # last_rel_err first
    if key.endswith("_" + suffix):
      return f"{_name(key[: -len(suffix) - 1])}: {_PROBE[suffix]}"
  return key.replace("_", " ")


def to_markdown(title: str, rows: list[dict], lines: list[str]) -> str:
  """A Markdown table of the rows (headings in words), then the lines."""
  if not rows:
    return f"## {title}\n\n(no rows)\n"
  cols = [
    k for k in dict.fromkeys(k for r in rows for k in r) if k not in _HIDDEN
  ]
  out = [
    f"## {title}",
    "",
    "| " + " | ".join(_escape(heading(c)) for c in cols) + " |",
    "|" + "---|" * len(cols),
  ]
  for r in rows:
    out.append("| " + " | ".join(_escape(_cell(r.get(c))) for c in cols) + " |")
  if lines:
    out += ["", *lines]
  return "\n".join(out) + "\n"


def _escape(text: str) -> str:
  """A cell's `|` as `\\|`, which Markdown tables read as text."""
  return text.replace("|", "\\|")


def _cell(v) -> str:
  if v is None:
    return ""
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def write_csv(path: str, rows: list[dict]) -> None:
  cols = list(dict.fromkeys(k for r in rows for k in r))
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)


def make(
  study: str,
  results: str = "results",
  out: str | None = None,
  analysis: str | None = None,
) -> str:
  """Writes the study's Markdown and CSV tables; returns the Markdown.

  The analysis is the one the study's config names (`study.analysis`, in
  each run's config.json), or `analysis`.
  """
  runs = load_runs(results, study)
  name = declared(runs, "analysis", analysis)
  names.check_choice("study.analysis", name, ANALYSES)
  analysis = ANALYSES[name]
  rows, lines = analysis(runs)
  out = out or os.path.join(results, study, "tables")
  os.makedirs(out, exist_ok=True)
  md = to_markdown(study, rows, lines)
  with open(os.path.join(out, f"{study}.md"), "w") as f:
    f.write(md)
  write_csv(os.path.join(out, f"{study}.csv"), rows)
  return md

"""One fp32 trace reused across unseen seeds (`e4m3_audit`): rows, lines.

Per variant of the study (a write-back arm, e.g. `rn_e4m3` at batch 16 and
`rn_e4m3_b64` at batch 64) and unseen seed `k`, with `e_k` the measured
erased fraction, `p` the source trace (the seed-0 fp32 run's prediction,
reused for every seed) and `p_k` the matched reference (seed `k`'s own fp32
run, same batch size, `matched_for`):

* RMSE of `p` (the predeclared source predictor) and of `p_k` (the
  privileged matched reference) against `e_k`; a naive flat baseline and
  the template of the other seeds' measured curves, as before;
* the noise floor: RMSE between `p` and `p_k`, two fp32 seeds' traces;
* directional specificity of both predictors (`freeze.
  directional_specificity`) and the share of the measured curves'
  variation that is common time (`freeze.common_time_share`).
"""

from __future__ import annotations

import numpy as np

from experiments.analysis.freeze_tables import (
  THETA,
  TOL,
  _freeze_rows,
  measured,
  predicted,
  reference_for,
)
from lowprec import freeze

PAPER = (
  "- the paper: macro RMSE 0.00858 (absolute-accuracy and skill gates "
  "passed), directional specificity failed, template 0.00360 vs source "
  "0.00438, 99.65% of variation common time, matched-reference "
  "correction 0.00283"
)


def matched_for(run, runs):
  """The matched reference of a write-back run: the float32 run with the
  same seed and batch size whose trace predicts the run's format (None if
  there is none)."""
  fmt = run.config["lowprec"]["writeback"]
  batch = _batch(run)
  for r in runs:
    lp = r.config["lowprec"]
    if (
      not lp["writeback"]
      and fmt in lp.get("trace_targets", ())
      and r.seed == run.seed
      and _batch(r) == batch
    ):
      return r
  return None


def _batch(run):
  return run.config.get("data", {}).get("batch_size")


def variants(runs) -> dict[str, list]:
  """{write-back arm: its runs} (nearest write-back runs only)."""
  out: dict[str, list] = {}
  for run in runs:
    lp = run.config["lowprec"]
    if lp["writeback"] and lp["rounding"] == "nearest":
      out.setdefault(run.arm, []).append(run)
  return {a: sorted(rs, key=lambda r: r.seed) for a, rs in out.items()}


def seed_curves(run, runs):
  """(e_k, source p, matched p_k or None), cut to a common length."""
  fmt = run.config["lowprec"]["writeback"]
  _, e = measured(run)
  _, p = predicted(reference_for(run, runs), fmt)
  m = matched_for(run, runs)
  pk = predicted(m, fmt)[1] if m is not None else None
  n = min(len(e), len(p), len(pk) if pk is not None else len(e))
  return e[:n], p[:n], (pk[:n] if pk is not None else None)


def _seed_row(run, runs, fr: dict, curves) -> dict:
  e, p, pk = curves
  ref, m = reference_for(run, runs), matched_for(run, runs)
  row = {
    "arm": run.arm,
    "seed": run.seed,
    "batch_size": _batch(run),
    "reference_seed": ref.seed if ref else None,
    "predicted_crossing": fr.get("predicted_crossing"),
    "measured_crossing": fr.get("measured_crossing"),
    "category_agrees": fr.get("category_agrees"),
    "rmse": freeze.rmse(p, e),
    "matched_rmse": freeze.rmse(pk, e) if pk is not None else None,
    "naive_rmse": freeze.rmse(np.full_like(p, np.nanmean(p)), e),
    "noise_floor": freeze.rmse(p, pk) if pk is not None else None,
    "final_val_loss": run.last("val_loss"),
    "reference_val_loss": ref.last("val_loss") if ref else None,
    "matched_val_loss": m.last("val_loss") if m else None,
  }
  return row


def audit_table(runs, theta: float = THETA, tol: float = TOL):
  """Per variant and unseen seed: crossings, RMSE of the source trace and
  of the matched reference, naive RMSE, the noise floor and both
  predictors' specificity correlations; per variant, the macro numbers,
  the directional-specificity verdicts and the common-time share; across
  variants, the noise floor and RMSEs side by side."""
  rows, lines, macro = [], [], {}
  for arm, group in variants(runs).items():
    r, ln, mac = _variant(arm, group, runs, theta, tol)
    rows += r
    lines += ln
    macro[arm] = mac
  if len(macro) > 1:
    lines += _compare_variants(macro)
  if rows:
    lines.append(PAPER)
  return rows, lines


def _variant(arm, group, runs, theta, tol):
  """Rows and lines of one write-back arm's unseen seeds."""
  fr_rows, _ = _freeze_rows(group + _references(group, runs), theta, tol)
  by_seed = {r["seed"]: r for r in fr_rows if r["arm"] == arm}
  curves = [seed_curves(run, runs) for run in group]
  rows = [
    _seed_row(run, runs, by_seed.get(run.seed, {}), c)
    for run, c in zip(group, curves, strict=True)
  ]
  n = min(len(c[0]) for c in curves)
  e = [c[0][:n] for c in curves]
  p = curves[0][1][:n]
  pk = (
    [c[2][:n] for c in curves]
    if all(c[2] is not None for c in curves)
    else None
  )
  spec = {}
  if len(group) > 1:
    spec["source"] = freeze.directional_specificity(p, e)
    if pk is not None:
      spec["matched"] = freeze.directional_specificity(pk, e)
  for key, s in spec.items():
    for row, r in zip(rows, s.correlations, strict=True):
      row[f"{key}_specificity_corr"] = r
  share = freeze.common_time_share(e) if len(group) > 1 else None
  cells = {str(r.seed): (p, x) for r, x in zip(group, e, strict=True)}
  summ = freeze.summarize(cells, theta=theta, tol=tol)
  mac = _macro(rows, summ, share)
  return rows, _variant_lines(arm, rows, mac, spec), mac


def _references(group, runs) -> list:
  """The source trace's run of a group (for the crossing columns)."""
  refs = {reference_for(r, runs) for r in group}
  return [r for r in refs if r is not None]


def _mean(rows, key):
  xs = [r[key] for r in rows if r.get(key) is not None]
  return float(np.mean(xs)) if xs else None


def _macro(rows, summ, share) -> dict:
  return {
    "batch_size": rows[0]["batch_size"],
    "reference_seed": rows[0]["reference_seed"],
    "n": len(rows),
    "rmse": _mean(rows, "rmse"),
    "matched_rmse": _mean(rows, "matched_rmse"),
    "naive_rmse": _mean(rows, "naive_rmse"),
    "noise_floor": _mean(rows, "noise_floor"),
    "template_rmse": summ.baseline_rmse,
    "agree": len(rows) - summ.n_category_disagree,
    "share": share,
  }


def _f(x, spec: str = ".5f") -> str:
  return "n/a" if x is None or not np.isfinite(x) else format(x, spec)


def _verdict(label: str, s) -> str:
  corrs = ", ".join(_f(r, "+.3f") for r in s.correlations)
  word = "passes" if s.specific else "fails"
  return f"    - {label}: corr {corrs}: {word}"


def _variant_lines(arm, rows, mac, spec) -> list[str]:
  n, seed = mac["n"], mac["reference_seed"]
  head = f"- {arm} (batch {mac['batch_size']}): "
  skill = "n/a (flat curves)"
  if mac["naive_rmse"]:
    skill = f"{1 - mac['rmse'] / mac['naive_rmse']:.3f}"
  floor = ", ".join(_f(r["noise_floor"]) for r in rows)
  lines = [
    head + f"macro RMSE, one fp32 trace (seed {seed}) vs {n} unseen seeds: "
    f"{_f(mac['rmse'])}",
    f"  - naive flat baseline (the trace's mean prediction): macro RMSE "
    f"{_f(mac['naive_rmse'])}; skill 1 - RMSE/RMSE_naive = {skill}",
    f"  - template (mean measured curve of the other seeds): macro RMSE "
    f"{_f(mac['template_rmse'])}",
    f"  - matched reference (each seed's own fp32 trace): macro RMSE "
    f"{_f(mac['matched_rmse'])}",
    f"  - noise floor, RMSE between the seed-{seed} trace and each unseen "
    f"seed's fp32 trace: {floor}; mean {_f(mac['noise_floor'])}",
    f"  - categories agree in {mac['agree']}/{n} seeds",
  ]
  if not spec:
    lines.append("  - directional specificity: n/a (needs two unseen seeds)")
    return lines
  lines.append(
    "  - directional specificity, corr_t(p_k - c, e_k - c) > 0 for every "
    "unseen seed k (c: the mean measured curve):"
  )
  names = {"source": "source trace (reused)", "matched": "matched references"}
  lines += [_verdict(names[k], s) for k, s in spec.items()]
  lines.append(
    f"  - share of the measured curves' variation that is common time: "
    f"{_f(mac['share'], '.2%')}"
  )
  return lines


def _compare_variants(macro: dict) -> list[str]:
  """Batch sizes side by side: noise floor, source and matched RMSE."""
  ms = list(macro.values())
  batches = " vs ".join(str(m["batch_size"]) for m in ms)
  out = [f"- batch {batches}:"]
  for key, label in (
    ("noise_floor", "noise floor (mean)"),
    ("rmse", "source-trace macro RMSE"),
    ("matched_rmse", "matched-reference macro RMSE"),
  ):
    out.append(f"  - {label}: " + " vs ".join(_f(m[key]) for m in ms))
  return out

"""Analyses of the freeze studies: result runs -> (rows, summary lines).

Each analysis takes the runs of one study (objects with `arm`, `seed`,
`config`, `curve(key)` and `last(key)`, as `runs.Run` reads them from the
result files) and returns table rows (dicts) and summary lines (Markdown
bullets). `tables.ANALYSES` names them.
"""

from __future__ import annotations

import numpy as np

import lowprec
from lowprec import freeze

THETA, TOL = 0.5, 0.15
SUFFIX = {"nearest": "", "stochastic": "_sr", "deadzone": "_dzsr"}


def reference_for(run, runs):
  """The run of `study.reference_arm`: same seed if there, else the first."""
  arm = run.config["study"].get("reference_arm", "")
  if not arm:
    return None
  cands = [r for r in runs if r.arm == arm]
  same = [r for r in cands if r.seed == run.seed]
  return (same or cands or [None])[0]


def measured(run, key: str = "erased_fraction"):
  """(steps, values) of a write-back count ratio; NaN at steps without
  proposals (e.g. a warmup step with lr 0), as the reference trace logs."""
  steps, values = run.curve(key)
  s_p, props = run.curve(_with_prefix("proposals", key))
  if s_p.size == steps.size and steps.size:
    values = np.where(props > 0, values, np.nan)
  return steps, values


def _with_prefix(count: str, key: str) -> str:
  """`proposals` for `erased_fraction`, `proposals/<leaf>` for a leaf."""
  _, sep, leaf = key.partition("/")
  return count + sep + leaf


def move_prob(run):
  """(steps, moved / proposals) of a write-back run (NaN without any)."""
  steps, moved = run.curve("moved")
  _, props = run.curve("proposals")
  with np.errstate(invalid="ignore", divide="ignore"):
    return steps, np.where(props > 0, moved / np.maximum(props, 1), np.nan)


def predicted(ref, fmt: str, rounding: str = "nearest"):
  """(steps, values) of the reference's prediction for a format."""
  if ref is None:
    return np.zeros(0, int), np.zeros(0)
  key = "erased_fraction" if rounding == "nearest" else "move_prob"
  return ref.curve(f"pred/{fmt}{SUFFIX[rounding]}/{key}")


def fmt_step(step, cat) -> str:
  return "never" if step is None else f"{step} ({cat})"


def not_a_freeze(step, theta: float = THETA) -> str:
  """The measured "crossing" of a stochastic or dead-zone run, labelled.

  Under stochastic rounding every coordinate keeps a positive chance to
  move, so a per-step erased share above `theta` is no freeze.
  """
  if step is None:
    return "never"
  return f"not a freeze (per-step share >= {theta:g} from step {step})"


def _cell(run) -> str:
  return run.config["study"].get("cell") or run.arm


def val_at(run, step: int):
  """Validation loss logged at `step` (None if not logged there)."""
  steps, vals = run.curve("val_loss")
  if step == 0:
    first = [r for r in run.metrics if r.get("step") == 0 and "val_loss" in r]
    return first[0]["val_loss"] if first else None
  hit = np.flatnonzero(steps == step)
  return float(vals[hit[0]]) if hit.size else None


def freeze_table(runs, theta: float = THETA, tol: float = TOL):
  """Predicted vs measured crossing for every write-back run.

  Returns (rows, summary_lines): one row per low-precision run with the
  predicted curve taken from its reference arm's trace for the same format.
  Stochastic and dead-zone runs get the mean per-step probability that a
  proposal moves its coordinate, predicted and measured, instead.
  """
  rows, cells = _freeze_rows(runs, theta, tol)
  return rows, _summary_lines(cells, theta, tol)


def _freeze_rows(runs, theta, tol):
  rows, cells = [], {}
  for run in runs:
    lp = run.config["lowprec"]
    if not lp["writeback"]:
      continue
    fmt, rounding = lp["writeback"], lp["rounding"]
    steps, meas = measured(run)
    ref = reference_for(run, runs)
    row = {
      "arm": run.arm,
      "cell": _cell(run),
      "seed": run.seed,
      "format": fmt,
      "rounding": rounding,
      "final_val_loss": run.last("val_loss"),
      "reference_val_loss": ref.last("val_loss") if ref else None,
    }
    m_step, m_cat = freeze.crossing(meas, theta, steps=steps)
    row["measured_crossing"] = (
      fmt_step(m_step, m_cat)
      if rounding == "nearest"
      else not_a_freeze(m_step, theta)
    )
    _, pred = predicted(ref, fmt)
    if pred.size and rounding == "nearest":
      n = min(len(pred), len(meas))
      c = freeze.compare(
        pred[:n], meas[:n], theta=theta, tol=tol, steps=steps[:n]
      )
      row.update(
        predicted_crossing=fmt_step(c.predicted_step, c.predicted_category),
        error_steps=c.error_steps,
        relative_error=c.relative_error,
        within_tol=c.within_tol,
        category_agrees=c.category_agrees,
        rmse=c.rmse,
      )
      cells[f"{row['cell']}/seed{run.seed}"] = (pred[:n], meas[:n])
    elif rounding != "nearest":
      # No persistent freeze is predicted; compare the per-step probability
      # that a proposal moves its coordinate, predicted vs measured.
      row["predicted_crossing"] = "none (stochastic)"
      row["measured_move_prob"] = float(np.nanmean(move_prob(run)[1]))
      _, mp = predicted(ref, fmt, rounding)
      if mp.size:
        row["predicted_move_prob"] = float(np.nanmean(mp))
    rows.append(row)
  return rows, cells


def _summary_lines(cells, theta, tol, skill_label="leave-one-out average"):
  if not cells:
    return []
  s = freeze.summarize(cells, theta=theta, tol=tol)
  lines = [
    f"- post-init crossings within {tol:.0%}: {s.within_tol}",
    f"- cells whose categories differ: {s.category_disagree}",
    "- macro RMSE of predicted vs measured erased fraction: "
    f"{s.macro_rmse:.5f}",
  ]
  if s.skill is not None and np.isfinite(s.skill):
    lines.append(f"- skill vs {skill_label} measured curve: {s.skill:.3f}")
  lines.append(
    "- category confusion (rows measured, columns predicted, order "
    f"{', '.join(freeze.CATEGORIES)}): {np.asarray(s.confusion).tolist()}"
  )
  return lines


EARLY_STEP = 2  # the first step after Adam's first, whose updates are +-lr


def post_init_steps(rows, key: str = "measured_crossing") -> list[int]:
  """Crossing steps (measured, or `predicted_crossing`) of the cells where
  both crossings are post-init."""
  return [
    int(r[key].split()[0]) for r in rows if r.get("within_tol") is not None
  ]


def span(steps) -> str | None:
  """`384x (step 2 to 768)`: the spread of crossing steps (None if none)."""
  if not steps:
    return None
  lo, hi = min(steps), max(steps)
  return f"{hi / lo:.0f}x (step {lo} to {hi})"


def _grid_lines(rows) -> list[str]:
  """Cells with post-init crossings, their span, how many cross at step 2
  and the span of the others."""
  steps = post_init_steps(rows)
  lines = [
    f"- cells with predicted and measured post-init crossings: "
    f"{len(steps)}/{len(rows)}"
  ]
  early = sum(s == EARLY_STEP for s in steps)
  pred = sum(
    s == EARLY_STEP for s in post_init_steps(rows, "predicted_crossing")
  )
  late = [s for s in steps if s > EARLY_STEP]
  lines += [
    f"- their measured crossing steps span {span(steps) or 'n/a'}",
    f"- of these, measured crossing at step {EARLY_STEP}: {early}/"
    f"{len(steps)} (predicted at step {EARLY_STEP}: {pred}/{len(steps)}); "
    "there every proposal is about lr in size (Adam's first steps), so the "
    "grid gap at the initial weights decides, not the trajectory",
    f"- measured crossings after step {EARLY_STEP}: {len(late)}/"
    f"{len(steps)}, spanning {span(late) or 'n/a'}",
  ]
  return lines


def grid_table(runs, theta: float = THETA, tol: float = TOL):
  """The controlled grid: one row per cell (write-back run), predicted vs
  measured crossing; totals as the paper gives them (cells with post-init
  crossings, their span, within 15%, category disagreements, confusion,
  macro RMSE), and how many cross at step 2 with the span of the rest."""
  rows, cells = _freeze_rows(runs, theta, tol)
  configs = {(r.arm, r.seed): r.config for r in runs}
  for r in rows:
    c = configs[r["arm"], r["seed"]]
    r.update(
      width=c["model"]["hidden"][0],
      lr=c["opt"]["lr"],
      schedule=c["opt"]["schedule"],
    )
  rows.sort(key=lambda r: (r["format"], r["schedule"], r["width"], r["lr"]))
  return rows, _grid_lines(rows) + _summary_lines(cells, theta, tol)


def transfer_table(runs, theta: float = THETA, tol: float = TOL):
  """Mantissa sweep per task: one row per (task, format); totals per task
  and over all cells."""
  rows, cells = _freeze_rows(runs, theta, tol)
  rows.sort(key=lambda r: (r["cell"].split("/")[0], _mantissa(r["format"])))
  tasks = list(dict.fromkeys(r["cell"].split("/")[0] for r in rows))
  lines = []
  for task in tasks:
    mine = {k: v for k, v in cells.items() if k.split("/")[0] == task}
    if not mine:
      continue
    s = freeze.summarize(mine, theta=theta, tol=tol)
    lines.append(
      f"- {task}: categories agree in {len(mine) - s.n_category_disagree}/"
      f"{len(mine)} cells, post-init crossings within {tol:.0%}: "
      f"{s.within_tol}, macro RMSE {s.macro_rmse:.5f}"
    )
  lines += ["- all tasks:"] + [
    "  " + x for x in _summary_lines(cells, theta, tol)
  ]
  return rows, lines


def _mantissa(fmt: str) -> int:
  """Explicit mantissa bits of an `eXmY` name (0 for other names)."""
  _, sep, m = fmt.partition("m")
  return int(m) if sep and m.isdigit() else 0


def fp8_table(runs, theta: float = THETA, tol: float = TOL):
  """FP8 write-back without master weights: crossings, coordinates that
  never move, and validation loss at mid-run and at the end, per arm.

  The fp32 reference gets a row too (validation loss only). `frozen_*` come
  from the realized trajectories of the sampled coordinates on the grid
  (`pred/sample/w`, `pred/sample/u` of a write-back run, whose trace sits
  after the write-back): the share that never moved at all, and that did
  not move in the second half of the run.
  """
  rows, _ = _freeze_rows(runs, theta, tol)
  by_run = {(r["arm"], r["seed"]): r for r in rows}
  out, lines = [], []
  total = max(r.config["train"]["steps"] for r in runs)
  half = _eval_step_near(runs[0], total // 2)
  for run in runs:
    lp = run.config["lowprec"]
    row = {
      "arm": run.arm,
      "seed": run.seed,
      "format": lp["writeback"] or "float32",
      "rounding": lp["rounding"] if lp["writeback"] else "",
    }
    base = by_run.get((run.arm, run.seed), {})
    for k in ("predicted_crossing", "measured_crossing", "rmse"):
      if k in base:
        row[k] = base[k]
    if lp["writeback"]:
      ref = reference_for(run, runs)
      _, me = measured(run)
      if lp["rounding"] == "nearest":
        _, pe = predicted(ref, lp["writeback"])
        row["predicted_mean_erased"] = _nanmean(pe)
      else:  # not moved, predicted as 1 - P(move) under stochastic rounding
        _, mp = predicted(ref, lp["writeback"], lp["rounding"])
        row["predicted_mean_erased"] = _nanmean(1 - mp)
      row["measured_mean_erased"] = _nanmean(me)
      never, late = frozen_shares(run, half, lp["writeback"])
      row["frozen_whole_run"] = never
      row["frozen_second_half"] = late
    v_half, v_end = val_at(run, half), run.last("val_loss")
    row[f"val_loss@{half}"] = v_half
    row["final_val_loss"] = v_end
    row["second_half_change"] = (
      None if v_half is None or v_end is None else v_end - v_half
    )
    out.append(row)
  lines += _fp8_claims(out)
  return out, lines


def _nanmean(x) -> float | None:
  x = np.asarray(x, float)
  return float(np.nanmean(x)) if np.isfinite(x).any() else None


def _eval_step_near(run, step: int) -> int:
  steps, _ = run.curve("val_loss")
  if not steps.size:
    return step
  return int(steps[np.argmin(np.abs(steps - step))])


def frozen_shares(run, half: int, fmt: str | None = None):
  """Shares of the sampled coordinates whose realized update is zero at
  every step of the run, and at every step after `half` (None without a
  sample). With `fmt`, only coordinates whose weight is on that grid at
  every step count (those the write-back rounds, not ones kept float32).
  """
  steps, w, u = _sample(run)
  if u is None:
    return None, None
  if fmt is not None:
    w32 = np.asarray(w, np.float32)
    on_grid = np.asarray(lowprec.round_nearest(w32, _grid_of(fmt))) == w32
    keep = on_grid.all(0)
    if not keep.any():
      return None, None
    u = u[:, keep]
  moved = u != 0
  never = float(np.mean(~moved.any(0)))
  late = float(np.mean(~moved[steps > half].any(0)))
  return never, late


def _grid_of(fmt: str):
  """`fmt`, or for a scaled format the grid its values lie on whatever
  their block scales: the element's mantissa under float32's exponents
  (`e8m3` for e4m3 elements); a sampled coordinate has no block with it."""
  if not lowprec.scaled.is_scaled(fmt):
    return fmt
  return f"e8m{lowprec.get_scaled_format(fmt).element.man_bits}"


def _sample(run):
  rows = [
    (r["step"], r["pred/sample/w"], r["pred/sample/u"])
    for r in run.metrics
    if r.get("step", 0) >= 1 and "pred/sample/u" in r
  ]
  if not rows:
    return None, None, None
  steps, w, u = zip(*rows, strict=True)
  return np.asarray(steps), np.asarray(w, float), np.asarray(u, float)


def _fp8_claims(rows) -> list[str]:
  lines = []
  fp32 = [r for r in rows if r["format"] == "float32"]
  for r in rows:
    if r["rounding"] == "nearest":
      lines.append(
        f"- {r['arm']} ({r['format']}): predicted crossing "
        f"{r.get('predicted_crossing')}, measured {r['measured_crossing']}; "
        f"mean erased fraction predicted {_f(r['predicted_mean_erased'])}, "
        f"measured {_f(r['measured_mean_erased'])}; sampled coordinates "
        f"never moved: {_pct(r['frozen_whole_run'])}, not moved in the "
        f"second half: {_pct(r['frozen_second_half'])}"
      )
    elif r["rounding"]:
      lines.append(
        f"- {r['arm']} ({r['format']}): no persistent freeze predicted; "
        f"mean share of proposals not moved per step predicted "
        f"{_f(r['predicted_mean_erased'])}, measured "
        f"{_f(r['measured_mean_erased'])}; sampled coordinates never "
        f"moved: {_pct(r['frozen_whole_run'])}, not moved in the second "
        f"half: {_pct(r['frozen_second_half'])}"
      )
  for r in fp32 + [r for r in rows if r["rounding"]]:
    lines.append(
      f"- validation loss {r['arm']}: {_f(r['final_val_loss'])} at the end, "
      f"change over the second half {_f(r['second_half_change'], '+.4f')}"
    )
  return lines


def _f(x, spec: str = ".4f") -> str:
  return "n/a" if x is None else format(x, spec)


def _pct(x) -> str:
  return "n/a" if x is None else f"{x:.1%}"

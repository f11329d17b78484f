"""Optimizer state stored in low precision: result runs -> (rows, lines).

`state_table` (study `state_precision`): per arm and seed, the final
validation loss against the float32-state arm of its weight setting (same
seed), the measured state erasures and stalls (`lowprec.store_state`'s
telemetry, logged every step as `state/...`) of each moment, and those
that the float32-state run predicted for that store
(`pred_state/<store>/...`, from `lowprec.freeze.state_trace`). An erasure
leaves the stored value as it was, a stall the stored code: under a scale
that follows the block's largest value a stalled code's value still moves
with its block.
"""

from __future__ import annotations

import numpy as np

from experiments.analysis.writeback_tables import recipe_bytes

MOMENTS = ("mu", "nu")


def _rules(run) -> str:
  return ", ".join(run.config["lowprec"].get("state") or ()) or "float32"


def _moment_of(path: str) -> str | None:
  parts = path.split("/")
  return next((m for m in MOMENTS if m in parts), None)


def moment_curves(run, prefix: str, word: str = "erased") -> dict:
  """Per moment, (steps, `word` / changed) summed over its state paths,
  from a run's `<prefix>/<word>/<path>` (or `<prefix>/<word>_fraction/
  <path>` times the changes) and `<prefix>/changed/<path>` metrics
  (prefix `state` measured, `pred_state/<store>` predicted; `word`
  "erased" or "stalled")."""
  out = {}
  head = f"{prefix}/changed/"
  for moment in MOMENTS:
    steps, num, den = [], [], []
    for r in run.metrics:
      e = c = 0.0
      for k, changed in r.items():
        if not k.startswith(head) or _moment_of(k[len(head) :]) != moment:
          continue
        path = k[len(head) :]
        count = r.get(f"{prefix}/{word}/{path}")
        if count is None:
          frac = r.get(f"{prefix}/{word}_fraction/{path}")
          if frac is None or not changed or not np.isfinite(frac):
            continue
          count = frac * changed
        e += count
        c += changed
      if c > 0:
        steps.append(r["step"])
        num.append(e)
        den.append(c)
    if steps:
      out[moment] = (np.asarray(steps), np.asarray(num) / np.asarray(den))
  return out


def _late_mean(curve) -> float | None:
  steps, frac = curve
  late = frac[steps > steps.max() / 2]
  late = late[np.isfinite(late)]
  return float(late.mean()) if late.size else None


def state_table(runs):
  """Rows per arm x seed: `state` (the rules), `final_val_loss`,
  `val_minus_fp32` (minus the float32-state arm of the same weight setting
  and seed), per moment `<m>_erased_2nd_half` measured and
  `<m>_predicted_2nd_half` (means of the per-step erased share over the
  second half of the steps), `<m>_stalled_2nd_half` and
  `<m>_stalled_predicted_2nd_half` (the same for stalls, where the run
  logged them), `state_flushed_last` (nonzero values stored
  as 0 at the last step), `bytes_per_param` and `steps_per_s`. Lines: per
  arm, the mean and range over seeds."""
  by_key = {(r.arm, r.seed): r for r in runs}
  rows = []
  for run in runs:
    study = run.config["study"]
    ref = by_key.get((study.get("reference_arm") or run.arm, run.seed))
    row = {"arm": run.arm, "seed": run.seed, "state": _rules(run)}
    row["final_val_loss"] = run.last("val_loss")
    if ref is not None and None not in (
      row["final_val_loss"],
      ref.last("val_loss"),
    ):
      row["val_minus_fp32"] = row["final_val_loss"] - ref.last("val_loss")
    measured = moment_curves(run, "state")
    for m, curve in measured.items():
      row[f"{m}_erased_2nd_half"] = _late_mean(curve)
    for m, curve in moment_curves(run, "state", "stalled").items():
      row[f"{m}_stalled_2nd_half"] = _late_mean(curve)
    if ref is not None and study.get("cell") and measured:
      pred = f"pred_state/{study['cell']}"
      for m, curve in moment_curves(ref, pred).items():
        row[f"{m}_predicted_2nd_half"] = _late_mean(curve)
      for m, curve in moment_curves(ref, pred, "stalled").items():
        row[f"{m}_stalled_predicted_2nd_half"] = _late_mean(curve)
    if measured:
      row["state_flushed_last"] = run.last("state/flushed")
    row["bytes_per_param"] = recipe_bytes(run.config)
    row["steps_per_s"] = run.summary.get("steps_per_s")
    rows.append(row)
  return rows, _lines(rows)


def _fmt_range(xs, spec) -> str:
  return f"{np.mean(xs):{spec}} (range {min(xs):{spec}} to {max(xs):{spec}})"


def _values(rows, key) -> list:
  return [r[key] for r in rows if r.get(key) is not None]


def _lines(rows) -> list[str]:
  out = []
  for arm in dict.fromkeys(r["arm"] for r in rows):
    mine = [r for r in rows if r["arm"] == arm]
    d = _values(mine, "val_minus_fp32")
    measured = {m: _values(mine, f"{m}_erased_2nd_half") for m in MOMENTS}
    if not d or not any(measured.values()):
      continue
    parts = [
      f"- {arm}: final val loss minus float32 state {_fmt_range(d, '+.4f')} "
      f"nats, {len(d)} seeds"
    ]
    for m, got in measured.items():
      if got:
        text = f"{m} updates erased (2nd half) {np.mean(got):.3f}"
        want = _values(mine, f"{m}_predicted_2nd_half")
        if want:
          text += f", predicted {np.mean(want):.3f}"
        stalled = _values(mine, f"{m}_stalled_2nd_half")
        if stalled:
          text += f"; stalled {np.mean(stalled):.3f}"
          want = _values(mine, f"{m}_stalled_predicted_2nd_half")
          if want:
            text += f", predicted {np.mean(want):.3f}"
        parts.append(text)
    parts.append(f"{mine[0]['bytes_per_param']:.2f} bytes/param")
    out.append("; ".join(parts))
  return out

"""Optimizer state stored in low precision: result runs -> (rows, lines).

`state_table` (study `state_precision`): per arm and seed, the final
validation loss against the same seed's arm with float32 state, and the
measured state erasures (`lowprec.store_state`'s telemetry, logged every
step as `state/...`).
"""

from __future__ import annotations

import numpy as np


def _rules(run) -> str:
  return ", ".join(run.config["lowprec"].get("state") or ()) or "float32"


def state_table(runs):
  """Rows per arm x seed: `state` (the rules), `final_val_loss`,
  `val_minus_fp32` (minus the float32-state arm of the same seed),
  `state_erased_2nd_half` (mean of `state/erased_fraction` over the second
  half of the steps) and `state_flushed_last` (nonzero values stored as 0
  at the last step). Lines: per arm, the mean and range over seeds of the
  difference to float32 state."""
  ref = {
    r.seed: r.last("val_loss")
    for r in runs
    if not r.config["lowprec"].get("state")
  }
  rows = []
  for run in runs:
    row = {"arm": run.arm, "seed": run.seed, "state": _rules(run)}
    row["final_val_loss"] = run.last("val_loss")
    if ref.get(run.seed) is not None and row["final_val_loss"] is not None:
      row["val_minus_fp32"] = row["final_val_loss"] - ref[run.seed]
    steps, frac = run.curve("state/erased_fraction")
    if steps.size:
      late = frac[steps > steps.max() / 2]
      late = late[np.isfinite(late)]
      if late.size:
        row["state_erased_2nd_half"] = float(late.mean())
      row["state_flushed_last"] = run.last("state/flushed")
    rows.append(row)
  return rows, _lines(rows)


def _lines(rows) -> list[str]:
  out = []
  for arm in dict.fromkeys(r["arm"] for r in rows):
    d = [r.get("val_minus_fp32") for r in rows if r["arm"] == arm]
    d = [x for x in d if x is not None]
    erased = [r.get("state_erased_2nd_half") for r in rows if r["arm"] == arm]
    erased = [x for x in erased if x is not None]
    if not d or not erased:
      continue
    out.append(
      f"- {arm}: final val loss minus float32 state {np.mean(d):+.4f} nats "
      f"(range {min(d):+.4f} to {max(d):+.4f}, {len(d)} seeds); state "
      f"updates erased in the second half {np.mean(erased):.3f}"
    )
  return out

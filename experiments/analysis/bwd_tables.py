"""Analyses of the backward-state studies: result runs -> (rows, lines).

Each analysis takes the runs of one study (objects with `arm`, `seed`,
`config`, `summary`, `curve(key)` and `last(key)`, as `runs.Run` reads
them from the result files) and returns table rows (dicts) and
summary lines (Markdown bullets):

  operator_table   bwd_operator_checks: per operator and use, for every
                   policy (arm), prediction -> verification with z; counts
                   of agreement over every checked cell.
  probe_table      attention_reuse, norm_store: per run, final losses, the
                   loss difference from a baseline arm (same seed) and, with
                   `study.loss_margin` in the config, whether it is within
                   the margin; per probe group the gradient probe's mean
                   cosine, norm ratio and relative error against the
                   reference, and the pooled bias test.

The probe's `bias2` (experiments/probes.py) is unbiased for the squared
relative bias of the mean gradient, so its mean over a run's probes is
tested against zero with the standard error across probes (`bias_z`);
`bias_rms` is the square root of that mean (0 when negative).
"""

from __future__ import annotations

import math

import numpy as np

ARM_ORDER = ("rounded", "original", "fresh", "per_use")
PROBE_COLUMNS = ("1-cos", "norm_ratio", "rel_err", "last_rel_err", "bias_rms")
PROBE_COLUMNS += ("bias_z",)


# ---- single-operator checks --------------------------------------------------


def _z(z, exact=False) -> str:
  if exact:
    return "exact"
  if isinstance(z, str):  # non-finite, as the result files store it
    return z
  if z is None:
    return "-"
  return f"{z:+.1f}" if abs(z) < 1e4 else f"{z:+.1e}"


def _arm_key(arm: str):
  return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def operator_table(runs):
  """Per (operator, use): `reads: predicted -> verified (z)` per policy.

  Cells come from the lowest seed of each arm; the counts cover every run.
  """
  runs = [r for r in runs if r.summary.get("kind") == "operator_checks"]
  if not runs:
    return [], ["- no finished operator checks"]
  arms = sorted({r.arm for r in runs}, key=_arm_key)
  first = {
    a: min((r for r in runs if r.arm == a), key=lambda r: r.seed) for a in arms
  }
  cells = {a: {(x["op"], x["use"]): x for x in first[a].summary["rows"]}
           for a in arms}  # fmt: skip
  keys = list(dict.fromkeys(k for a in arms for k in cells[a]))
  rows = []
  for op, use in keys:
    row = {"op": op, "use": use}
    agree = True
    for a in arms:
      x = cells[a].get((op, use))
      if x is None:
        continue
      z = "" if x.get("exact") else f" (z={_z(x['z'])})"
      cell = f"{x['predicted']} -> {x['verified']}{z}"
      row[a] = cell if x["reads"] == "policy" else f"{x['reads']}: {cell}"
      agree = agree and x["agrees"]
    reuse = next(cells[a][op, use] for a in arms if (op, use) in cells[a])
    if reuse and reuse["reuse_predicted"] is not None:
      z = _z(reuse["reuse_z"], reuse.get("reuse_exact"))
      row["reuse differs: predicted / verified"] = (
        f"{_yes(reuse['reuse_predicted'])} / {_yes(reuse['reuse_verified'])} "
        f"({z if z == 'exact' else 'z=' + z})"
      )
    row["agrees"] = agree
    rows.append(row)

  uses, totals, values, reuse_rows = [], [], {}, {}
  for r in runs:
    for x in r.summary["rows"]:
      (totals if x["use"] == "(all uses)" else uses).append(x)
      if x["reuse_predicted"] is not None:
        reuse_rows[(r.seed, x["op"], x["use"])] = x
    # Every value of every use is checked in each run; with the same seed
    # and inputs the cells do not depend on the policy: count them once.
    for x in r.summary.get("values", []):
      values[(r.seed, x["op"], x["use"], x["value"])] = x
  values, reuse_rows = list(values.values()), list(reuse_rows.values())
  n_f = sorted({x["n_forward"] for x in uses})
  n_b = sorted({x["n_backward"] for x in uses})
  biased = [x for x in values if x["predicted"] == "biased"]
  other = [x for x in values if x["predicted"] != "biased"]
  seeds = sorted({r.seed for r in runs})
  lines = [
    f"- prediction = verification, per use and policy: "
    f"{sum(x['agrees'] for x in uses)}/{len(uses)}; whole policy: "
    f"{sum(x['agrees'] for x in totals)}/{len(totals)}; every value of "
    f"every use: {sum(x['agrees'] for x in values)}/{len(values)}; reuse "
    f"vs an "
    f"independent copy: "
    f"{sum(x['reuse_predicted'] == x['reuse_verified'] for x in reuse_rows)}"
    f"/{len(reuse_rows)}",
    f"- {len(arms)} policies x {len({x['op'] for x in uses})} operators, "
    f"seeds {', '.join(map(str, seeds))}; n_forward "
    f"{'/'.join(map(str, n_f))} (half estimate the direction, half test), "
    f"n_backward {'/'.join(map(str, n_b))}",
  ]
  if biased:
    lines.append(
      f"- predicted biased: smallest |z| {_min_abs_z(biased):.1f} "
      f"({len(biased)} cells); predicted exact or unbiased: largest |z| "
      f"{_max_abs_z(other):.1f} ({len(other)} cells)"
    )
  return rows, lines


def _yes(b) -> str:
  return "-" if b is None else ("yes" if b else "no")


def _abs_z(x) -> float:
  z = x["z"]
  return abs(float(z)) if z is not None else 0.0


def _min_abs_z(xs) -> float:
  return min(_abs_z(x) for x in xs)


def _max_abs_z(xs) -> float:
  return max((_abs_z(x) for x in xs), default=0.0)


# ---- training runs with a gradient probe -------------------------------------


def probe_groups(run) -> list[str]:
  """The probe's group names, in the config's order."""
  spec = run.config["train"].get("probe_groups", "")
  return [item.partition("=")[0].strip() for item in spec.split(",") if item]


def probe_stats(run, group: str, first_step: int = 1) -> dict:
  """A run's probe of `group` over its probes at steps >= `first_step`:
  means of 1 - cos, norm_ratio and rel_err, the last rel_err, and the
  pooled bias test (`bias_rms`, `bias_z`)."""
  out = {}
  for stat in ("cos", "norm_ratio", "rel_err"):
    steps, v = run.curve(f"probe/{group}/{stat}")
    v = v[steps >= first_step]
    if stat == "cos":
      stat, v = "1-cos", np.maximum(1 - v, 0.0)
    out[stat] = float(np.mean(v)) if v.size else None
    if stat == "rel_err":
      out["last_rel_err"] = float(v[-1]) if v.size else None
  steps, b2 = run.curve(f"probe/{group}/bias2")
  b2 = b2[steps >= first_step]
  out["n_probes"] = int(b2.size)
  if b2.size:
    mean = float(np.mean(b2))
    se = float(np.std(b2, ddof=1) / math.sqrt(b2.size)) if b2.size > 1 else 0.0
    out["bias_rms"] = math.sqrt(max(mean, 0.0))
    if se > 0:
      out["bias_z"] = mean / se
    else:
      out["bias_z"] = math.inf if mean > 0 else 0.0
  return out


def tail_mean(run, key: str, frac: float = 0.1):
  """Mean of a per-step metric over the last `frac` of the steps."""
  steps, v = run.curve(key)
  if not v.size:
    return None
  n = max(1, int(round(frac * v.size)))
  return float(np.mean(v[-n:]))


def probe_table(runs, baseline: str):
  """Per run: losses, difference from `baseline` (same seed), margin test
  (when the config has `study.loss_margin`) and probe statistics."""
  base = {r.seed: r for r in runs if r.arm == baseline}
  rows = []
  for run in sorted(runs, key=lambda r: (r.seed, r.arm != baseline, r.arm)):
    margin = run.config["study"].get("loss_margin")
    val = run.last("val_loss")
    row = {"arm": run.arm, "seed": run.seed, "final_val_loss": val}
    row["train_loss_last10%"] = tail_mean(run, "loss")
    b = base.get(run.seed)
    if b is not None and run is not b and val is not None:
      diff = val - b.last("val_loss")
      row[f"val_minus_{baseline}"] = diff
      if margin is not None:
        row["within_margin"] = abs(diff) < margin
    for g in probe_groups(run):
      s = probe_stats(run, g)
      if not s.get("n_probes"):
        continue
      for k in PROBE_COLUMNS:
        row[f"{g}_{k}"] = s[k]
    rows.append(row)
  return rows, _probe_lines(runs, rows, baseline)


def _probe_lines(runs, rows, baseline) -> list[str]:
  lines = []
  arms = list(dict.fromkeys(r["arm"] for r in rows))
  groups = probe_groups(runs[0]) if runs else []
  margin = runs[0].config["study"].get("loss_margin") if runs else None
  for arm in arms:
    mine = [r for r in rows if r["arm"] == arm]
    parts = [f"final val loss {_mean(mine, 'final_val_loss'):.4f}"]
    key = f"val_minus_{baseline}"
    diffs = [r[key] for r in mine if key in r]
    if diffs:
      parts.append(
        f"minus {baseline} {np.mean(diffs):+.4f} (per seed "
        + ", ".join(f"{d:+.4f}" for d in diffs)
        + ")"
      )
      if margin is not None:
        inside = sum(abs(d) < margin for d in diffs)
        parts.append(f"within the margin {margin:g}: {inside}/{len(diffs)}")
    for g in groups:
      runs_g = [r for r in runs if r.arm == arm]
      pooled = _pooled(runs_g, g)
      if pooled is None:
        continue
      m = {k: _mean(mine, f"{g}_{k}") for k in PROBE_COLUMNS}
      parts.append(
        f"{g}: 1 - cos {m['1-cos']:.1e}, norm ratio "
        f"{m['norm_ratio']:.4f}, rel. error {m['rel_err']:.2e} (last "
        f"{m['last_rel_err']:.2e}), bias "
        f"{pooled[0]:.2e} (z={_z(pooled[1])}, {pooled[2]} probes)"
      )
    lines.append(f"- {arm} ({len(mine)} seeds): " + "; ".join(parts))
  return lines


def _pooled(runs, group):
  """(rms bias, z, probes) of `bias2` pooled over the runs' probes."""
  vals = []
  for run in runs:
    steps, b2 = run.curve(f"probe/{group}/bias2")
    vals += list(b2[steps >= 1])
  if not vals:
    return None
  v = np.asarray(vals)
  mean = float(v.mean())
  se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
  z = mean / se if se > 0 else (math.inf if mean > 0 else 0.0)
  return math.sqrt(max(mean, 0.0)), z, v.size


def _mean(rows, key) -> float:
  v = [r[key] for r in rows if r.get(key) is not None]
  return float(np.mean(v)) if v else float("nan")


def attention_table(runs):
  """attention_reuse: every run against the `redraw` arm of its seed (the
  independent copy from the distribution of the reused output)."""
  return probe_table(runs, "redraw")


def _diverged(run) -> bool:
  """Non-finite loss, no summary after the last step, or a final
  validation loss above the first one."""
  steps, v = run.curve("val_loss")
  first = next((r["val_loss"] for r in run.metrics if "val_loss" in r), None)
  if not v.size or not np.all(np.isfinite(v)):
    return True
  return first is not None and v[-1] > first


# attention_reuse_search's arms per setting, and the contrasts it tests:
# reuse against each copy, then the two copies against each other.
SEARCH_ARMS = ("reuse", "redraw", "outonly")
CONTRASTS = (("reuse", "redraw"), ("reuse", "outonly"), ("redraw", "outonly"))


def _contrast(arm, a: str, b: str) -> dict:
  """Per-seed final val loss of `a` minus `b`, and the pre-stated test:
  mean > 3 sd(b) over seeds, or `a` diverging where its `b` pair does not."""
  other = {r.seed: r for r in arm[b]}
  pairs = [
    (r, other[r.seed])
    for r in arm[a]
    if r.seed in other
    and r.last("val_loss") is not None
    and other[r.seed].last("val_loss") is not None
  ]
  diffs = [x.last("val_loss") - y.last("val_loss") for x, y in pairs]
  vals = [r.last("val_loss") for r in arm[b] if r.last("val_loss") is not None]
  sd = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
  threshold = 3 * sd if sd is not None else None
  mean = float(np.mean(diffs)) if diffs else None
  div = [x.seed for x, y in pairs if _diverged(x) and not _diverged(y)]
  fails = bool(div) or (
    threshold is not None and mean is not None and mean > threshold
  )
  key = f"{a}_minus_{b}"
  return {
    key: mean,
    f"{key}_per_seed": " ".join(f"{d:+.4f}" for d in diffs),
    f"{key}_threshold": threshold,
    f"{key}_fails": fails,
  }


def attention_search_table(runs):
  """attention_reuse_search: per setting, final validation loss of each arm
  (mean, sd over seeds), each contrast per seed with its pre-stated
  failure test (mean difference > 3 sd over seeds of the second arm, or
  the first diverging where its pair does not), and the pooled QKV bias of
  each arm. Only finished runs count."""
  runs = [r for r in runs if r.summary.get("status") == "finished"]
  found = {r.arm.rsplit("_", 1)[0] for r in runs if "_" in r.arm}
  # The config's order (increasing dose); runs that predate it: found order.
  order = list(runs[0].config["study"].get("settings", ())) if runs else []
  settings = sorted(
    found, key=lambda s: (order.index(s), s) if s in order else (len(order), s)
  )
  rows, lines = [], []
  failed = {c: [] for c in CONTRASTS}
  for setting in settings:
    arm = {
      k: [r for r in runs if r.arm == f"{setting}_{k}"] for k in SEARCH_ARMS
    }
    arm = {k: sorted(v, key=lambda r: r.seed) for k, v in arm.items()}
    row = {"setting": setting, "seeds": len(arm["reuse"])}
    for k in SEARCH_ARMS:
      vals = [r.last("val_loss") for r in arm[k]]
      vals = [x for x in vals if x is not None]
      row[f"{k}_val_loss"] = float(np.mean(vals)) if vals else None
      row[f"{k}_sd"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
    for a, b in CONTRASTS:
      if arm[a] and arm[b]:
        row.update(_contrast(arm, a, b))
        if row[f"{a}_minus_{b}_fails"]:
          failed[(a, b)].append(setting)
    for k in SEARCH_ARMS:
      pooled = _pooled(arm[k], "qkv")
      row[f"{k}_qkv_bias_rms"] = pooled[0] if pooled else None
      row[f"{k}_qkv_bias_z"] = pooled[1] if pooled else None
    rows.append(row)
  lines.append(
    "- failure criterion (fixed before the runs), for a minus b: mean over "
    "seeds of a minus b final val loss > 3 x sd over seeds of b, or an a "
    "run diverging where its b pair does not"
  )
  for a, b in CONTRASTS:
    lines.append(
      f"- {a} vs {b}: settings that fail: "
      + (", ".join(failed[(a, b)]) if failed[(a, b)] else "none")
    )
  return rows, lines


def norm_store_table(runs):
  """norm_store: every run against the `per_use` arm of its seed."""
  return probe_table(runs, "per_use")


def fp4_recipe_table(runs):
  """fp4_recipe: `probe_table` against `bf16` (same seed), and per arm the
  paired loss gap to bf16 with its 95% t-interval."""
  from experiments.analysis.frontier import interval

  rows, lines = probe_table(runs, "bf16")
  gaps = []
  for arm in dict.fromkeys(r["arm"] for r in rows):
    diffs = [r["val_minus_bf16"] for r in rows if r["arm"] == arm
             and r.get("val_minus_bf16") is not None]  # fmt: skip
    if not diffs:
      continue
    mean, hw = interval(diffs)
    lo, hi = (None, None) if hw is None else (mean - hw, mean + hw)
    side = "" if hw is None else f" [{lo:+.4f}, {hi:+.4f}]"
    told = hw is not None and (lo > 0 or hi < 0)
    gaps.append(
      f"- {arm} minus bf16: {mean:+.4f}{side} (95% t-interval, "
      f"{len(diffs)} seed pairs){'' if told else '; not told apart from 0'}"
    )
    for r in rows:
      if r["arm"] == arm:
        r["gap_lo"], r["gap_hi"] = lo, hi
  return rows, gaps + _bias_intervals(runs, rows) + lines


# The ablations' comparisons the config's predictions make, (arm, against).
FP4_BIAS_PAIRS = (
  ("nvfp4_1d", "nvfp4"),
  ("nvfp4_nearest", "nvfp4"),
  ("nvfp4_no_rht", "nvfp4"),
  ("nvfp4_all", "nvfp4"),
  ("mxfp8_floor", "mxfp8_up"),
  ("mxfp8_up", "nvfp4"),
)


def _bias_intervals(runs, rows) -> list[str]:
  """Per arm and probe group, the gradient bias (rms, relative) of each
  seed, its mean and 95% t-interval over the seeds; then, for
  `FP4_BIAS_PAIRS`, the per-seed difference of the two arms' biases with
  its interval (the seed is the unit: probes of one run share its
  trajectory, so their pooled z says nothing of another seed's)."""
  from experiments.analysis.frontier import interval

  groups = probe_groups(runs[0]) if runs else []
  lines = []
  for g in groups:
    key = f"{g}_bias_rms"
    by = {}
    for r in rows:
      if r.get(key) is not None:
        by.setdefault(r["arm"], {})[r["seed"]] = r[key]
    for arm, seeds in by.items():
      mean, hw = interval(seeds.values())
      side = "" if hw is None else f" [{mean - hw:.4f}, {mean + hw:.4f}]"
      lines.append(
        f"- {arm}: {g} bias (rms, relative) {mean:.4f}{side} over "
        f"{len(seeds)} seeds (95% t-interval)"
      )
    for arm, other in FP4_BIAS_PAIRS:
      a, b = by.get(arm, {}), by.get(other, {})
      diffs = [a[s] - b[s] for s in a if s in b]
      mean, hw = interval(diffs)
      if hw is None:
        continue
      lo, hi = mean - hw, mean + hw
      verdict = "higher" if lo > 0 else "lower" if hi < 0 else "not told apart"
      lines.append(
        f"- {g} bias, {arm} minus {other}: {mean:+.4f} [{lo:+.4f}, "
        f"{hi:+.4f}] over {len(diffs)} seed pairs: {verdict}"
      )
  return lines


ANALYSES = {
  "operator_checks": operator_table,
  "attention_reuse": attention_table,
  "norm_store": norm_store_table,
  "attention_search": attention_search_table,
  "fp4_recipe": fp4_recipe_table,
}

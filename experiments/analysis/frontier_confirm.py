"""The confirmatory frontier's table (configs/frontier_confirm.py): each
arm against float32 of the same seed, at a margin fixed before the runs,
with Holm's step-down correction over the arms.

Per arm: its weights, write-back, scale rule and moment store (the
labels); bytes per parameter; the paired difference of final validation
loss against float32 (mean, 95% t-interval); its one-sided upper bound at
the arm's Holm level and whether it is non-inferior at the margin; the
same difference's Holm-corrected lower bound (an arm above 0 costs loss);
the paired difference of training loss (the mean over the last 10% of
the steps); and, for MX arms, the weights saturated over the run. Arms
named `<arm>_2x` ran twice the horizon and pair with `fp32_2x`, as a
family of their own.

The lines say what the design fixed (margin, family, level), whether
float32 converged by the doubling criterion (its 2x run's improvement
against the margin), whether each key arm's difference held at twice the
horizon (the per-seed change of the paired difference), and the advisor's
back-test where its predictions were committed.
"""

from __future__ import annotations

import math
import re

import numpy as np
from scipy import stats

from experiments.analysis import bwd_tables, frontier

REFERENCE = "fp32"
LONG = "_2x"  # suffix of the arms at twice the horizon
ALPHA = 0.05  # familywise, one-sided
TRAIN_TAIL = 0.1  # training loss: mean over the last 10% of the steps


def holm(pvalues: dict[str, float], alpha: float = ALPHA) -> dict:
  """Holm's step-down procedure: per hypothesis its level `alpha / (m -
  k + 1)` (k its rank by p-value, from 1) and whether it is rejected
  (every hypothesis ranked before it was, and its p-value is at or below
  its level)."""
  order = sorted(pvalues, key=lambda k: (pvalues[k], k))
  m = len(order)
  out, going = {}, True
  for k, name in enumerate(order, start=1):
    level = alpha / (m - k + 1)
    going = going and pvalues[name] <= level
    out[name] = {"level": level, "rejected": going}
  return out


def one_sided(diffs, bound: float, upper: bool = True) -> float:
  """p-value of the paired t-test of H0: mean >= bound (`upper`: is the
  mean below `bound`?) or H0: mean <= bound (is it above?)."""
  d = np.asarray(diffs, float)
  se = d.std(ddof=1) / math.sqrt(d.size)
  gap = d.mean() - bound
  if se == 0:
    return 0.0 if (gap < 0 if upper else gap > 0) else 1.0
  t, df = gap / se, d.size - 1
  return float(stats.t.cdf(t, df) if upper else stats.t.sf(t, df))


def bound(diffs, level: float, upper: bool = True) -> float:
  """The one-sided `1 - level` t bound of the mean of `diffs`."""
  d = np.asarray(diffs, float)
  se = d.std(ddof=1) / math.sqrt(d.size)
  q = stats.t.ppf(1 - level, d.size - 1)
  return float(d.mean() + q * se if upper else d.mean() - q * se)


def train_loss(run) -> float | None:
  """Mean training loss over the last `TRAIN_TAIL` of the run's steps."""
  return bwd_tables.tail_mean(run, "loss", TRAIN_TAIL)


def labels(config: dict) -> dict:
  """What an arm stores and how it writes back, from its config alone."""
  lp = config["lowprec"]
  fmt = lp.get("writeback") or (
    f"float32 (forward {lp['weight_format']})"
    if lp.get("weight_format", "float32") != "float32"
    else "float32"
  )
  chosen = [e.split("=", 1)[1] for e in lp.get("group_recipes") or ()]
  if chosen:
    fmt = "per group: " + ", ".join(sorted({c.split("+")[0] for c in chosen}))
  comp = lp.get("compensation", "none")
  rounding = lp.get("rounding", "nearest") if lp.get("writeback") else "-"
  how = rounding if comp == "none" else f"{comp} ({rounding})"
  if comp == "kahan":
    how = f"kahan, {lp.get('buffer', 'bfloat16')} buffer ({rounding})"
  scale = "-"
  if str(lp.get("writeback", "")).startswith(("mx", "nvfp4")):
    scale = {"noclip": "noclip", "ocp": "OCP floor", "": "OCP floor"}[
      lp.get("writeback_rule", "")
    ]
  state = "; ".join(lp.get("state") or ()) or "float32"
  if chosen:
    state = "per group: " + ", ".join(
      sorted({c.partition("+")[2] or "float32" for c in chosen})
    )
  return {
    "weights": fmt,
    "write_back": how,
    "scale_rule": scale,
    "moments": state,
  }


def saturated(run) -> float | None:
  """Weights written back past the format's largest value, over the run."""
  vals = [r.get("saturated") for r in run.metrics if "saturated" in r]
  return float(sum(v or 0 for v in vals)) if vals else None


def _paired(arm_runs, ref_runs, value):
  out = {}
  for s, r in arm_runs.items():
    if s in ref_runs:
      a, b = value(r), value(ref_runs[s])
      if a is not None and b is not None:
        out[s] = a - b
  return out


def _val(run):
  return run.summary.get("final_val_loss")


def confirm_table(runs):
  """Rows per arm and the lines of the design's readings (module doc)."""
  by_arm: dict[str, dict[int, object]] = {}
  for r in runs:
    if r.summary.get("status") == "finished":
      by_arm.setdefault(r.arm, {})[r.seed] = r
  any_run = next(iter(runs))
  cfg = any_run.config
  margin = cfg["study"].get("margin", frontier.MARGIN)
  sizes = frontier._sizes(cfg)
  new = set(cfg["study"].get("new_arms", ()))
  rows, families = [], {"": {}, LONG: {}}
  for arm, seeds in sorted(by_arm.items()):
    fam = LONG if arm.endswith(LONG) else ""
    ref = by_arm.get(REFERENCE + fam, {})
    config = next(iter(seeds.values())).config
    val = _paired(seeds, ref, _val)
    train = _paired(seeds, ref, train_loss)
    mean, hw = frontier.interval(val.values())
    tmean, thw = frontier.interval(train.values())
    row = {
      "arm": arm,
      **labels(config),
      "steps": config["train"]["steps"],
      "bytes_per_param": frontier.arm_bytes(config, sizes),
      "seeds": len(val),
      "loss_vs_fp32": mean,
      "half_width_95": hw,
      "train_loss_vs_fp32": tmean,
      "train_half_width_95": thw,
      "design": "added" if arm.removesuffix(LONG) in new else "",
    }
    if row["scale_rule"] != "-":
      row["saturated_per_run"] = frontier._mean(
        saturated(r) for r in seeds.values()
      )
    rows.append(row)
    if arm not in (REFERENCE, REFERENCE + LONG) and len(val) >= 2:
      families[fam][arm] = list(val.values())
  for diffs in families.values():
    ni = holm({a: one_sided(d, margin) for a, d in diffs.items()})
    worse = holm({a: one_sided(d, 0.0, upper=False) for a, d in diffs.items()})
    for row in rows:
      d = diffs.get(row["arm"])
      if d is None:
        continue
      row["holm_upper"] = bound(d, ni[row["arm"]]["level"])
      row["non_inferior"] = "yes" if ni[row["arm"]]["rejected"] else "no"
      row["holm_lower"] = bound(d, worse[row["arm"]]["level"], upper=False)
      row["costs_loss"] = "yes" if worse[row["arm"]]["rejected"] else ""
  rows.sort(
    key=lambda r: (r["steps"], r["bytes_per_param"], r["loss_vs_fp32"] or 0)
  )
  lines = _design(margin, families) + _converged(by_arm, margin)
  lines += _held(by_arm) + _saturation(rows)
  lines += frontier._checked(
    [r for r in rows if not r["arm"].endswith(LONG)], cfg["study"]["name"]
  )
  return rows, lines


def _design(margin, families) -> list[str]:
  m, m2 = len(families[""]), len(families[LONG])
  return [
    f"- fixed before the runs: margin {margin} nats; one-sided tests at "
    f"familywise {ALPHA} with Holm's step-down, {m} arms against float32 "
    f"at the first horizon and {m2} at twice it; `holm_upper` is the "
    "upper bound at the arm's Holm level (non-inferior: below the margin, "
    "every arm ranked before it also); `holm_lower` above 0: costs loss"
  ]


def _converged(by_arm, margin) -> list[str]:
  """The doubling criterion, then the first design's for comparison."""
  short, long_ = by_arm.get(REFERENCE, {}), by_arm.get(REFERENCE + LONG, {})
  lines = []
  gain = _paired(long_, short, _val)
  if len(gain) >= 2:
    mean, hw = frontier.interval(gain.values())
    ok = abs(mean) < margin
    lines.append(
      f"- float32 at twice the horizon minus at the first, final val loss: "
      f"{mean:+.4f} [{mean - hw:+.4f}, {mean + hw:+.4f}] nats over "
      f"{len(gain)} seeds: "
      + (
        f"converged (|change| < {margin})"
        if ok
        else f"NOT converged by the doubling criterion (|change| >= {margin})"
      )
    )
    tgain = _paired(long_, short, train_loss)
    tmean, thw = frontier.interval(tgain.values())
    if tmean is not None and thw is not None:
      lines.append(
        f"- the same for training loss (last 10% of the steps): "
        f"{tmean:+.4f} [{tmean - thw:+.4f}, {tmean + thw:+.4f}] nats"
      )
  first = frontier._convergence(short)
  if first:
    lines.append(
      "- the first design's criterion (holds by construction under cosine "
      "decay to 0), for comparison:"
    )
    lines += ["  " + x for x in first]
  return lines


def _held(by_arm) -> list[str]:
  """Per key arm: its paired difference at each horizon and the per-seed
  change between them, with 95% intervals."""
  lines = []
  for arm in sorted(a for a in by_arm if a.endswith(LONG)):
    base = arm.removesuffix(LONG)
    if base == REFERENCE or base not in by_arm:
      continue
    short = _paired(by_arm[base], by_arm.get(REFERENCE, {}), _val)
    long_ = _paired(by_arm[arm], by_arm.get(REFERENCE + LONG, {}), _val)
    change = {s: long_[s] - short[s] for s in long_ if s in short}
    if len(change) < 2:
      continue
    (a, ah), (b, bh), (c, ch) = (
      frontier.interval(x.values()) for x in (short, long_, change)
    )
    verdict = (
      "grew"
      if c - ch > 0
      else "shrank"
      if c + ch < 0
      else "not told apart from the first horizon's"
    )
    lines.append(
      f"- {base}: {a:+.4f} +-{ah:.4f} at the first horizon, {b:+.4f} "
      f"+-{bh:.4f} at twice it; change {c:+.4f} [{c - ch:+.4f}, "
      f"{c + ch:+.4f}]: {verdict}"
    )
  return lines


def _saturation(rows) -> list[str]:
  out = [
    f"  - {r['arm']} ({r['scale_rule']}): {r['saturated_per_run']:,.0f} "
    "weights saturated per run (mean over seeds)"
    for r in rows
    if r.get("saturated_per_run") is not None and re.match(r"mx", r["weights"])
  ]
  return ["- MX write-back, saturated weights:"] + out if out else []


def confirm_figure(study, results="results", out=None) -> str:
  """Bytes per parameter against the loss difference to float32, per arm
  at the first horizon: the mean (marker) and its Holm-corrected one-sided
  upper bound (a bar up from the mean), the margin dashed; non-inferior
  arms filled."""
  from experiments.analysis import plotting
  from experiments.analysis.freeze_figures import _save
  from experiments.analysis.runs import load_runs

  runs = load_runs(results, study)
  margin = runs[0].config["study"].get("margin", frontier.MARGIN)
  rows, _ = confirm_table(runs)
  rows = [
    r
    for r in rows
    if r["loss_vs_fp32"] is not None and not r["arm"].endswith(LONG)
  ]
  fig, ax = plotting.plt.subplots(figsize=(8, 5.5))
  same: dict[float, list[str]] = {}
  for r in rows:
    same.setdefault(round(r["bytes_per_param"], 1), []).append(r["arm"])
  for i, r in enumerate(rows):
    group = same[round(r["bytes_per_param"], 1)]
    x = r["bytes_per_param"] + 0.15 * (
      group.index(r["arm"]) - (len(group) - 1) / 2
    )
    color = plotting.plt.cm.tab20(i % 20)
    mean = r["loss_vs_fp32"]
    up = r.get("holm_upper")  # none below 2 seeds
    ax.errorbar(
      x,
      mean,
      yerr=None if up is None else [[0], [up - mean]],
      fmt=plotting.arm_style(i, 1)["marker"],
      color=color,
      mfc=color if r.get("non_inferior") == "yes" else "none",
      ms=7,
      capsize=0,
      label=r["arm"],
    )
  ax.axhline(0, color="grey", lw=0.5)
  ax.axhline(margin, color="k", lw=0.8, ls="--", label=f"margin {margin}")
  ax.set_xlabel("bytes per parameter (weights, write-back state, moments)")
  ax.set_ylabel("final val loss - float32's (nats)")
  ax.set_yscale("symlog", linthresh=0.01)
  ax.set_title(
    f"{study}: mean and Holm one-sided upper bound; filled: non-inferior",
    fontsize=10,
  )
  plotting.legend_outside(ax)
  return _save(fig, study, results, out)

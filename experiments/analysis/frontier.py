"""The frontier study's table and figure: bytes per parameter against the
loss paid, per recipe, with intervals.

Every arm's final validation loss is paired with the float32 arm's of the
same seed; the table gives the mean difference and its 95% t-interval
over the seeds, the bytes per parameter (weights, write-back state and
AdamW's moments, counted per parameter group), whether the arm is on the
Pareto front, the predicted (from the float32 arm of the same seed) and
measured shares erased, lost and stalled over the second half of the
run, and the step time relative to nearest write-back. The float32 arm's
convergence (its validation loss moves by less than `CONVERGED` nats over
the last 20% of the steps) is checked per seed and reported.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import ml_collections
import numpy as np

import lowprec
from experiments import lowprec_config, tasks
from experiments.analysis import plotting
from experiments.analysis.runs import load_runs
from experiments.analysis.writeback_tables import recipe_bytes
from lowprec import recipes
from lowprec.freeze.advise import share
from lowprec.freeze.remedies import remedy_name

REFERENCE = "fp32"  # the float32 AdamW arm, carrying every trace
NEAREST = "bf16_rn"  # the arm step times and recoveries are relative to
CONVERGED = 0.01  # nats over the last 20% of the steps
TARGET_HALF_WIDTH = 0.01  # nats: the interval the design asks for

# Two-sided 95% quantiles of Student's t, by degrees of freedom.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447,
         7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}  # fmt: skip


def interval(diffs) -> tuple[float | None, float | None]:
  """Mean and 95% t half-width of paired differences (None below 2)."""
  d = np.asarray([x for x in diffs if x is not None], float)
  if d.size == 0:
    return None, None
  if d.size < 2:
    return float(d.mean()), None
  t = _T975.get(d.size - 1, 1.96)
  return float(d.mean()), float(t * d.std(ddof=1) / math.sqrt(d.size))


def _window(run, frac: float = 0.5) -> list[dict]:
  """The step records of the run's last `frac` of the steps."""
  steps = run.config["train"]["steps"]
  first = steps - round(steps * frac)
  return [r for r in run.metrics if r.get("step", 0) > first and "loss" in r]


def _ratio(num, den):
  return num / den if den else None


def _sum(records, key) -> float:
  return float(sum(r.get(key, 0) or 0 for r in records))


def measured(run) -> dict:
  """Measured shares over the second half: erased (a proposal leaves the
  weight where it was), lost (Kahan: the residual dropped whole; nearest:
  the erased proposal) and nu stalled (a stored second moment's update
  that left its stored code as it was)."""
  recs = _window(run)
  lp = run.config["lowprec"]
  out = {}
  props = _sum(recs, "proposals")
  if props:
    erased = sum(
      (r.get("erased_fraction") or 0) * (r.get("proposals") or 0) for r in recs
    )
    out["erased"] = erased / props
    comp = lp.get("compensation", "none")
    if comp == "kahan":
      out["lost"] = _sum(recs, "lost") / props
    elif comp == "none" and lp["rounding"] == "nearest":
      out["lost"] = out["erased"]
  if lp.get("state"):
    out["nu_stalled"] = stalled_share(recs, "nu")
  return out


def stalled_share(recs, moment: str) -> float | None:
  """The share of a stored moment's changed values whose stored code
  stayed (`state/stalled_fraction/<path>` weighted by
  `state/changed/<path>`), over `recs`, for the paths of `moment`."""
  last = recs[-1] if recs else {}
  paths = [
    k[len("state/changed/") :] for k in last if k.startswith("state/changed/")
  ]
  paths = [p for p in paths if f"/{moment}/" in f"/{p}"]
  num = den = 0.0
  for r in recs:
    for p in paths:
      changed = r.get(f"state/changed/{p}") or 0
      frac = r.get(f"state/stalled_fraction/{p}")
      if changed and frac is not None and math.isfinite(frac):
        num += frac * changed
        den += changed
  return _ratio(num, den)


def recipe_of(lp: dict) -> str | None:
  """The `lowprec.recipes` name of a uniform arm's `lowprec` section
  (weights, and the moment store where it is one of `recipes.STATES`)."""
  weights = "float32" if not lp.get("writeback") else None
  defaults = lowprec_config.RECIPE_DEFAULTS
  for w in recipes.WEIGHTS.values():
    if weights is None and all(
      lp.get(k, d) == w.config.get(k, d) for k, d in defaults.items()
    ):
      weights = w.name
  if weights is None:
    return None
  rules = tuple(lp.get("state") or ())
  for s in recipes.STATES.values():
    if s.config == rules:
      return f"{weights}+{s.name}"
  return None


def _sizes(config: dict) -> dict[str, int]:
  """Elements per parameter path of the run's model (abstract init)."""
  c = ml_collections.ConfigDict(config)
  params = jax.eval_shape(tasks.build(c).init, jax.random.key(0))
  return lowprec.groups.leaf_sizes(params)


def arm_bytes(config: dict, sizes: dict[str, int]) -> float:
  """Bytes per parameter of an arm: a per-group arm's recipes weighted by
  their groups' sizes; a uniform arm's `recipe_bytes`, the parameters it
  keeps in float32 (`keep_float32`) counted at 4 bytes."""
  lp = config["lowprec"]
  total = sum(sizes.values())
  if lp.get("group_recipes"):
    groups = tuple(lp.get("groups") or ()) or None
    chosen = dict(e.split("=", 1) for e in lp["group_recipes"])
    members = lowprec.groups.members(list(sizes), groups)
    return (
      sum(
        recipes.bytes_per_param(chosen[g]) * sum(sizes[x] for x in xs)
        for g, xs in members.items()
      )
      / total
    )
  full = recipe_bytes(config)
  keep = lp.get("keep_float32")
  if not keep or not lp.get("writeback"):
    return full
  kept = sum(n for k, n in sizes.items() if re.fullmatch(keep, k))
  moments = recipe_bytes({**config, "lowprec": {**lp, "writeback": ""}}) - 4.0
  return (full * (total - kept) + (4.0 + moments) * kept) / total


def predicted(ref_run, config: dict, sizes: dict[str, int], cache) -> dict:
  """What the float32 run (same seed) predicted for this arm, over the
  parameters it rounds: erased and lost (`lowprec.freeze.advise`'s rows;
  a Kahan arm's erased share from its own trace) and nu stalled (its
  state trace's predicted stalls over the second half, every parameter's
  moments, which the store holds). `cache` keeps
  each reference's advice per grouping, shared by the arms."""
  lp = config["lowprec"]
  name = recipe_of(lp)
  if ref_run is None or name is None or name.startswith("float32+float32"):
    return {}
  keep = lp.get("keep_float32") or ""
  recs = [r for r in ref_run.metrics if "loss" in r]

  def advice(groups):
    key = (ref_run.path, groups)
    if key not in cache:
      # Shares of the reference's traces, not advice: any window (a smoke
      # run's too); the table reads no choice from it.
      cache[key] = lowprec.freeze.advise(
        recs, sizes, groups=groups, min_steps=1
      )
    return cache[key]

  weights, state = name.split("+")
  out = {}
  if weights != "float32":
    groups = ((("kept", keep),) if keep else ()) + (("grid", ".*"),)
    row = next(
      r
      for r in advice(groups).rows
      if r.group == "grid" and r.recipe == weights
    )
    w = recipes.WEIGHTS[weights]
    if w.rounding == "stochastic" and row.move is not None:
      out["erased"] = 1 - row.move
    elif w.compensation == "kahan":  # its own trace: the buffer's moves
      grid = [x for x in sizes if not (keep and re.fullmatch(keep, x))]
      trace = remedy_name(w.fmt, "kahan", w.buffer)
      out["erased"] = share(recs, trace, "erased_fraction", grid)
    elif w.compensation not in ("remainder",):
      out["erased"] = row.erased  # the grid's nearest share: a bound
    if row.lost is not None and w.compensation in ("none", "kahan"):
      if w.rounding == "nearest":
        out["lost"] = row.lost
  if state != "float32":  # the store holds every parameter's moments
    out["nu_stalled"] = _predicted_stalls(_window(ref_run), state, "nu")
  return out


def _predicted_stalls(recs, store: str, moment: str) -> float | None:
  """The share of `moment`'s updates that the float32 run predicted the
  store `store` to stall (`pred_state/<store>/stalled/<path>` over
  `.../changed/<path>`), over `recs`."""
  head = f"pred_state/{store}/changed/"
  num = den = 0.0
  for r in recs:
    for k, changed in r.items():
      path = k[len(head) :]
      if k.startswith(head) and f"/{moment}/" in f"/{path}/":
        stalled = r.get(f"pred_state/{store}/stalled/{path}")
        if stalled is not None and changed:
          num += stalled
          den += changed
  return _ratio(num, den)


def _pareto(points: dict[str, tuple[float, float]]) -> list[str]:
  """Arms no other arm beats on both bytes (<=) and mean loss (<), one
  strictly: the front, by increasing bytes."""
  front = []
  for a, (b, d) in points.items():
    beaten = any(
      (b2 <= b and d2 < d) or (b2 < b and d2 <= d)
      for k, (b2, d2) in points.items()
      if k != a
    )
    if not beaten:
      front.append(a)
  return sorted(front, key=lambda a: points[a][0])


def frontier_table(runs):
  """One row per arm (see the module docstring) and the lines that say
  what the front shows."""
  by_arm: dict[str, dict[int, object]] = {}
  for r in runs:
    by_arm.setdefault(r.arm, {})[r.seed] = r
  ref = by_arm.get(REFERENCE, {})
  nearest = by_arm.get(NEAREST, {})
  any_run = next(iter(runs))
  sizes = _sizes(any_run.config)
  loss = {
    a: {s: r.summary.get("final_val_loss") for s, r in seeds.items()}
    for a, seeds in by_arm.items()
  }
  rows, points, cache = [], {}, {}
  for arm, seeds in by_arm.items():
    cfg = next(iter(seeds.values())).config
    diffs = [
      loss[arm][s] - loss[REFERENCE][s]
      for s in seeds
      if loss[arm].get(s) is not None
      and loss.get(REFERENCE, {}).get(s) is not None
    ]
    mean, hw = interval(diffs)
    row = {
      "arm": arm,
      "seeds": len(diffs),
      "bytes_per_param": arm_bytes(cfg, sizes),
      "final_val_loss": _mean(loss[arm].values()),
      "loss_vs_fp32": mean,
      "half_width_95": hw,
    }
    if cfg["lowprec"].get("writeback") == "bfloat16" or arm == "mixed":
      ln, lf = loss.get(NEAREST, {}), loss.get(REFERENCE, {})
      rec = [
        (ln[s] - loss[arm][s]) / (ln[s] - lf[s])
        for s in seeds
        if s in ln and s in lf and ln[s] != lf[s]
      ]
      row["recovery"] = _mean(rec)
    meas = [measured(r) for r in seeds.values()]
    pred = [
      predicted(ref.get(s), r.config, sizes, cache) for s, r in seeds.items()
    ]
    for key in ("erased", "lost", "nu_stalled"):
      row[f"pred_{key}"] = _mean(p.get(key) for p in pred)
      row[key] = _mean(m.get(key) for m in meas)
    row["step_time_vs_nearest"] = _mean(
      nearest[s].summary["steps_per_s"] / r.summary["steps_per_s"]
      for s, r in seeds.items()
      if s in nearest and r.summary.get("steps_per_s")
    )
    rows.append(row)
    if mean is not None:
      points[arm] = (row["bytes_per_param"], mean)
  front = _pareto(points)
  for row in rows:
    row["on_front"] = "yes" if row["arm"] in front else ""
  rows.sort(key=lambda r: (r["bytes_per_param"], r["loss_vs_fp32"] or 0))
  study = any_run.config["study"]["name"]
  return rows, (
    _convergence(ref) + _summary_lines(rows, front) + _checked(rows, study)
  )


# The advisor's nats, predicted from the float32 arm before the other arms
# ran (scripts.advise --predict_arms), where a study has them.
MARGIN = 0.01  # nats: the advisor's default margin, its non-inferiority bound


def predictions_file(study: str) -> str:
  import configs

  here = os.path.dirname(os.path.abspath(configs.__file__))
  return os.path.join(here, "advice", f"{study}_predictions.json")


def _checked(rows, study: str) -> list[str]:
  """Per predicted arm, the prediction against the measured interval;
  the Spearman rank correlation of predicted and measured means; whether
  the advised arm is non-inferior at `MARGIN` (its interval's upper end
  at or below it)."""
  path = predictions_file(study)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    preds = json.load(f)
  by_arm = {r["arm"]: r for r in rows}
  lines = [f"- predictions ({os.path.basename(path)}), before the runs:"]
  pairs = []
  for arm, p in preds.items():
    r = by_arm.get(arm)
    if r is None or r["loss_vs_fp32"] is None or r["half_width_95"] is None:
      lines.append(f"  - {arm}: predicted {p['nats']:+.4f}, not measured")
      continue
    lo = r["loss_vs_fp32"] - r["half_width_95"]
    hi = r["loss_vs_fp32"] + r["half_width_95"]
    inside = "inside" if lo <= p["nats"] <= hi else "outside"
    lines.append(
      f"  - {arm}: predicted {p['nats']:+.4f} +- {p['se']:.4f}, measured "
      f"{r['loss_vs_fp32']:+.4f} [{lo:+.4f}, {hi:+.4f}]: {inside} the "
      f"interval ({p['how']})"
    )
    pairs.append((p["nats"], r["loss_vs_fp32"]))
    if arm == "advised":
      ok = hi <= MARGIN
      lines.append(
        f"  - advised non-inferior at {MARGIN} nats: "
        + ("yes" if ok else "no")
        + f" (upper end {hi:+.4f})"
      )
  if len(pairs) >= 3:
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    a, b = zip(*pairs, strict=True)
    rho = float(np.corrcoef(rank(np.array(a)), rank(np.array(b)))[0, 1])
    lines.append(
      f"  - Spearman rank correlation of predicted and measured means over "
      f"{len(pairs)} arms: {rho:+.2f}"
    )
  return lines


def _mean(values):
  v = [x for x in values if x is not None and np.isfinite(x)]
  return float(np.mean(v)) if v else None


def _convergence(ref: dict) -> list[str]:
  """Whether float32's validation loss moved by less than `CONVERGED` over
  the last 20% of the steps, per seed."""
  lines = []
  for s, run in sorted(ref.items()):
    steps, val = run.curve("val_loss")
    if not steps.size:
      continue
    last = steps[-1]
    at = steps[steps <= last - 0.2 * run.config["train"]["steps"]]
    if not at.size:
      continue
    before = val[steps == at[-1]][0]
    change = val[-1] - before
    ok = abs(change) < CONVERGED
    lines.append(
      f"- float32 seed {s}: val loss {before:.4f} at step {at[-1]} -> "
      f"{val[-1]:.4f} at {last} ({change:+.4f} nats): "
      + ("converged" if ok else f"NOT converged (|change| >= {CONVERGED})")
    )
  return lines


def _summary_lines(rows, front) -> list[str]:
  lines = []
  wide = [
    r["arm"]
    for r in rows
    if r["half_width_95"] is not None and r["half_width_95"] > TARGET_HALF_WIDTH
  ]
  if wide:
    lines.append(
      f"- intervals wider than +-{TARGET_HALF_WIDTH}: {', '.join(wide)}"
    )
  lines.append("- Pareto front (by mean): " + ", ".join(front))
  for r in rows:
    if r["arm"] == REFERENCE:
      continue
    if r["loss_vs_fp32"] is None or r["half_width_95"] is None:
      continue
    lo = r["loss_vs_fp32"] - r["half_width_95"]
    hi = r["loss_vs_fp32"] + r["half_width_95"]
    verdict = (
      "costs loss" if lo > 0 else "better than float32" if hi < 0 else
      "not told apart from float32"
    )  # fmt: skip
    lines.append(
      f"- {r['arm']} ({r['bytes_per_param']:.2f} B/param): "
      f"{r['loss_vs_fp32']:+.4f} [{lo:+.4f}, {hi:+.4f}] nats, {verdict}"
    )
  return lines


def frontier_figure(study, results="results", out=None) -> str:
  """Bytes per parameter against the loss difference to float32 (mean
  and 95% interval over seeds), one point per arm (arms of equal bytes
  drawn side by side), the front drawn."""
  from experiments.analysis.freeze_figures import _save

  runs = load_runs(results, study)
  rows, _ = frontier_table(runs)
  rows = [r for r in rows if r["loss_vs_fp32"] is not None]
  fig, ax = plotting.plt.subplots(figsize=(8, 5.5))
  # Arms at the same bytes side by side (0.15 bytes apart), not on top.
  same: dict[float, list[str]] = {}
  for r in rows:
    same.setdefault(round(r["bytes_per_param"], 1), []).append(r["arm"])
  for i, r in enumerate(rows):
    style = plotting.arm_style(i, 1)
    group = same[round(r["bytes_per_param"], 1)]
    dodge = 0.15 * (group.index(r["arm"]) - (len(group) - 1) / 2)
    ax.errorbar(
      r["bytes_per_param"] + dodge,
      r["loss_vs_fp32"],
      yerr=r["half_width_95"] or None,
      fmt=style["marker"],
      color=plotting.plt.cm.tab20(i % 20),  # 20 arms, 20 colours
      mfc="none",
      ms=7,
      capsize=0,  # caps of a narrow interval would overlap
      label=r["arm"],
    )
  front = [r for r in rows if r["on_front"]]
  ax.plot(
    [r["bytes_per_param"] for r in front],
    [r["loss_vs_fp32"] for r in front],
    color="k",
    lw=0.8,
    ls="--",
    label="Pareto front",
  )
  ax.axhline(0, color="grey", lw=0.5)
  ax.set_xlabel("bytes per parameter (weights, write-back state, moments)")
  ax.set_ylabel("final val loss - float32's (nats)")
  ax.set_yscale("symlog", linthresh=0.01)
  ax.set_title(f"{study}: memory against loss, 95% intervals", fontsize=10)
  plotting.legend_outside(ax)
  return _save(fig, study, results, out)

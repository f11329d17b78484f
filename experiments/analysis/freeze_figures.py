"""Figures of the freeze studies that a per-run panel does not show (PNG).

`FIGURES` names each figure a study can declare: crossing scatter (predicted vs
measured, log-log) for the grid and the mantissa sweep, validation loss for
the dead-zone study and the int3 replays, erased fraction and loss for the
FP8 study, the one-trace-many-seeds curves of the E4M3 audit, and
`freeze_panels`, one panel per low-precision run (the default).
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402

from experiments.analysis import audit_tables as at  # noqa: E402
from experiments.analysis import (
  freeze_panels,  # noqa: E402
  plotting,  # noqa: E402
)
from experiments.analysis import freeze_tables as fa  # noqa: E402
from experiments.analysis import state_tables as st  # noqa: E402
from experiments.analysis import writeback_tables as wt  # noqa: E402
from experiments.analysis.runs import load_runs  # noqa: E402


def _save(fig, study, results, out) -> str:
  out = out or os.path.join(results, study, "tables")
  return plotting.save(fig, os.path.join(out, f"{study}.png"))


def _crossings(runs, group):
  """(group, predicted step, measured step) of cells with both post-init."""
  rows, _ = fa.freeze_table(runs)
  pts = []
  for r in rows:
    if r.get("within_tol") is None:
      continue
    p = int(r["predicted_crossing"].split()[0])
    m = int(r["measured_crossing"].split()[0])
    pts.append((group(r), p, m))
  return rows, pts


def crossing_scatter(study, results="results", out=None, group=None) -> str:
  """Predicted vs measured post-init crossing step per cell, log-log."""
  runs = load_runs(results, study)
  group = group or (lambda r: r["format"])
  rows, pts = _crossings(runs, group)
  fig, ax = plt.subplots(figsize=(6, 5))
  if pts:
    lo = min(min(p, m) for _, p, m in pts) / 1.5
    hi = max(max(p, m) for _, p, m in pts) * 1.5
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, color="grey", lw=0.8)
    ax.fill_between(xs, xs / 1.15, xs * 1.15, color="grey", alpha=0.15)
    for i, g in enumerate(dict.fromkeys(g for g, _, _ in pts)):
      mine = [(p, m) for gg, p, m in pts if gg == g]
      ax.scatter(
        [m for _, m in mine], [p for p, _ in mine], s=14, color=f"C{i}", label=g
      )
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
      axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
      axis.set_minor_formatter(ticker.NullFormatter())
    ax.legend(fontsize=8)
  else:
    ax.text(
      0.5,
      0.5,
      "no cell crosses after init\nin both curves",
      ha="center",
      va="center",
      transform=ax.transAxes,
    )
  cats = [r.get("category_agrees") for r in rows]
  steps = [m for _, _, m in pts]
  late = [m for m in steps if m > fa.EARLY_STEP]
  ax.set_title(
    f"{study}: {len(pts)}/{len(rows)} cells post-init in both; "
    f"{sum(not c for c in cats if c is not None)} categories differ\n"
    f"measured span {fa.span(steps) or 'n/a'}; "
    f"{len(steps) - len(late)} at step {fa.EARLY_STEP}, the rest span "
    f"{fa.span(late) or 'n/a'}",
    fontsize=8,
  )
  ax.set_xlabel("measured crossing step")
  ax.set_ylabel("predicted crossing step (fp32 trace)")
  return _save(fig, study, results, out)


def transfer_scatter(study, results="results", out=None) -> str:
  return crossing_scatter(
    study, results, out, group=lambda r: r["cell"].split("/")[0]
  )


def _val_panel(ax, runs, title: str) -> None:
  """Validation loss vs step of every arm (one colour per arm, a line per
  seed)."""
  arms = list(dict.fromkeys(r.arm for r in runs))
  for i, arm in enumerate(arms):
    for j, run in enumerate(r for r in runs if r.arm == arm):
      s, v = _val(run)
      style = plotting.arm_style(i, len(s))
      ax.plot(s, v, label=arm if j == 0 else None, **style)
  ax.set_xlabel("step")
  ax.set_ylabel("validation loss")
  plotting.loss_axes(ax)
  plotting.legend_outside(ax)
  ax.set_title(title, fontsize=10)


def remedies_figure(study, results="results", out=None) -> str:
  """Validation loss of every arm (float32, mixed precision, the plain and
  the compensated write-backs), a line per seed; beside it, the share of
  proposals erased from the weight per step of every write-back arm, the
  mean over seeds."""
  runs = load_runs(results, study)
  arms = list(dict.fromkeys(r.arm for r in runs))
  erased = {}
  for i, arm in enumerate(arms):
    curves = [r.curve("erased_fraction") for r in runs if r.arm == arm]
    curves = [c for c in curves if c[0].size]
    if curves:
      steps = curves[0][0]
      same = [c[1] for c in curves if np.array_equal(c[0], steps)]
      erased[arm] = (i, steps, np.mean(same, axis=0))
  # Without a write-back arm's telemetry there is no second panel.
  fig, axes = plt.subplots(
    2 if erased else 1, 1, figsize=(8, 7.5 if erased else 4), squeeze=False
  )
  _val_panel(axes[0][0], runs, f"{study}: validation loss")
  if erased:
    ex = axes[1][0]
    for arm, (i, steps, mean) in erased.items():
      ex.plot(steps, mean, label=arm, **plotting.arm_style(i, len(steps)))
    ex.set_xlabel("step")
    ex.set_ylabel("share of proposals erased")
    ex.set_title("erased from the weight, mean over seeds", fontsize=10)
    ex.set_ylim(-0.02, 1.02)
    plotting.legend_outside(ex)
  return _save(fig, study, results, out)


def recovery_figure(study, results="results", out=None) -> str:
  """Validation loss of every arm; beside it, the matched-seed difference
  dead-zone minus full SR of the final validation loss, per seed, with
  its mean and +-1 sd."""
  runs = load_runs(results, study)
  rows, _ = wt.recovery_table(runs)
  fig, (ax, dx) = plt.subplots(2, 1, figsize=(8, 7.5))
  _val_panel(ax, runs, f"{study}: validation loss")
  pts = [(r["seed"], r["deadzone_minus_full_sr"]) for r in rows]
  pts = [(s, d) for s, d in pts if d is not None]
  if pts:
    seeds, d = zip(*pts, strict=True)
    x = np.arange(len(d))
    dx.bar(x, d, color=["C2" if v < 0 else "C3" for v in d])
    dx.set_xticks(x, [f"seed {s}" for s in seeds])
    m = float(np.mean(d))
    sd = float(np.std(d, ddof=1)) if len(d) > 1 else 0.0
    dx.axhline(m, color="k", lw=1)
    dx.axhspan(m - sd, m + sd, color="grey", alpha=0.2)
    neg = sum(v < 0 for v in d)
    dx.set_title(
      f"mean {m:+.4f}, sd {sd:.4f}; negative in {neg}/{len(d)} seeds",
      fontsize=10,
    )
  else:
    dx.text(0.5, 0.5, "no seed with both stochastic arms", ha="center",
            va="center", transform=dx.transAxes)  # fmt: skip
  dx.axhline(0, color="grey", lw=0.5)
  dx.set_ylabel("L dead-zone SR - L full SR (nats)")
  return _save(fig, study, results, out)


def _val(run):
  pts = [(r["step"], r["val_loss"]) for r in run.metrics if "val_loss" in r]
  s, v = zip(*pts, strict=True) if pts else ((), ())
  return np.asarray(s), np.asarray(v, float)


def replay_curves(study, results="results", out=None) -> str:
  """One panel per quantizer: the reference's validation loss, and each
  replay's from its checkpoint on (step 0 of a replay drawn at its
  checkpoint step), stochastic solid, nearest dashed; the uniform loss
  ln V as a grey line."""
  runs = load_runs(results, study)
  ref = [r for r in runs if not r.config["train"].get("init_from_arm")]
  reps = [r for r in runs if r.config["train"].get("init_from_arm")]
  quants = list(dict.fromkeys(wt.quantizer(r.config) for r in reps))
  fig, axes = plt.subplots(
    1,
    max(len(quants), 1),
    figsize=(5 * max(len(quants), 1), 4.5),
    squeeze=False,
  )
  rows, _ = wt.replay_table(runs)
  for ax, q in zip(axes[0], quants, strict=False):
    for run in ref:
      s, v = _val(run)
      ax.plot(s, v, color="k", lw=1.2, label=f"{run.arm} (fp32)")
    for run in (r for r in reps if wt.quantizer(r.config) == q):
      rn = run.config["lowprec"]["rounding"] == "nearest"
      s, v = _val(run)
      ax.plot(
        run.config["train"]["init_from_step"] + s,
        v,
        color="C3" if rn else "C0",
        lw=1,
        ls="--" if rn else "-",
        marker=".",
        ms=3,
      )
    vocab = reps[0].config.get("model", {}).get("vocab_size")
    if vocab:
      ax.axhline(np.log(vocab), color="grey", lw=0.6, label=f"ln {vocab}")
    ax.plot([], [], color="C0", label="int3 stochastic replay")
    ax.plot([], [], color="C3", ls="--", label="int3 nearest replay")
    mine = [r for r in rows if r["quantizer"] == q]
    ax.set_title(f"{study}: {q}\n{_reductions(mine)}", fontsize=8)
    ax.set_xlabel("data step")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
  return _save(fig, study, results, out)


def _reductions(rows) -> str:
  """`mean reduction SR 12.9%, RN 0.0%; SR - RN -0.365 nats`."""
  out = []
  for key, label in (
    ("stochastic_reduction", "SR"),
    ("nearest_reduction", "RN"),
  ):
    xs = [r[key] for r in rows if r[key] is not None]
    if xs:
      out.append(f"{label} {np.mean(xs):.1%}")
  d = [r["sr_minus_rn"] for r in rows if r["sr_minus_rn"] is not None]
  text = "mean reduction " + ", ".join(out) if out else ""
  return text + (f"; SR - RN {np.mean(d):+.3f} nats" if d else "")


def fp8_panels(study, results="results", out=None) -> str:
  """Per format: erased fraction predicted and measured under nearest,
  move probability predicted and measured under stochastic; below, the
  validation loss of every arm (one colour per arm, one line per seed)."""
  runs = load_runs(results, study)
  low = [r for r in runs if r.config["lowprec"]["writeback"]]
  formats = list(dict.fromkeys(r.config["lowprec"]["writeback"] for r in low))
  arms = list(dict.fromkeys(r.arm for r in runs))
  fig, axes = plt.subplots(
    2, max(len(formats), 1), figsize=(4.6 * len(formats), 7), squeeze=False
  )
  for i, fmt in enumerate(formats):
    ax = axes[0][i]
    seen = set()

    def once(label, seen=seen):
      return None if label in seen or seen.add(label) else label

    for run in (r for r in low if r.config["lowprec"]["writeback"] == fmt):
      ref = fa.reference_for(run, runs)
      if run.config["lowprec"]["rounding"] == "nearest":
        s, e = fa.measured(run)
        ax.plot(s, e, color="C0", lw=1, label=once("erased, measured (RN)"))
        ps, p = fa.predicted(ref, fmt)
        ax.plot(
          ps, p, color="C1", ls="--", lw=1, label=once("erased, predicted")
        )
      else:
        s, mp = fa.move_prob(run)
        ax.plot(s, mp, color="C2", lw=1, label=once("moved, measured (SR)"))
        ps, p = fa.predicted(ref, fmt, "stochastic")
        ax.plot(
          ps, p, color="C3", ls="--", lw=1, label=once("moved, predicted")
        )
    ax.axhline(0.5, color="grey", lw=0.5)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{fmt}: share of proposals per step", fontsize=10)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    lx = axes[1][i]
    labelled = set()
    for run in runs:
      lp = run.config["lowprec"]
      if lp["writeback"] not in ("", fmt):
        continue
      s, v = _val(run)
      label = None if run.arm in labelled else run.arm
      labelled.add(run.arm)
      style = plotting.arm_style(arms.index(run.arm), len(s))
      lx.plot(s, v, label=label, **style)
    plotting.loss_axes(lx)
    lx.set_xlabel("step")
    lx.set_ylabel("validation loss")
    lx.legend(fontsize=7)
  return _save(fig, study, results, out)


def audit_curves(study, results="results", out=None) -> str:
  """One column per batch size. Top: each unseen seed's measured erased
  fraction (solid), its own fp32 trace (the matched reference, dotted) and
  the one reused source trace (black, dashed). Bottom: the same as
  deviations from the common time course c (the mean measured curve),
  where directional specificity is read off."""
  runs = load_runs(results, study)
  rows, _ = at.audit_table(runs)
  variants = at.variants(runs)
  ncol = max(len(variants), 1)
  fig, axes = plt.subplots(
    2, ncol, figsize=(5 * ncol, 7), sharex=True, squeeze=False
  )
  for col, (arm, group) in enumerate(variants.items()):
    mine = [r for r in rows if r["arm"] == arm]
    _audit_column(axes[0][col], axes[1][col], group, runs, mine)
  return _save(fig, study, results, out)


def _audit_column(ax, dx, group, runs, rows) -> None:
  curves = [at.seed_curves(run, runs) for run in group]
  n = min(len(c[0]) for c in curves)
  steps = fa.measured(group[0])[0][:n]
  c = np.mean([e[:n] for e, _, _ in curves], axis=0)
  for i, (run, (e, _, pk)) in enumerate(zip(group, curves, strict=True)):
    ax.plot(
      steps, e[:n], lw=0.8, color=f"C{i}", label=f"measured, seed {run.seed}"
    )
    dx.plot(steps, e[:n] - c, lw=0.8, color=f"C{i}")
    if pk is not None:
      ax.plot(steps, pk[:n], lw=0.8, ls=":", color=f"C{i}")
      dx.plot(steps, pk[:n] - c, lw=0.8, ls=":", color=f"C{i}")
  p = curves[0][1][:n]
  ax.plot(steps, p, color="k", ls="--", lw=1, label="source trace (reused)")
  ax.plot([], [], color="grey", ls=":", label="matched fp32 trace")
  dx.plot(steps, p - c, color="k", ls="--", lw=1)
  ax.set_ylabel("erased fraction")
  ax.legend(fontsize=7)
  ax.set_title(_audit_title(group[0], rows), fontsize=8)
  dx.axhline(0, color="grey", lw=0.5)
  dx.set_ylabel("minus the mean measured curve")
  dx.set_xlabel("step")


def _audit_title(run, rows) -> str:
  def mean(key):
    xs = [r[key] for r in rows if r.get(key) is not None]
    return f"{np.mean(xs):.4f}" if xs else "n/a"

  def verdict(key):
    xs = [r.get(key) for r in rows]
    if any(x is None for x in xs):
      return "n/a"
    return "passes" if all(x > 0 for x in xs) else "fails"

  return (
    f"{run.arm} (batch {rows[0]['batch_size']}): RMSE source "
    f"{mean('rmse')}, matched {mean('matched_rmse')}, floor "
    f"{mean('noise_floor')}\nspecificity: source "
    f"{verdict('source_specificity_corr')}, matched "
    f"{verdict('matched_specificity_corr')}"
  )


def user_reports_panels(study, results="results", out=None) -> str:
  """Per group of tensors: the share of coordinates at their initial value
  against the step, predicted by the float32 trace (every step) and
  measured on each write-back run's checkpoints; last panel: the share of
  erased proposals that are weight decay only, predicted and measured."""
  from experiments.analysis import user_reports as ur

  runs = load_runs(results, study)
  groups, steps = ur._groups(runs)
  seed = min(r.seed for r in runs)
  by = {r.arm: r for r in runs if r.seed == seed}
  ref = by.get("fp32_reference")
  total = runs[0].config["train"]["steps"]
  every = range(1, total + 1, max(1, total // 100))
  pred = ur.predicted_at_init(ref, every, groups) if ref else {}
  meas = {
    arm: ur.measured_at_init(by[arm], steps, groups)
    for arm in ("nearest", "stochastic", "deadzone")
    if arm in by
  }
  ncol = min(3, len(groups) + 1)
  nrow = -(-(len(groups) + 1) // ncol)
  fig, grid = plt.subplots(
    nrow, ncol, figsize=(3.4 * ncol, 3.2 * nrow), squeeze=False
  )
  axes = list(grid.flat)
  for ax in axes[len(groups) + 1 :]:
    ax.set_visible(False)  # the grid's unused cells
  for ax, (_, group) in zip(axes, groups, strict=False):
    xs = sorted(pred)
    ax.plot(
      xs, [pred[x].get(group) for x in xs], "k--", lw=1, label="predicted (RN)"
    )
    for i, (arm, m) in enumerate(meas.items()):
      ms = sorted(m)
      ax.plot(
        ms,
        [m[x].get(group) for x in ms],
        "os^"[i % 3],
        ms=7 - 1.5 * i,
        mfc="none",
        color=f"C{i}",
        label=arm,
      )
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(group, fontsize=10)
    ax.set_xlabel("step")
  for row in grid:
    row[0].set_ylabel("share still at its initial value")
  axes[0].legend(fontsize=8)
  ax = axes[len(groups)]
  names = [g for _, g in groups]
  p = ur.decay_only_share(ref, groups) if ref else {}
  m = ur.decay_only_share(by["nearest"], groups) if "nearest" in by else {}
  y = np.arange(len(names))
  ax.barh(y - 0.2, [p.get(n, np.nan) for n in names], 0.4, label="predicted")
  ax.barh(y + 0.2, [m.get(n, np.nan) for n in names], 0.4, label="nearest")
  ax.set_yticks(y, names)
  ax.invert_yaxis()  # the groups in the order of the other panels
  ax.set_xlim(0, 1.05)
  ax.set_xlabel("share of erased proposals")
  ax.set_title("weight decay only", fontsize=10)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
  return _save(fig, study, results, out)


def state_figure(study, results="results", out=None) -> str:
  """Validation loss of every arm; below it, the share of the second
  moment's updates erased by storage per step, measured (one line per
  seed) and predicted by the float32-state run (black, dashed)."""
  runs = load_runs(results, study)
  fig, (ax, ex) = plt.subplots(2, 1, figsize=(8, 7.5))
  _val_panel(ax, runs, f"{study}: validation loss")
  by_key = {(r.arm, r.seed): r for r in runs}
  arms = list(dict.fromkeys(r.arm for r in runs))
  predicted = False
  for arm in arms:
    i = arms.index(arm)
    for j, run in enumerate(r for r in runs if r.arm == arm):
      if not run.config["lowprec"].get("state"):
        continue
      nu = st.moment_curves(run, "state").get("nu")
      if nu is not None:
        style = {**plotting.arm_style(i, len(nu[0])), "ls": "-"}
        ex.plot(*nu, label=arm if j == 0 else None, **style)
      st_cfg = run.config["study"]
      ref = by_key.get((st_cfg.get("reference_arm"), run.seed))
      if ref is not None and st_cfg.get("cell"):
        pred = st.moment_curves(ref, f"pred_state/{st_cfg['cell']}")
        if "nu" in pred:
          label = None if predicted else "predicted (float32 state)"
          ex.plot(*pred["nu"], color="k", lw=0.8, ls="--", label=label)
          predicted = True
  ex.set_xlabel("step")
  ex.set_ylabel("share of nu's updates erased")
  ex.set_title("second moment: updates erased by storage", fontsize=10)
  ex.set_ylim(-0.02, 1.02)
  if not ex.lines:
    ex.text(0.5, 0.5, "no arm stores its state", ha="center",
            va="center", transform=ex.transAxes)  # fmt: skip
  plotting.legend_outside(ex)
  return _save(fig, study, results, out)


# figure name (a study's `study.figure`) -> (study, results, out) -> PNG path
FIGURES = {
  "freeze_panels": freeze_panels.plot,
  "fp8_panels": fp8_panels,
  "crossing_scatter": crossing_scatter,
  "transfer_scatter": transfer_scatter,
  "recovery_figure": recovery_figure,
  "remedies_figure": remedies_figure,
  "replay_curves": replay_curves,
  "audit_curves": audit_curves,
  "user_reports_panels": user_reports_panels,
  "state_figure": state_figure,
}

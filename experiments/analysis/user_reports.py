"""The `freeze_user_reports` study: parameters left at init, per group.

Predicted: the float32 reference run's trace (`pred/<fmt>/at_init/<leaf>`
counts, summed over a group's tensors). Measured: each write-back run's
checkpoints against its initial params (rebuilt from its config: the same
seed gives the same init), per coordinate over the checkpoints so far. The
weight-decay-only share of erased proposals: `decay/decay_only/<leaf>` over
`decay/erased/<leaf>`, summed over a group and over every step of the run,
predicted in the reference run and measured in the nearest run.
"""

from __future__ import annotations

import os

import jax
import ml_collections
import numpy as np

import lowprec

TOLERANCE = 0.05  # predicted vs measured share, per group and step
STUCK_MAX = 0.05  # SR / dead-zone: no group above this share from step 200


def _groups(runs) -> tuple:
  """The study's groups, and its steps that the runs reached (at a smaller
  scale: every checkpoint step)."""
  c = runs[0].config
  total, every = c["train"]["steps"], c["ckpt"]["every_steps"]
  steps = [s for s in c["study"]["report_steps"] if s <= total]
  if len(steps) < 2:
    steps = list(range(every, total + 1, every))
  return tuple(tuple(g) for g in c["study"]["groups"]), steps


def _grouping(groups):
  """`leaf name -> group` by the study's rules; None for other leaves."""
  return lowprec.engine.weights.rule_lookup(
    [*groups, (r".*", None)],
    lambda group: group,
    what="group rule",
    fix="end the rules with a catch-all",
  )


def _config(run):
  return ml_collections.ConfigDict(run.config)


def initial_params(run):
  """The run's params at step 0, rebuilt from its config.json."""
  from experiments import train

  return train.build_run(_config(run)).state.params


def _sizes(run) -> dict[str, int]:
  """Coordinates per parameter tensor, by name (shapes only, no arrays)."""
  from experiments import tasks

  shapes = jax.eval_shape(tasks.build(_config(run)).init, jax.random.key(0))
  return {
    lowprec.engine.weights.path_name(p): x.size
    for p, x in jax.tree_util.tree_leaves_with_path(shapes)
  }


def _checkpoint_params(run, step: int, like):
  from experiments import checkpoint

  return checkpoint.restore_params(
    os.path.join(run.path, "checkpoints"), step, like
  )


def measured_at_init(run, steps, groups) -> dict:
  """{step: {group: share}} from the run's checkpoints: coordinates equal
  to their initial value at that checkpoint and every earlier one (a
  coordinate seen away from init once has moved; one that moved and came
  back between two checkpoints still counts, so this is an upper bound on
  "never moved"). `lowprec.freeze.stuck` of each checkpoint alone gives
  the share at init now, which under stochastic write-back also counts
  weights that returned."""
  like = initial_params(run)
  init = jax.device_get(like)
  group_of = _grouping(groups)
  still = None
  out = {}
  for step in steps:
    try:
      now = jax.device_get(_checkpoint_params(run, step, like))
    except FileNotFoundError:
      continue
    same = jax.tree.map(lambda a, b: np.asarray(a) == np.asarray(b), init, now)
    still = same if still is None else jax.tree.map(np.logical_and, still, same)
    counts: dict[str, list[int]] = {}
    for path, kept in jax.tree_util.tree_leaves_with_path(still):
      group = group_of(lowprec.engine.weights.path_name(path))
      if group is not None:
        c = counts.setdefault(group, [0, 0])
        c[0] += int(kept.sum())
        c[1] += kept.size
    out[step] = {g: a / n for g, (a, n) in counts.items()}
  return out


def predicted_at_init(run, steps, groups) -> dict:
  """{step: {group: share}} from the reference run's trace."""
  sizes = _sizes(run)
  group_of = _grouping(groups)
  target = run.config["lowprec"]["trace_targets"][0].partition(":")[0]
  prefix = f"pred/{target}/at_init/"
  lines = {r.get("step"): r for r in run.metrics}
  out = {}
  for step in steps:
    kept: dict[str, list[int]] = {}
    for key, value in lines.get(step, {}).items():
      if not key.startswith(prefix):
        continue
      leaf = key[len(prefix) :]
      group = group_of(leaf)
      if group is None:
        continue
      k = kept.setdefault(group, [0, 0])
      k[0] += int(value)
      k[1] += sizes[leaf]
    if kept:
      out[step] = {g: a / n for g, (a, n) in kept.items()}
  return out


def decay_only_share(run, groups) -> dict:
  """{group: decay-only erased / erased}, over every step of the run."""
  group_of = _grouping(groups)
  sums: dict[str, list[int]] = {}
  for line in run.metrics:
    for key, value in line.items():
      if not key.startswith("decay/erased/"):
        continue
      leaf = key[len("decay/erased/") :]
      group = group_of(leaf)
      if group is None:
        continue
      s = sums.setdefault(group, [0, 0])
      s[0] += int(line[f"decay/decay_only/{leaf}"])
      s[1] += int(value)
  return {g: (a / n if n else float("nan")) for g, (a, n) in sums.items()}


def user_reports_table(runs):
  """Rows: group x step (share at init, predicted and per arm measured),
  then group x "decay only" (share of erased proposals, over the run)."""
  groups, steps = _groups(runs)
  by = {(r.arm, r.seed): r for r in runs}
  rows, lines, worst, stuck_sr = [], [], 0.0, 0.0
  for seed in sorted({r.seed for r in runs}):
    ref = by.get(("fp32_reference", seed))
    pred = predicted_at_init(ref, steps, groups) if ref else {}
    meas = {
      arm: measured_at_init(by[(arm, seed)], steps, groups)
      for arm in ("nearest", "stochastic", "deadzone")
      if (arm, seed) in by
    }
    for _, group in groups:
      for step in steps:
        row = {"seed": seed, "group": group, "step": step}
        p = pred.get(step, {}).get(group)
        row["at_init_predicted"] = p
        for arm, m in meas.items():
          row[f"at_init_{arm}"] = m.get(step, {}).get(group)
        n = row.get("at_init_nearest")
        if p is not None and n is not None:
          row["error"] = abs(p - n)
          worst = max(worst, row["error"])
        for arm in ("stochastic", "deadzone"):
          v = row.get(f"at_init_{arm}")
          if v is not None and step >= 200:
            stuck_sr = max(stuck_sr, v)
        rows.append(row)
    decay_pred = decay_only_share(ref, groups) if ref else {}
    near = by.get(("nearest", seed))
    decay_meas = decay_only_share(near, groups) if near else {}
    for _, group in groups:
      rows.append(
        {
          "seed": seed,
          "group": group,
          "step": "decay only, whole run",
          "at_init_predicted": decay_pred.get(group),
          "at_init_nearest": decay_meas.get(group),
          "error": _err(decay_pred.get(group), decay_meas.get(group)),
        }
      )
  errors = [r["error"] for r in rows if r.get("error") is not None]
  overall = max(errors, default=float("nan"))
  verdict = "met" if overall <= TOLERANCE else "NOT met"
  lines.append(
    f"- largest |predicted - measured| (nearest): {worst:.4f} for the share"
    f" at init, {overall:.4f} overall; tolerance {TOLERANCE} ({verdict})"
  )
  lines.append(
    f"- largest share at init of any group under stochastic or dead-zone "
    f"write-back from step 200: {stuck_sr:.4f} (limit {STUCK_MAX}: "
    f"{'none stuck' if stuck_sr <= STUCK_MAX else 'STUCK'})"
  )
  return rows, lines


def _err(a, b):
  if a is None or b is None or np.isnan(a) or np.isnan(b):
    return None
  return abs(a - b)

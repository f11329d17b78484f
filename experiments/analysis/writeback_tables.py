"""Loss effects of the write-back rounding: result runs -> (rows, lines).

* `recovery_table`: how much of the nearest-rounding loss gap full and
  dead-zone stochastic write-back recover, and their matched-seed
  difference (`deadzone_vs_sr`).
* `remedies_table`: final validation loss of the compensated write-backs
  (Kahan, two-component, remainder) and a mixed-precision baseline beside
  float32 and nearest write-back, the share of the nearest-rounding
  loss gap each recovers, and, where the float32 run predicted them
  (`lowprec.trace_targets`, `lowprec.trace_remedies`), the predicted
  against the measured erased and lost fractions (`remedies`).
* `replay_table`: write-back replayed from a float32 reference's
  checkpoints, per quantizer and checkpoint: relative reduction of the
  validation loss, stochastic minus nearest (`int3_replay`).
"""

from __future__ import annotations

import math

import numpy as np

from experiments.analysis.freeze_tables import val_at
from lowprec.freeze import remedy_name
from lowprec.grids.formats import get_format, get_scaled_format, is_scaled
from lowprec.optim.stored_state import parse_rules, parse_state_format

KINDS = ("fp32", "nearest", "stochastic", "deadzone")
SR_ARMS = (("stochastic", "full_sr"), ("deadzone", "deadzone_sr"))


def _final_losses(runs) -> dict[int, dict[str, float]]:
  """{seed: {kind: final val loss}}, kind a rounding or `fp32`."""
  by_seed: dict[int, dict[str, float]] = {}
  for run in runs:
    lp = run.config["lowprec"]
    kind = lp["rounding"] if lp["writeback"] else "fp32"
    by_seed.setdefault(run.seed, {})[kind] = run.last("val_loss")
  return by_seed


def _recovery_row(seed: int, loss: dict) -> dict:
  row = {"seed": seed}
  for k in KINDS:
    row[f"val_loss_{k}"] = loss.get(k)
  if all(loss.get(k) is not None for k in ("fp32", "nearest")):
    gap = loss["nearest"] - loss["fp32"]
    row["rn_gap"] = gap
    for k, name in SR_ARMS:
      if loss.get(k) is not None and gap:
        row[f"recovery_{name}"] = (loss["nearest"] - loss[k]) / gap
  if all(loss.get(k) is not None for k in ("stochastic", "deadzone")):
    row["deadzone_minus_full_sr"] = loss["deadzone"] - loss["stochastic"]
  return row


def recovery_table(runs):
  """Recovery of the nearest-rounding loss gap, per seed:
  `(L_RN - L_x) / (L_RN - L_fp32)` for full and dead-zone stochastic
  write-back, with L the final validation loss; means and their ratio; and
  the matched-seed differences `L_deadzone - L_full_SR` (same init, data
  order and optimizer per seed): each, their mean and sample sd, and how
  many seeds share each sign."""
  by_seed = _final_losses(runs)
  rows = [_recovery_row(seed, by_seed[seed]) for seed in sorted(by_seed)]
  return rows, _recovery_lines(rows) + _matched_lines(rows)


def _recovery_lines(rows) -> list[str]:
  full = [r["recovery_full_sr"] for r in rows if "recovery_full_sr" in r]
  dz = [r["recovery_deadzone_sr"] for r in rows if "recovery_deadzone_sr" in r]
  if not (full and dz):
    return []
  mf, md = float(np.mean(full)), float(np.mean(dz))
  gaps = [r["rn_gap"] for r in rows if "rn_gap" in r]
  return [
    f"- nearest-rounding loss gap L_RN - L_fp32: mean {np.mean(gaps):.4f} "
    f"nats over {len(gaps)} seeds",
    f"- mean recovery, full SR / dead-zone SR: {mf:.4f} / {md:.4f}",
    f"- ratio dead-zone / full: {md / mf:.4f} (full / dead-zone {mf / md:.4f})",
    f"- recovery above 1 (the stochastic run ends below fp32): full SR "
    f"{sum(x > 1 for x in full)}/{len(full)} seeds, dead-zone SR "
    f"{sum(x > 1 for x in dz)}/{len(dz)}",
  ]


def _matched_lines(rows) -> list[str]:
  d = [
    r["deadzone_minus_full_sr"] for r in rows if "deadzone_minus_full_sr" in r
  ]
  if not d:
    return []
  n = len(d)
  sd = f"{np.std(d, ddof=1):.4f}" if n > 1 else "n/a"
  return [
    "- dead-zone minus full SR, final val loss per matched seed: "
    + ", ".join(f"{x:+.4f}" for x in d)
    + f" nats; mean {np.mean(d):+.4f}, sd {sd} ({n} seeds); negative "
    f"(dead-zone lower) in {sum(x < 0 for x in d)}/{n} seeds, positive in "
    f"{sum(x > 0 for x in d)}/{n}"
  ]


def remedy_kind(config: dict) -> str:
  """What a run's config trains with: `fp32`, `mixed` (a float32 master
  whose forward rounds the kernels, `lowprec.weight_format`), a rounding
  of plain write-back (`nearest`, ...) or a compensation (`kahan`, ...)."""
  lp = config["lowprec"]
  if not lp["writeback"]:
    return (
      "fp32" if lp.get("weight_format", "float32") == "float32" else "mixed"
    )
  comp = lp.get("compensation", "none")
  if comp == "kahan":
    return f"kahan ({lp.get('buffer', 'bfloat16')} buffer)"
  if comp == "split":
    return f"split (int{lp.get('correction_bits', 8)} correction)"
  if comp == "eco" and lp["rounding"] != "nearest":
    return f"eco ({lp['rounding']})"
  return lp["rounding"] if comp == "none" else comp


# A leaf shape for the bytes per element of a stored state: its scales
# (per tensor or per block of up to 2048) are those of a 4096-wide row.
_STATE_SHAPE = (4096,)


def state_bytes(spec) -> float:
  """Bytes per element of a state leaf stored as `spec` (a
  `lowprec.state` spec or a `StateFormat`): its code and its share of the
  scales, as `Codec.nbytes` counts them, except that a grid the runner
  holds in float32 counts its format's width."""
  sf = parse_state_format(spec)
  codec = sf.codec()
  per = codec.nbytes(_STATE_SHAPE) / math.prod(_STATE_SHAPE)
  code = codec.dtype().itemsize
  if code == 4 and not sf.mapped:
    per += sf.fmt.bits / 8 - code
  return per


def _moment_bytes(lp) -> dict[str, float]:
  """AdamW's `mu` and `nu`: 4 bytes, or as the first `lowprec.state` rule
  that matches them stores them."""
  pairs = [e.rpartition("=")[::2] for e in lp.get("state") or ()]
  rules = (
    parse_rules([(r.strip(), s.strip()) for r, s in pairs]) if pairs else ()
  )
  # eco's state holds AdamW's under `inner`.
  at = "inner/0" if lp.get("compensation") == "eco" else "0"
  out = {}
  for moment in ("mu", "nu"):
    # Whole "/"-separated components, as lowprec.store_state matches them.
    hit = [r.value for r in rules if r.regex.fullmatch(f"{at}/{moment}/w")]
    out[moment] = state_bytes(hit[0]) if hit and hit[0] else 4.0
  return out


def recipe_bytes(config: dict) -> float:
  """Bytes per parameter that a run's recipe stores: the weights (their
  format's width; a float32 master for float32 and mixed precision), the
  buffer of a compensated write-back (Kahan's buffer format, the
  two-component error term on the weights' grid, the remainder's 16
  bits, the split's 8- or 16-bit correction; eco stores nothing of its
  own) and AdamW's two moments (float32, or as `lowprec.state` stores
  them: `state_bytes`, the code and its scales). Counts formats, not the
  float32 arrays the runner may hold grid values in; parameters kept in
  float32 (`keep_float32`, under 2% here) are not counted apart."""
  lp = config["lowprec"]
  state = sum(_moment_bytes(lp).values())
  if not lp["writeback"]:
    return 4.0 + state
  weights = _weight_bytes(lp["writeback"])
  buffer = {
    "none": 0.0,
    "kahan": get_format(lp.get("buffer", "bfloat16")).bits / 8,
    "two_component": weights,
    "remainder": 2.0,
    "split": lp.get("correction_bits", 8) / 8,
    "eco": 0.0,
  }[lp.get("compensation", "none")]
  return weights + buffer + state


def _weight_bytes(name: str) -> float:
  """Bytes per weight of a write-back format: its width, and for an MX
  format its elements' width plus one E8M0 scale byte per block."""
  if is_scaled(name):
    fmt = get_scaled_format(name)
    return fmt.element.bits / 8 + 1 / fmt.block
  return get_format(name).bits / 8


def remedies_table(runs):
  """Per kind of run (`remedy_kind`): seeds, mean final validation loss,
  `bytes_per_param` (`recipe_bytes`), `step_time_vs_nearest` (the nearest
  run's steps/s over this run's, same seed, mean over seeds), mean last
  erased fraction and carried mass, and the mean recovery of
  the nearest-rounding gap `(L_RN - L_x) / (L_RN - L_fp32)` over the seeds
  that have all three runs. Where the same seed's float32 run predicted
  the arm (`predicted_name`), the means over steps of the predicted and
  measured erased fractions (from the weight) and lost fractions (lost /
  proposals), and the RMSE between the curves (`_prediction`), averaged
  over seeds."""
  by_kind: dict[str, dict[int, object]] = {}
  for run in runs:
    by_kind.setdefault(remedy_kind(run.config), {})[run.seed] = run
  loss = {
    k: {s: r.last("val_loss") for s, r in seeds.items()}
    for k, seeds in by_kind.items()
  }
  rows = []
  for kind, seeds in by_kind.items():
    row = {"arm": kind, "seeds": len(seeds)}
    row["final_val_loss"] = _mean(loss[kind].values())
    for key in ("erased_fraction", "carried"):
      row[key] = _mean(r.last(key) for r in seeds.values())
    gaps = [
      (loss["nearest"][s] - loss[kind][s])
      / (loss["nearest"][s] - loss["fp32"][s])
      for s in seeds
      if s in loss.get("nearest", {}) and s in loss.get("fp32", {})
      and loss["nearest"][s] != loss["fp32"][s]
    ]  # fmt: skip
    row["recovery"] = _mean(gaps)
    row["bytes_per_param"] = recipe_bytes(next(iter(seeds.values())).config)
    nearest = by_kind.get("nearest", {})
    row["step_time_vs_nearest"] = _mean(
      nearest[s].summary.get("steps_per_s") / r.summary.get("steps_per_s")
      for s, r in seeds.items()
      if s in nearest
      and nearest[s].summary.get("steps_per_s")
      and r.summary.get("steps_per_s")
    )
    refs = by_kind.get("fp32", {})
    pred = [_prediction(r, refs.get(s)) for s, r in seeds.items()]
    pred = [p for p in pred if p]
    if pred:
      for key in PREDICTED:
        row[key] = _mean(p.get(key) for p in pred)
    rows.append(row)
  lines = [
    f"- {r['arm']}: recovers {r['recovery']:.3f} of the nearest-rounding "
    f"loss gap ({r['seeds']} seeds)"
    for r in rows
    if r["recovery"] is not None and r["arm"] not in ("fp32", "nearest")
  ]
  return rows, lines + _prediction_lines(rows)


# The prediction's columns of `remedies_table` (means over steps).
PREDICTED = (
  "pred_erased_mean",
  "erased_mean",
  "erased_rmse",
  "pred_lost_mean",
  "lost_mean",
  "lost_rmse",
)


def predicted_name(config: dict) -> str | None:
  """The name a float32 run predicts a low-precision arm under: the
  reference trace's target (nearest write-back, `bfloat16`) or the
  compensated trace's (`bfloat16_kahan_float8_e5m2`); None for float32,
  mixed precision, other roundings and the remainder."""
  lp = config["lowprec"]
  comp = lp.get("compensation", "none")
  if not lp["writeback"] or lp["rounding"] != "nearest":
    return None
  if comp == "none":
    return lp["writeback"]
  if comp not in ("kahan", "two_component"):
    return None
  buffer = lp.get("buffer", "bfloat16") if comp == "kahan" else None
  return remedy_name(lp["writeback"], comp, buffer)


def _aligned(a, b):
  """The values of two (steps, values) curves at their common steps."""
  _, ia, ib = np.intersect1d(a[0], b[0], return_indices=True)
  return a[1][ia], b[1][ib]


def _lost_curve(run):
  steps, lost = run.curve("lost")
  props = run.curve("proposals")
  lost, n = _aligned((steps, lost), props)
  steps = np.intersect1d(steps, props[0])
  with np.errstate(invalid="ignore", divide="ignore"):
    return steps, np.where(n > 0, lost / np.maximum(n, 1), np.nan)


def _compare(predicted, measured) -> tuple:
  """(mean predicted, mean measured, RMSE) over the steps both have."""
  p, m = _aligned(predicted, measured)
  ok = np.isfinite(p) & np.isfinite(m)
  if not ok.any():
    return None, None, None
  p, m = p[ok], m[ok]
  return float(p.mean()), float(m.mean()), float(np.sqrt(np.mean((p - m) ** 2)))


def _prediction(run, ref) -> dict | None:
  """Predicted (by `ref`, the float32 run of the same seed) and measured
  erased and lost fractions of `run`, where `ref` predicted it."""
  name = predicted_name(run.config)
  if ref is None or name is None:
    return None
  pe = ref.curve(f"pred/{name}/erased_fraction")
  if not len(pe[0]):
    return None
  erased = _compare(pe, run.curve("erased_fraction"))
  out = dict(zip(PREDICTED[:3], erased, strict=True))
  pl = ref.curve(f"pred/{name}/lost_fraction")
  if len(pl[0]):
    lost = _compare(pl, _lost_curve(run))
    out.update(zip(PREDICTED[3:], lost, strict=True))
  return out


def _prediction_lines(rows) -> list[str]:
  lines = []
  for r in rows:
    if r.get("pred_erased_mean") is None:
      continue
    line = (
      f"- {r['arm']}, float32 prediction vs measured (mean over steps): "
      f"erased {r['pred_erased_mean']:.4f} vs {r['erased_mean']:.4f} "
      f"(curve RMSE {r['erased_rmse']:.4f})"
    )
    if r.get("pred_lost_mean") is not None:
      line += (
        f"; lost {r['pred_lost_mean']:.4f} vs {r['lost_mean']:.4f} "
        f"(curve RMSE {r['lost_rmse']:.4f})"
      )
    lines.append(line)
  return lines


def _mean(values):
  v = [x for x in values if x is not None and not math.isnan(x)]
  return float(np.mean(v)) if v else None


ROUNDINGS = ("stochastic", "nearest")
PAPER_REPLAY = (
  "- the paper: a 69.71% reduction (7.3071 nats, from about 10.48 to 3.17) "
  "in one seed, with a ~50k-token vocabulary (ln 50257 = 10.82: a start "
  "near uniform)"
)


def quantizer(config) -> str:
  """How a replay put the weights on its grid, in words."""
  lp = config["lowprec"]
  if not lp["writeback"].startswith("int"):
    return lp["writeback"]
  if lp.get("int_scale"):
    return f"fixed step {lp['int_scale']:g}"
  scope = lp.get("int_scale_scope", "tensor")
  words = {"tensor": "per tensor", "model": "one step for the model"}
  out = words.get(scope, scope)
  return out + (" (norms, biases float32)" if lp.get("keep_float32") else "")


def _replay(run, src) -> dict:
  """One replay run: where it started, its losses and relative change."""
  tr = run.config["train"]
  start = tr["init_from_step"]
  v0, v1 = val_at(run, 0), run.last("val_loss")
  return {
    "checkpoint": start,
    "fp32_at_checkpoint": val_at(src, start) if src else None,
    "after_quantizing": v0,
    "final": v1,
    "change": None if None in (v0, v1) else v1 - v0,
    "reduction": None if None in (v0, v1) or not v0 else (v0 - v1) / v0,
    "fp32_same_data_step": val_at(src, start + tr["steps"]) if src else None,
  }


def _replay_runs(runs) -> dict:
  """{(quantizer, seed, checkpoint): {rounding: replay}} of the replays."""
  out: dict = {}
  for run in runs:
    tr = run.config["train"]
    if not tr.get("init_from_arm"):
      continue
    src = next(
      (r for r in runs if r.arm == tr["init_from_arm"] and r.seed == run.seed),
      None,
    )
    rep = _replay(run, src)
    rep["vocab"] = run.config.get("model", {}).get("vocab_size")
    key = (quantizer(run.config), run.seed, rep["checkpoint"])
    out.setdefault(key, {})[run.config["lowprec"]["rounding"]] = rep
  return out


def _replay_row(key: tuple, by_rounding: dict) -> dict:
  first = by_rounding.get("stochastic") or next(iter(by_rounding.values()))
  v0, vocab = first["after_quantizing"], first["vocab"]
  row = {
    "quantizer": key[0],
    "seed": key[1],
    "checkpoint": key[2],
    "fp32_at_checkpoint": first["fp32_at_checkpoint"],
    "after_quantizing": v0,
    "start_over_uniform": v0 / math.log(vocab) if v0 and vocab else None,
  }
  for r in ROUNDINGS:
    rep = by_rounding.get(r, {})
    for k in ("final", "change", "reduction"):
      row[f"{r}_{k}"] = rep.get(k)
  sr, rn = row["stochastic_final"], row["nearest_final"]
  diff = None if None in (sr, rn) else sr - rn
  row["sr_minus_rn"] = diff
  row["sr_minus_rn_rel"] = None if diff is None or not v0 else diff / v0
  row["fp32_same_data_step"] = first["fp32_same_data_step"]
  return row


def replay_table(runs):
  """Write-back replayed from a reference's checkpoints, one row per
  (quantizer, checkpoint): the reference's validation loss there, the loss
  right after putting the weights on the grid (replay step 0, `L0`) and
  as a share of the uniform loss ln V, then per rounding the final loss
  `L1`, the change `L1 - L0` and the relative reduction `(L0 - L1) / L0`;
  stochastic minus nearest final loss, in nats and relative to `L0`; and
  the reference's own loss at the same data step."""
  reps = _replay_runs(runs)
  rows = [_replay_row(key, reps[key]) for key in sorted(reps)]
  lines = []
  for q in dict.fromkeys(r["quantizer"] for r in rows):
    lines += _replay_lines(q, [r for r in rows if r["quantizer"] == q])
  if rows:
    lines.append(PAPER_REPLAY)
  return rows, lines


def _range(xs, spec: str) -> str | None:
  """`a to b (mean m)` of the values that are there, formatted by `spec`."""
  xs = [x for x in xs if x is not None]
  if not xs:
    return None
  f = lambda x: format(x, spec)
  return f"{f(min(xs))} to {f(max(xs))} (mean {f(float(np.mean(xs)))})"


def _replay_lines(q: str, rows) -> list[str]:
  lines = []
  start = _range([r["start_over_uniform"] for r in rows], ".3f")
  if start:
    lines.append(f"- {q}: start / ln V {start}")
  for r in ROUNDINGS:
    red = _range([x[f"{r}_reduction"] for x in rows], ".2%")
    if red:
      n = sum(x[f"{r}_reduction"] is not None for x in rows)
      nats = _range([x[f"{r}_change"] for x in rows], "+.4f")
      lines.append(
        f"- {q}, {r} write-back, {n} checkpoint(s): relative reduction "
        f"{red}; change {nats} nats"
      )
  diff = _range([r["sr_minus_rn"] for r in rows], "+.4f")
  if diff:
    rel = _range([r["sr_minus_rn_rel"] for r in rows], "+.2%")
    n = sum(r["sr_minus_rn"] is not None for r in rows)
    lines.append(
      f"- {q}, stochastic minus nearest final val loss, {n} checkpoint(s): "
      f"{diff} nats; {rel} of the start"
    )
  return lines

"""Which recipe per tensor group, from a study's float32 run.

  python -m scripts.advise --config configs/frontier.py [--budget BYTES]
      [--arm fp32] [--seed 0] [--results results] [--out FILE]
      [--code FILE] [--optimizer "optax.adamw(6.5e-4, b2=0.99)"]

Reads the float32 arm's `metrics.jsonl` (the arm carrying the traces:
`lowprec.trace_targets`, `trace_remedies`, `state_targets`), builds the
model's parameter shapes from the config, and runs
`lowprec.freeze.advise`: per group of `lowprec.groups` (the config's, or
the default groups), the predicted erased / lost / move / stalled shares
and bytes of every recipe, and the cheapest safe one. `--budget` is in
bytes per parameter (weights, write-back state and AdamW's moments).

The run is read as the results ledger writes it (docs/advise.md): its
config.json must match the config given, and metrics.jsonl must be whole,
one line per step; a damaged record is refused with its file and line.

It prints the table, writes the recommendation as a config fragment
(`--out`, default `configs/advice/<study>.py`: `LOWPREC`, the per-group
keys `experiments.run` takes) and as optax code to paste (`--code`,
default `<results>/<study>/advice/optax_advice.py`), each file replaced
whole or not at all. A mistake prints one line and exits with status 2.
"""

if not __package__:  # run as a file, `python scripts/advise.py`
  raise SystemExit(
    "run it from the repository root as a module: python -m scripts.advise ..."
  )

import argparse
import difflib
import math
import os
import sys
import tempfile

TRACE_KEYS = ("trace_targets", "trace_remedies", "state_targets")


def _fail(message: str) -> None:
  print("error: " + " ".join(str(message).split()), file=sys.stderr)
  sys.stderr.flush()
  raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
  def error(self, message: str) -> None:
    _fail(f"{message} (python -m scripts.advise --help lists the arguments)")


def _args(argv) -> argparse.Namespace:
  ap = _Parser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True, help="configs/<study>.py[:ARG]")
  ap.add_argument("--budget", type=float, default=None, help="bytes/param")
  ap.add_argument("--arm", default="", help="the float32 arm (default: traced)")
  ap.add_argument("--seed", type=int, default=None)
  ap.add_argument("--results", default="results")
  ap.add_argument("--out", default=None, help="the config fragment to write")
  ap.add_argument("--code", default=None, help="the optax code to write")
  ap.add_argument(
    "--margin",
    type=float,
    default=0.01,
    help="nats the chosen weights may cost, prediction plus two standard "
    "errors (a run with lowprec.trace_progress)",
  )
  ap.add_argument(
    "--draws",
    type=int,
    default=4,
    help="stochastic roundings per group and grid in the forward costs "
    "(0: nearest only)",
  )
  ap.add_argument(
    "--predict_arms",
    default=None,
    metavar="FILE",
    help="also predict every plain write-back arm of the study, and the "
    "advised choice, in nats, and write them to FILE as JSON",
  )
  ap.add_argument(
    "--no_forward",
    action="store_true",
    help="skip the forward costs (the final checkpoint's loss with each "
    "group on each grid)",
  )
  ap.add_argument(
    "--optimizer",
    default=None,
    help="the optimizer expression in the optax code (default: the config's)",
  )
  args = ap.parse_args(argv)
  if args.budget is not None and not (
    math.isfinite(args.budget) and args.budget > 0
  ):
    _fail(
      f"--budget {args.budget}: give a positive number of bytes per "
      "parameter, e.g. --budget 6"
    )
  if args.optimizer is not None:
    try:
      compile(args.optimizer, "<optimizer>", "eval")
    except (SyntaxError, ValueError) as e:
      _fail(
        f"--optimizer {args.optimizer!r} is not a Python expression "
        f"({getattr(e, 'msg', e)}), so the optax code would not compile: "
        "give one, e.g. --optimizer 'optax.adamw(1e-3)'"
      )
  for flag in ("out", "code"):
    if getattr(args, flag) is not None:
      _check_target(f"--{flag}", getattr(args, flag))
  return args


def _check_target(flag: str, path: str) -> None:
  """A file to write: its folder exists, and it is not a folder."""
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    _fail(f"{flag} {path} is a folder: name a file in it, e.g. {path}/x.py")
  if not os.path.isdir(folder):
    _fail(
      f"{flag} {path}: no folder {folder}; create it (mkdir -p {folder}) or "
      "name a file in an existing folder"
    )


def _suggest(name: str, valid) -> str:
  close = difflib.get_close_matches(name, list(valid), n=1)
  return f" Did you mean {close[0]!r}?" if close else ""


def _traced_arms(config) -> list[str]:
  return [
    arm
    for arm, over in config.study.arms.items()
    if any(over.get("lowprec", {}).get(k) for k in TRACE_KEYS)
  ]


def _arm(config, args) -> str:
  """The arm asked for (`--arm` or the config's `arm=`), else the first
  that carries traces; it must be an arm, and carry traces."""
  arms = list(config.study.arms.keys())
  traced = _traced_arms(config)
  name = config.study.name
  given = config.study.arm
  if args.arm and given and args.arm != given:
    _fail(
      f"--arm {args.arm} and the config argument's arm={given} differ: name "
      "the arm once"
    )
  arm = args.arm or given
  if not arm:
    if not traced:
      _fail(
        f"no arm of {name!r} carries traces (lowprec."
        f"{', '.join(TRACE_KEYS)}): the advice needs a float32 run that does"
      )
    return traced[0]
  flag = "--arm" if args.arm else f"--config {args.config}"
  if arm not in arms:
    _fail(
      f"{flag}: {arm!r} is not an arm of {name!r}.{_suggest(arm, arms)} "
      f"Arms: {', '.join(arms)}"
    )
  if arm not in traced:
    _fail(
      f"{flag}: arm {arm!r} carries no traces (lowprec."
      f"{', '.join(TRACE_KEYS)}), so its run predicts nothing; arms that "
      f"do: {', '.join(traced) or 'none'}"
    )
  return arm


def _seed(config, arm: str, args) -> int:
  """`--seed` or the config's `seed=`, else the arm's first seed."""
  given = config.study.seed if config.study.seed >= 0 else None
  if args.seed is not None and given is not None and args.seed != given:
    _fail(
      f"--seed {args.seed} and the config argument's seed={given} differ: "
      "name the seed once"
    )
  over = config.study.arms[arm].get("study", {})
  seeds = list(over.get("seeds", config.study.seeds))
  seed = args.seed if args.seed is not None else given
  if seed is None:
    return seeds[0]
  if seed not in seeds:
    _fail(
      f"seed {seed} is not a seed of arm {arm!r} of {config.study.name!r}: "
      f"its seeds are {', '.join(map(str, seeds))}"
    )
  return seed


def _run_command(args, arm: str, seed: int) -> str:
  """The runner's command for this run (the config argument's scale)."""
  path, _, arg = args.config.partition(":")
  keep = [x for x in arg.split(",") if x.strip().startswith("scale=")]
  arg = ",".join([*keep, f"arm={arm}", f"seed={seed}"])
  return f"python -m experiments.run --config {path}:{arg}"


def _check_config(run_dir: str, c, args, arm: str, seed: int) -> None:
  """The run's config.json is the config given, as the ledger checks it."""
  from experiments import ledger, results

  file = os.path.join(run_dir, "config.json")
  rerun = f"{_run_command(args, arm, seed)} --restart"
  if not os.path.exists(file):
    _fail(
      f"{run_dir} has metrics.jsonl but no config.json, so its records "
      f"cannot be checked against --config {args.config}: restore "
      f"config.json, or rerun the float32 arm: {rerun}"
    )
  try:
    old = results.read_json(file)
  except ValueError as e:
    _fail(f"{e}; restore it, or rerun the float32 arm: {rerun}")
  diff = ledger.config_diff(old, c.to_dict())
  if diff:
    shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
    _fail(
      f"{run_dir} was run with another config than --config {args.config} "
      f"(run -> given: {shown}): advise with the config it ran with, or "
      f"rerun it with this one: {rerun}"
    )


def _records(run_dir: str, c, args, arm: str, seed: int):
  """The run's training-step records and their file:line."""
  from experiments import results

  metrics = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(metrics):
    _fail(
      f"no {metrics}: run the float32 arm first, `"
      f"{_run_command(args, arm, seed)}`"
    )
  _check_config(run_dir, c, args, arm, seed)
  try:
    lines = results.read_whole_metrics(metrics)
  except (results.MetricsError, OSError) as e:
    _fail(str(e))
  lines = [(i, r) for i, r in lines if r["step"] >= 1]
  if not any(k.startswith("pred") for _, r in lines for k in r):
    _fail(f"{metrics} holds no predictions: arm {arm!r} carries no traces")
  return [r for _, r in lines], [f"{metrics}:{i}" for i, _ in lines]


def _write_all(files: dict[str, str]) -> None:
  """Writes every file whole or none: temp files first, then renames."""
  temps = {}
  try:
    for path, text in files.items():
      fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)),
        prefix="." + os.path.basename(path) + ".",
        suffix=".tmp",
      )
      temps[path] = tmp
      with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
      os.chmod(tmp, 0o644)
  except OSError as e:
    for tmp in temps.values():
      os.remove(tmp)
    _fail(f"cannot write {e.filename or path}: {e.strerror or e}")
  for path, tmp in temps.items():
    os.replace(tmp, path)


def _outputs(args, c) -> tuple[str, str]:
  out = args.out or os.path.join("configs", "advice", f"{c.study.name}.py")
  code = args.code or os.path.join(
    args.results, c.study.name, "advice", "optax_advice.py"
  )
  if args.out is None:
    _check_target("--out", out)
  if os.path.realpath(out) == os.path.realpath(code):
    _fail(f"--out and --code name the same file {out}: give two files")
  return out, code


def main(argv=None) -> None:
  args = _args(argv)
  from experiments import cli  # jax loads later, after the cheap checks

  try:
    config = cli._load(args.config)
  except (AttributeError, TypeError) as e:
    _fail(f"--config {args.config} is not a study config ({e})")
  arm = _arm(config, args)
  seed = _seed(config, arm, args)
  from experiments import study

  try:
    c = study.resolve(config, arm, seed)
  except ValueError as e:
    _fail(f"--config {args.config}: {e}")
  out, code = _outputs(args, c)
  run_dir = os.path.join(args.results, c.study.name, arm, f"seed{seed}")
  records, sources = _records(run_dir, c, args, arm, seed)
  measure = c.lowprec.get("trace_progress", False) and not args.no_forward
  # The run's last weights, read once for every cost measured on them.
  last = None
  if measure or args.predict_arms:
    last = _checkpoint(c, args, records[-1]["step"])
  advice = _advise(c, args, records, sources, last if measure else None)
  o = c.opt
  optimizer = args.optimizer or (
    f"optax.adamw({o.lr}, b1={o.b1}, b2={o.b2}, eps={o.eps}, "
    f"weight_decay={o.weight_decay})"
  )
  texts = {out: advice.fragment(), code: advice.optax_code(optimizer)}
  print(f"{c.study.name}/{arm}/seed{seed}")
  print(advice.table())
  if args.code is None:
    os.makedirs(os.path.dirname(code) or ".", exist_ok=True)
  _write_all(texts)
  print(f"\nwrote {out} (config fragment) and {code} (optax code)")
  if args.predict_arms:
    import json

    preds = arm_predictions(config, c, args, last)
    if advice.margin is not None:
      mean, se = advice.predicted_nats
      preds["advised"] = {
        "nats": mean,
        "se": se,
        "draws": args.draws,
        "how": "advise: sum over groups, weights only",
        "choice": advice.choice,
      }
    for arm, p in preds.items():
      print(f"predicted {arm}: {p['nats']:+.4f} +- {p['se']:.4f} ({p['how']})")
    _write_all({args.predict_arms: json.dumps(preds, indent=1) + "\n"})
    print(f"wrote {args.predict_arms}")


def _advise(c, args, records, sources, last):
  """The advice; with `last` (`_checkpoint`'s), by the nats measured on
  the run's last weights where it holds them."""
  import jax

  import lowprec
  from experiments import tasks

  try:
    params = jax.eval_shape(tasks.build(c).init, jax.random.key(0))
    groups = tuple(c.lowprec.groups) or None
    costs = lost = None
    if last is not None:
      costs, lost = _measured_costs(c, args, last, groups)
    advice = lowprec.freeze.advise(
      records,
      params,
      groups=groups,
      budget=args.budget,
      sources=sources,
      costs=costs,
      lost=lost,
      margin=args.margin,
    )
  except (ValueError, FileNotFoundError) as e:
    _fail(str(e))
  if last is not None and costs is None:
    advice.notes.append(
      "no checkpoint of the float32 run's last step to measure the costs "
      "in nats on: chosen by the shares (rerun the float32 arm to its end)"
    )
  steps = records[-1].get("step")
  if steps < c.train.steps:
    advice.notes.append(
      f"the float32 run stopped at step {steps} of {c.train.steps}"
    )
  return advice


def _checkpoint(c, args, step: int):
  """The run's state at its last step `step` and its validation loss
  (`params -> mean loss over the run's own validation batches`)."""
  import numpy as np

  from experiments import checkpoint, train

  ckpts = os.path.join(
    args.results,
    c.study.name,
    c.study.arm,
    f"seed{c.train.seed}",
    "checkpoints",
  )
  saved = None
  if os.path.isdir(ckpts):
    saved = checkpoint.Checkpointer(ckpts, c.ckpt.every_steps, c.ckpt.keep)
  if saved is None or saved.latest_step() != step:
    return None, None, 0
  run = train.build_run(c)
  state = saved.restore(step, run.state)
  batches = run.eval_batches()

  def loss(p):
    return float(
      np.mean([float(run.eval_fn(p, b, run.eval_key)) for b in batches])
    )

  return state, loss, len(batches)


def _measured_costs(c, args, last, groups):
  """`lowprec.freeze.forward_cost` and `lost_cost` of the run's last
  checkpoint (`last`, `_checkpoint`'s: its parameters and its progress
  trace), on the run's own validation batches (their mean loss); None,
  None where the run holds no checkpoint of its last step."""
  import jax

  import lowprec
  from experiments import lowprec_config

  state, loss, n = last
  if state is None:
    return None, None
  print(
    f"measured costs: the last step's weights, {n} validation batches, "
    f"{args.draws} stochastic draws per group and grid ...",
    flush=True,
  )
  forward = lowprec.freeze.forward_cost(
    loss,
    state.params,
    lowprec_config.progress_targets(c.lowprec),
    groups=groups,
    key=jax.random.key(c.train.seed),
    draws=args.draws,
  )
  lost = lowprec.freeze.lost_cost(
    loss, state.params, state.opt_state, groups=groups
  )
  return forward, lost


def arm_predictions(config, c, args, last) -> dict:
  """Per arm of the study whose weights take one plain write-back (a
  grid, nearest or stochastic, `keep_float32` left out), its predicted
  cost in nats against float32 from the float32 run `c` alone: the
  `lost_cost` of the whole rounded model for nearest write-back, its
  stochastic `forward_cost` (mean, standard error) otherwise; arms with
  a moment store are predicted for their weights and say so. Other arms
  (float32, mixed, compensated, ECO, per-group, and arms of another
  horizon than the float32 run's) are left out."""
  import jax

  import lowprec
  from experiments import lowprec_config, study

  state, loss, _ = last
  if state is None:
    _fail(
      "--predict_arms measures the float32 run's last weights, and the run "
      "holds no checkpoint of its last step: rerun the float32 arm to its "
      "end"
    )
  out = {}
  for arm, body in config.study.arms.items():
    lp = dict(body.get("lowprec", {}))
    fmt = lp.get("writeback")
    if not fmt or lp.get("compensation", "none") != "none":
      continue
    if body.get("train", {}).get("steps", c.train.steps) != c.train.steps:
      continue  # its weights are not the float32 run's at its end
    keep = lp.get("keep_float32", "")
    groups = ((("kept", keep),) if keep else ()) + (("rounded", ".*"),)
    rounding = lp.get("rounding", "nearest")
    if rounding == "nearest":
      # The grid the float32 run traced (its default scale rule).
      cost = lowprec.freeze.lost_cost(
        loss, state.params, state.opt_state, groups=groups
      )["rounded"][fmt]
      how = "lost_cost"
      if lp.get("writeback_rule"):
        how += " (the traced grid's scale rule)"
    else:
      # The arm's own grid, its scale rule included.
      grid = lowprec_config.writeback_format(
        study.resolve(config, arm, c.train.seed).lowprec
      )
      cost = lowprec.freeze.forward_cost(
        loss,
        state.params,
        {fmt: grid},
        groups=groups,
        key=jax.random.key(c.train.seed),
        draws=max(args.draws, 2),
      )["rounded"][f"{fmt}_sr"]
      how = "forward_cost"
    if fmt not in lowprec_config.progress_targets(c.lowprec):
      how += " (grid not traced)"
    out[arm] = {
      "nats": cost.mean,
      "se": cost.se,
      "draws": cost.draws,
      "how": how + (", moments not predicted" if lp.get("state") else ""),
    }
  return out


if __name__ == "__main__":
  main()

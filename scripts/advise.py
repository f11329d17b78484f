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

It prints the table, writes the recommendation as a config fragment
(`--out`, default `configs/advice/<study>.py`: `LOWPREC`, the per-group
keys `experiments.run` takes) and as optax code to paste (`--code`,
default `<results>/<study>/advice/optax_advice.py`).
"""

if not __package__:  # run as a file, `python scripts/advise.py`
  raise SystemExit(
    "run it from the repository root as a module: python -m scripts.advise ..."
  )

import argparse
import os
import sys


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  raise SystemExit(2)


def _reference_arm(config) -> str:
  """The first arm (in the config's order) that carries traces."""
  for arm, over in config.study.arms.items():
    lp = over.get("lowprec", {})
    if lp.get("trace_targets") or lp.get("state_targets"):
      return arm
  _fail(
    f"no arm of {config.study.name!r} carries traces (lowprec.trace_targets "
    "or state_targets); name one with --arm"
  )


def _records(run_dir: str) -> list[dict]:
  """The run's metrics records that carry predictions."""
  from experiments.analysis.runs import Run

  return [
    r for r in Run(run_dir).metrics if any(k.startswith("pred") for k in r)
  ]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True, help="configs/<study>.py")
  ap.add_argument("--budget", type=float, default=None, help="bytes/param")
  ap.add_argument("--arm", default="", help="the float32 arm (default: traced)")
  ap.add_argument("--seed", type=int, default=None)
  ap.add_argument("--results", default="results")
  ap.add_argument("--out", default=None, help="the config fragment to write")
  ap.add_argument("--code", default=None, help="the optax code to write")
  ap.add_argument(
    "--optimizer",
    default=None,
    help="the optimizer expression in the optax code (default: the config's)",
  )
  args = ap.parse_args(argv)

  from experiments import cli, study, tasks

  config = cli._load(args.config)
  arm = args.arm or _reference_arm(config)
  if arm not in config.study.arms:
    _fail(f"--arm {arm!r} is not an arm of {config.study.name!r}")
  seed = config.study.seeds[0] if args.seed is None else args.seed
  c = study.resolve(config, arm, seed)
  run_dir = os.path.join(args.results, c.study.name, arm, f"seed{seed}")
  metrics = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(metrics):
    _fail(
      f"no {metrics}: run the float32 arm first, `python -m experiments.run "
      f"--config {args.config.partition(':')[0]}:arm={arm},seed={seed}`"
    )
  records = _records(run_dir)
  if not records:
    _fail(f"{metrics} holds no predictions: arm {arm!r} carries no traces")

  import jax

  import lowprec

  params = jax.eval_shape(tasks.build(c).init, jax.random.key(0))
  groups = tuple(c.lowprec.groups) or None
  try:
    advice = lowprec.freeze.advise(
      records, params, groups=groups, budget=args.budget
    )
  except ValueError as e:
    _fail(str(e))
  steps = records[-1].get("step")
  if steps is not None and steps < c.train.steps:
    advice.notes.append(
      f"the float32 run stopped at step {steps} of {c.train.steps}"
    )
  print(f"{c.study.name}/{arm}/seed{seed}")
  print(advice.table())
  out = args.out or os.path.join("configs", "advice", f"{c.study.name}.py")
  with open(out, "w") as f:
    f.write(advice.fragment())
  o = c.opt
  optimizer = args.optimizer or (
    f"optax.adamw({o.lr}, b1={o.b1}, b2={o.b2}, eps={o.eps}, "
    f"weight_decay={o.weight_decay})"
  )
  code = args.code or os.path.join(
    args.results, c.study.name, "advice", "optax_advice.py"
  )
  os.makedirs(os.path.dirname(code) or ".", exist_ok=True)
  with open(code, "w") as f:
    f.write(advice.optax_code(optimizer))
  print(f"\nwrote {out} (config fragment) and {code} (optax code)")


if __name__ == "__main__":
  main()

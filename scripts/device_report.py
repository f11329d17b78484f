"""The plan and the report of scripts/device_check.sh, and its environment.

  python -m scripts.device_report --plan [--dry_run]   # the time plan
  python -m scripts.device_report --limit NAME [--dry_run]  # one limit, s
  python -m scripts.device_report --budget [--dry_run]  # the whole check, s
  python -m scripts.device_report --reserve   # seconds kept for the report
  python -m scripts.device_report --env       # one JSON line: versions
  python -m scripts.device_report --parts DIR --out DIR [--dry_run] [--quiet]

The plan is `experiments/device_plan.py` (each part's expected seconds on
an H200 and its limit; `--dry_run`: the CPU dry run's limits). The last
form writes `device_check.json` and `device_check.md` into `--out` from
what the parts left in `--parts` (experiments/device_report.py) and
prints the Markdown unless `--quiet`.
"""

from __future__ import annotations

if not __package__:  # run as a file, `python scripts/device_report.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.device_report ..."
  )


import argparse
import importlib
import json

from experiments import device_plan


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--plan", action="store_true", help="print the plan")
  parser.add_argument("--limit", metavar="NAME", help="print a part's limit")
  parser.add_argument("--budget", action="store_true", help="print it")
  parser.add_argument("--reserve", action="store_true", help="print it")
  parser.add_argument("--env", action="store_true", help="print versions")
  parser.add_argument("--parts", help="the parts' folder")
  parser.add_argument("--out", help="where the report goes")
  parser.add_argument("--dry_run", action="store_true")
  parser.add_argument("--quiet", action="store_true", help="write, no print")
  args = parser.parse_args(argv)
  if args.plan:
    print(device_plan.markdown(), end="")
    if args.dry_run:
      print(
        f"(dry run: each part on the CPU under {device_plan.DRY_LIMIT_S} s)"
      )
    return
  if args.limit:
    try:
      print(device_plan.limit(args.limit, args.dry_run))
    except KeyError as e:
      parser.error(e.args[0])
    return
  if args.budget or args.reserve:
    budget = device_plan.budget(args.dry_run)
    print(budget if args.budget else device_plan.REPORT_S)
    return
  if args.env:
    importlib.import_module("experiments.xla_flags")  # before jax starts
    from experiments import device_report

    print(json.dumps(device_report.environment()), flush=True)
    return
  if not (args.parts and args.out):
    parser.error(
      "pass --plan, --limit, --budget, --reserve, --env, or --parts and --out"
    )
  from experiments import device_report

  device_report.write(args.parts, args.out, args.dry_run)
  if not args.quiet:
    with open(f"{args.out}/device_check.md") as f:
      print(f.read(), end="")


if __name__ == "__main__":
  main()

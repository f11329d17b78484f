"""The parts of scripts/device_check.sh: its environment line and its report.

  python -m scripts.device_report --env          # one JSON line: versions
  python -m scripts.device_report --parts DIR --out DIR [--dry_run]

The second form writes `device_check.json` and `device_check.md` into
`--out` from what the parts left in `--parts` (experiments/device_report.py)
and prints the Markdown.
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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--env", action="store_true", help="print versions")
  parser.add_argument("--parts", help="the parts' folder")
  parser.add_argument("--out", help="where the report goes")
  parser.add_argument("--dry_run", action="store_true")
  args = parser.parse_args(argv)
  if args.env:
    importlib.import_module("experiments.xla_flags")  # before jax starts
    from experiments import device_report

    print(json.dumps(device_report.environment()), flush=True)
    return
  if not (args.parts and args.out):
    parser.error("pass --env, or --parts and --out")
  from experiments import device_report

  device_report.write(args.parts, args.out, args.dry_run)
  with open(f"{args.out}/device_check.md") as f:
    print(f.read(), end="")


if __name__ == "__main__":
  main()

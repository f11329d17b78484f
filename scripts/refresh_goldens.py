"""Recompute the golden values and rewrite tests/goldens.json.

  python -m scripts.refresh_goldens --why "what changed and why"

Every case of experiments/goldens.py is recomputed, each in a fresh
process on one CPU (the smoke study runs through the entry point: a few
minutes) and stored as the values of this environment (jax and jaxlib
versions, the CPU's architecture, model and the features that change
XLA:CPU's code); the values pinned on other kinds of machine stay, unless
`--only-here`. Each entry whose value changed records the reason and its
old and new value. Without `--why`, or where the CPU cannot be read (no
/proc/cpuinfo), nothing runs.
"""

from __future__ import annotations

import argparse
import sys

if not __package__:  # run as a file, `python scripts/refresh_goldens.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    'python -m scripts.refresh_goldens --why "..."'
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--why", required=True, help="the reason, recorded with each change"
  )
  parser.add_argument("--path", default=None, help="default tests/goldens.json")
  parser.add_argument(
    "--only-here",
    action="store_true",
    help="drop the values pinned in other environments (after a change "
    "that moves them all, where they cannot be made again here)",
  )
  args = parser.parse_args(argv)
  if not args.why.strip():
    parser.error("--why must say why the goldens change")
  from experiments import goldens

  try:
    changes = goldens.refresh(
      args.why, args.path or goldens.GOLDENS, only_here=args.only_here
    )
  except ValueError as e:  # this machine cannot be told apart from others
    parser.exit(2, f"refresh_goldens: {e}\n")
  print("\n".join(changes) if changes else "no value changed")
  return 0


if __name__ == "__main__":
  sys.exit(main())

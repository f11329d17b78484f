"""Benchmarks, side by side in one run, printed as Markdown tables of ratios.

  python -m scripts.bench [section ...] [--quick]

Sections: rounding, writeback, trace, ops, train, user_ops (default: all
that exist).
Each lives in `scripts/bench_<section>.py` with `run(quick: bool) -> str`.
Numbers are machine-dependent; docs/benchmarks.md records the ratios measured
on the 2-core CPU machine. Never used as timed assertions in tests.
"""

from __future__ import annotations

import argparse
import importlib
import os

SECTIONS = ("rounding", "writeback", "trace", "ops", "train", "user_ops")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "sections", nargs="*", help=f"any of {', '.join(SECTIONS)}"
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="smaller sizes and fewer repeats (smoke test)",
  )
  args = parser.parse_args(argv)
  unknown = sorted(set(args.sections) - set(SECTIONS))
  if unknown:
    parser.error(f"unknown section(s) {unknown}; valid: {', '.join(SECTIONS)}")
  importlib.import_module("experiments.xla_flags")  # before jax starts
  here = os.path.dirname(os.path.abspath(__file__))
  names = args.sections or [
    s for s in SECTIONS if os.path.exists(os.path.join(here, f"bench_{s}.py"))
  ]
  for name in names:
    module = importlib.import_module(f"scripts.bench_{name}")
    print(module.run(quick=args.quick), flush=True)
    print()


if __name__ == "__main__":
  main()

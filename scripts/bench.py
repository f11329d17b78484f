"""Benchmarks, side by side in one run, printed as Markdown tables of ratios.

  python -m scripts.bench [section ...] [--quick] [--runs N] [--json FILE]
  python -m scripts.bench writeback --cost [--cases REGEX]
  python -m scripts.bench writeback [--fresh-outputs] [--vector-width 512]
      [--cases REGEX]

Sections: rounding, scaled, writeback, trace, ops, train, user_ops, frontier
(default: all that exist). Each lives in `scripts/bench_<section>.py` with
`run(quick: bool) -> benchlib.Result`. Within a section the cases run
interleaved, round by round, and every ratio is reported as the median of
same-round ratios with its range. `--json FILE` (or `-` for standard
output) also writes every section's times and ratios as JSON. `--runs N`
repeats each section N times and adds a table of the median and range of
the N runs' ratios (JSON: "runs" and "across_runs"). `writeback --cost`
times nothing: it prints XLA's cost analysis of each row's compiled step
(fusions, bytes accessed and flops per parameter), the bytes that bound
the step on a GPU. The writeback section's steps donate their params and
state, as a training loop does (`--fresh-outputs`: every call writes new
buffers instead, as an optax loop without `donate_argnums`).
Numbers are machine-dependent; docs/benchmarks.md records the ratios
measured on the 2-core CPU machine. Never used as timed assertions in tests.
"""

from __future__ import annotations

if not __package__:  # run as a file, `python scripts/bench.py`
  raise SystemExit(
    "run it from the repository root as a module: python -m scripts.bench ..."
  )


import argparse
import importlib
import json
import os
import re
import sys

from scripts import benchlib

SECTIONS = (
  "rounding",
  "scaled",
  "writeback",
  "trace",
  "ops",
  "train",
  "user_ops",
  "frontier",
)


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
  parser.add_argument(
    "--runs",
    type=int,
    default=1,
    help="run each section this many times; then a table of the median "
    "and range of the runs' ratios",
  )
  parser.add_argument(
    "--cases",
    metavar="REGEX",
    help="writeback only: time the cases whose names match REGEX (a "
    "Python regular expression, searched), beside both baselines",
  )
  parser.add_argument(
    "--cost",
    action="store_true",
    help="writeback only: time nothing; compile each row's step on one "
    "1024 x 1024 leaf and print XLA's count of its fusions and its bytes "
    "accessed and flops per parameter (on a GPU the bytes set the time)",
  )
  parser.add_argument(
    "--fresh-outputs",
    action="store_true",
    help="writeback only: do not donate the params and state; every call "
    "reads the same inputs and writes new buffers (an optax loop without "
    "donate_argnums)",
  )
  parser.add_argument(
    "--vector-width",
    type=int,
    choices=(128, 256, 512),
    help="writeback only: compile each row's step with XLA:CPU's vectors "
    "of this many bits (`xla_cpu_prefer_vector_width`; 256 by default; "
    "512 on a CPU with AVX-512 stores the same bits, faster)",
  )
  parser.add_argument(
    "--json",
    metavar="FILE",
    help="also write the results as JSON to FILE ('-': standard output)",
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
  out = sys.stderr if args.json == "-" else sys.stdout
  results = {}
  if args.runs < 1:
    parser.error(f"--runs must be at least 1, got {args.runs}")
  if args.cases is not None:
    if names != ["writeback"]:
      parser.error("--cases selects rows of the writeback section alone")
    try:
      re.compile(args.cases)
    except re.error as e:
      parser.error(f"--cases {args.cases!r} is not a regular expression: {e}")
  if args.fresh_outputs and names != ["writeback"]:
    parser.error("--fresh-outputs applies to the writeback section alone")
  if args.vector_width and (names != ["writeback"] or args.cost):
    parser.error(
      "--vector-width applies to the writeback section's timed rows alone "
      "(XLA's bytes, which --cost prints, do not depend on it)"
    )
  if args.fresh_outputs and args.cost:
    parser.error(
      "--fresh-outputs times steps; --cost already prints the bytes with "
      "new buffers beside the donated ones: drop one of the two"
    )
  if args.cost:
    if names != ["writeback"]:
      parser.error("--cost analyses the writeback section alone")
    table, results["writeback"] = importlib.import_module(
      "scripts.bench_writeback"
    ).cost(args.cases)
    print(table, file=out, flush=True)
    names = []
  for name in names:
    module = importlib.import_module(f"scripts.bench_{name}")
    kwargs = {} if args.cases is None else {"cases": args.cases}
    if args.fresh_outputs:
      kwargs["donate"] = False
    if args.vector_width:
      kwargs["vector_width"] = args.vector_width
    runs = []
    for _ in range(args.runs):
      runs.append(module.run(quick=args.quick, **kwargs))
      print(runs[-1].markdown(), file=out, flush=True)
      print(file=out)
    results[name] = runs[0].as_dict()
    if args.runs > 1:
      print(benchlib.across_runs_markdown(runs), file=out, flush=True)
      print(file=out)
      results[name] = {
        "runs": [r.as_dict() for r in runs],
        "across_runs": benchlib.across_runs(runs),
      }
  if args.json:
    text = json.dumps(results, indent=1)
    if args.json == "-":
      print(text)
    else:
      with open(args.json, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
  main()

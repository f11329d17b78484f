"""Runs every arm of a study, then makes its table and figure.

  python -m scripts.reproduce <study> [--arg scale=cpu] [--results results]

Equivalent to `python -m experiments.run --config configs/<study>.py:<arg>`
followed by `scripts.make_tables` and `scripts.plot`. Finished runs are
skipped, so a rerun only redoes the tables.
"""

if not __package__:  # run as a file, `python scripts/reproduce.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.reproduce ..."
  )


import argparse

from experiments.analysis import reproduce


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("study")
  ap.add_argument("--arg", default=None, help="config argument, e.g. scale=cpu")
  ap.add_argument("--results", default="results")
  args = ap.parse_args(argv)
  reproduce.reproduce(args.study, args.arg, args.results)


if __name__ == "__main__":
  main()

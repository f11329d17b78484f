"""Draws a study's figure (PNG) from its result files.

  python -m scripts.plot <study> [--results results] [--out DIR]
      [--figure NAME]

Writes `<out>/<study>.png` (default out: `<results>/<study>/tables`).
"""

if not __package__:  # run as a file, `python scripts/plot.py`
  raise SystemExit(
    "run it from the repository root as a module: python -m scripts.plot ..."
  )


import argparse

from experiments.analysis import figures


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("study")
  ap.add_argument("--results", default="results")
  ap.add_argument("--out", default=None)
  ap.add_argument(
    "--figure",
    default=None,
    help="the figure, for runs whose config.json does not name one",
  )
  args = ap.parse_args(argv)
  print(figures.plot(args.study, args.results, args.out, args.figure))


if __name__ == "__main__":
  main()

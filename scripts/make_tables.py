"""Writes a study's table (Markdown and CSV) from its result files.

  python -m scripts.make_tables <study> [--results results] [--out DIR]
      [--analysis NAME]

Reads `<results>/<study>/<arm>/seed<k>/` and writes `<out>/<study>.md` and
`<out>/<study>.csv` (default out: `<results>/<study>/tables`).
"""

if not __package__:  # run as a file, `python scripts/make_tables.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.make_tables ..."
  )


import argparse

from experiments.analysis import tables


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("study")
  ap.add_argument("--results", default="results")
  ap.add_argument("--out", default=None)
  ap.add_argument(
    "--analysis",
    default=None,
    help="the analysis, for runs whose config.json does not name one",
  )
  args = ap.parse_args(argv)
  print(tables.make(args.study, args.results, args.out, args.analysis))


if __name__ == "__main__":
  main()

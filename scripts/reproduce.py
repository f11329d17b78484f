"""Runs every arm of a study, then makes its tables and figures.

  python scripts/reproduce.py <study> [--arg scale=cpu] [--results results]

Equivalent to `python -m experiments.run --config configs/<study>.py:<arg>`
followed by `scripts/make_tables.py` and the study's plot script. Finished
runs are skipped, so a rerun only redoes the tables.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_tables  # noqa: E402
import plot_bwd  # noqa: E402
import plot_freeze  # noqa: E402
import plot_studies  # noqa: E402

from experiments import xla_flags  # noqa: E402, F401  (before jax)

# study -> plot function (study, results, out=None) -> path of the PNG
PLOTS = {**plot_studies.PLOTS, **plot_bwd.PLOTS}


def load_config(study: str, arg: str | None):
  path = os.path.join(ROOT, "configs", f"{study}.py")
  if not os.path.exists(path):
    names = sorted(
      f[:-3]
      for f in os.listdir(os.path.join(ROOT, "configs"))
      if f.endswith(".py") and not f.startswith("_") and f != "common.py"
    )
    raise SystemExit(f"no config {path}; studies: {', '.join(names)}")
  module = importlib.import_module(f"configs.{study}")
  config = module.get_config(arg)
  config.lock()
  return config


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("study")
  ap.add_argument("--arg", default=None, help="config argument, e.g. scale=cpu")
  ap.add_argument("--results", default="results")
  args = ap.parse_args(argv)
  from experiments import study as study_lib

  config = load_config(args.study, args.arg)
  config.unlock()
  config.log.results_dir = args.results
  config.lock()
  t0 = time.time()
  study_lib.run_study(config)
  print(f"runs done in {time.time() - t0:.0f}s", flush=True)
  print(make_tables.make(args.study, args.results))
  plot = PLOTS.get(args.study, plot_freeze.plot)
  try:
    print(plot(args.study, args.results))
  except ValueError as e:  # a study without curves to plot
    print(f"no figure: {e}")


if __name__ == "__main__":
  main()

"""Runs every arm of a study, then makes its table and figure.

`reproduce(study)` is `python -m experiments.run --config
configs/<study>.py:<arg>` followed by `tables.make` and `figures.plot`.
Finished runs are skipped, so a rerun only redoes the tables. Command line:
`python -m scripts.reproduce <study>`.
"""

from __future__ import annotations

import importlib
import os
import time

from experiments import xla_flags  # noqa: F401  (before jax)
from experiments.analysis import figures, studies, tables


def load_config(study: str, arg: str | None):
  """The study's locked config; a name that is not a study lists them."""
  known = studies.names()
  if study not in known:
    path = os.path.join(studies.CONFIGS, f"{study}.py")
    what = "not a study" if os.path.exists(path) else "no such config"
    raise SystemExit(f"{study}: {what}; studies: {', '.join(known)}")
  module = importlib.import_module(f"configs.{study}")
  config = module.get_config(arg)
  config.lock()
  return config


def reproduce(
  study: str, arg: str | None = None, results: str = "results"
) -> None:
  """Runs the study (skipping finished runs), prints its table and figure."""
  from experiments import study as study_lib

  config = load_config(study, arg)
  config.unlock()
  config.log.results_dir = results
  config.lock()
  t0 = time.time()
  study_lib.run_study(config)
  print(f"runs done in {time.time() - t0:.0f}s", flush=True)
  print(tables.make(study, results))
  try:
    print(figures.plot(study, results))
  except ValueError as e:  # a study without curves to plot
    print(f"no figure: {e}")

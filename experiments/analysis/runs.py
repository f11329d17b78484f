"""Result runs as the analyses read them, from the files alone.

A run is one `results/<study>/<arm>/seed<k>/` directory: `config.json`,
`metrics.jsonl` and, once finished, `summary.json` (never the code's
internals).
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np


class Run:
  """One `results/<study>/<arm>/seed<k>` directory, read lazily."""

  def __init__(self, path: str):
    self.path = path
    self.arm = os.path.basename(os.path.dirname(path))
    self.seed = int(os.path.basename(path)[len("seed") :])
    with open(os.path.join(path, "config.json")) as f:
      self.config = json.load(f)
    self._metrics = None

  @property
  def metrics(self) -> list[dict]:
    if self._metrics is None:
      self._metrics = []
      with open(os.path.join(self.path, "metrics.jsonl")) as f:
        for line in f:
          try:
            self._metrics.append(json.loads(line))
          except json.JSONDecodeError:
            break
    return self._metrics

  @property
  def summary(self) -> dict:
    p = os.path.join(self.path, "summary.json")
    if not os.path.exists(p):
      return {}
    with open(p) as f:
      return json.load(f)

  def curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a per-step metric (steps >= 1 that have it)."""
    rows = [
      (r["step"], r[key])
      for r in self.metrics
      if r.get("step", 0) >= 1 and key in r
    ]
    if not rows:
      return np.zeros(0, int), np.zeros(0)
    steps, vals = zip(*rows, strict=True)
    return np.asarray(steps), np.asarray(vals, float)

  def last(self, key: str):
    for r in reversed(self.metrics):
      if key in r:
        return r[key]
    return None


def load_runs(results: str, study: str) -> list[Run]:
  paths = sorted(glob.glob(os.path.join(results, study, "*", "seed*")))
  runs = [
    Run(p) for p in paths if os.path.exists(os.path.join(p, "config.json"))
  ]
  if not runs:
    raise FileNotFoundError(
      f"no runs under {os.path.join(results, study)}; run "
      f"`python -m experiments.run --config configs/{study}.py` first"
    )
  return runs


def declared(runs: list[Run], key: str, override: str | None = None) -> str:
  """What the runs' configs name for `study.<key>` (`analysis`, `figure`):
  the study declares it in its config, and every run carries it in its
  config.json. `override` wins (runs made before the key existed); an
  empty value, which declares nothing, yields to the others' one."""
  if override:
    return override
  names = {r.config["study"].get(key) for r in runs}
  if None in names:
    raise ValueError(
      f"runs of {runs[0].config['study']['name']!r} have no study.{key} in "
      f"their config.json (made before studies declared it): pass "
      f"--{key} NAME, or rerun the study"
    )
  if len(names) > 1:
    names.discard("")  # declared nothing: runs made before it was named
  if len(names) > 1:
    raise ValueError(
      f"the runs of {runs[0].config['study']['name']!r} name different "
      f"study.{key} values: {sorted(names)}"
    )
  return names.pop()

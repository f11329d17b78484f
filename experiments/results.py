"""Result files: `results/<study>/<arm>/seed<k>/`.

  config.json    the resolved config of the run
  env.json       versions, devices, git revision, command-line overrides
  metrics.jsonl  one JSON object per line, appended and flushed as it happens
  summary.json   written last; its presence marks the run finished
  checkpoints/   orbax checkpoints

Scripts read these files, never the code's internals.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys

import jax
import numpy as np


def run_dir(config) -> str:
  arm = config.study.arm or "default"
  return os.path.join(
    config.log.results_dir, config.study.name, arm, f"seed{config.train.seed}"
  )


def is_finished(path: str) -> bool:
  return os.path.exists(os.path.join(path, "summary.json"))


def _plain(x):
  """JSON-ready: numpy scalars to Python, non-finite floats to strings."""
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if isinstance(x, (np.generic, np.ndarray, jax.Array)):
    return _plain(np.asarray(x).tolist())
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  return x


def write_json(path: str, obj) -> None:
  """Writes atomically (temp file, then rename), so a kill leaves no half."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(_plain(obj), f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def read_json(path: str):
  with open(path) as f:
    return json.load(f)


class MetricsWriter:
  """Appends metrics as JSON lines, flushed per line.

  On resume from step `s`, lines for steps after `s` (written after the last
  checkpoint by the killed run) are dropped first, so the file holds each
  step once and matches an uninterrupted run.
  """

  def __init__(self, path: str, resume_step: int = 0):
    self.path = path
    if os.path.exists(path):
      kept = []
      with open(path) as f:
        for line in f:
          try:
            rec = json.loads(line)
          except json.JSONDecodeError:
            break  # a line cut by the kill
          if rec.get("step", 0) <= resume_step:
            kept.append(line if line.endswith("\n") else line + "\n")
      with open(path, "w") as f:
        f.writelines(kept)
    self._f = open(path, "a")

  def write(self, record: dict) -> None:
    self._f.write(json.dumps(_plain(record), sort_keys=True) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_metrics(path: str) -> list[dict]:
  """All records of a metrics.jsonl file (a cut last line is ignored)."""
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


def git_revision() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    rev = subprocess.run(
      ["git", "rev-parse", "HEAD"],
      cwd=here,
      capture_output=True,
      text=True,
      timeout=10,
      check=True,
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"],
      cwd=here,
      capture_output=True,
      text=True,
      timeout=10,
      check=True,
    ).stdout.strip()
    return rev + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def environment(overrides: dict) -> dict:
  import flax
  import ml_dtypes
  import optax

  import lowprec

  return {
    "python": sys.version.split()[0],
    "platform": platform.platform(),
    "versions": {
      "jax": jax.__version__,
      "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
      "flax": flax.__version__,
      "optax": optax.__version__,
      "ml_dtypes": ml_dtypes.__version__,
      "numpy": np.__version__,
      "lowprec": getattr(lowprec, "__version__", "0.1.0"),
    },
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "process_count": jax.process_count(),
    "git_revision": git_revision(),
    "argv": sys.argv,
    "overrides": overrides,
  }

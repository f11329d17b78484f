"""Result files: `results/<study>/<arm>/seed<k>/`.

  config.json    the resolved config of the run
  env.json       versions, devices, git revision, command-line overrides
  metrics.jsonl  one JSON object per line, appended and flushed as it happens
  summary.json   written last; its presence marks the run finished
  checkpoints/   orbax checkpoints

Scripts read these files, never the code's internals.

The split with `ledger`: this module owns what the files are (their paths,
formats, atomic writes, the metrics writer that resumes without duplicating
or dropping lines); `ledger` owns who may write them and when (the lock,
the config fingerprint, restarts).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile

import jax
import numpy as np

from experiments import distributed, faults


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


def _file_mode() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return 0o666 & ~mask


_FILE_MODE = _file_mode()


def write_json(path: str, obj) -> None:
  """Writes atomically: a temp file in the same directory, then a rename.

  A kill at any moment leaves either the old file or the new one, never a
  half; the temp file is flushed to disk before the rename.
  """
  data = _plain(obj)
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(
    dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp"
  )
  try:
    os.fchmod(fd, _FILE_MODE)  # mkstemp's 0600, widened as open() would
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=2, sort_keys=True)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    faults.point("during_write", os.path.basename(path))
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
  """Makes a rename in `directory` durable (best effort)."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def read_json(path: str):
  """The parsed JSON file; a decode error names the file and the fix."""
  with open(path) as f:
    text = f.read()
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(
      f"{path} is not valid JSON ({e}): the file was cut or edited"
    ) from None


class MetricsError(ValueError):
  """A metrics.jsonl line that cannot be read, or steps that do not fit."""


def _parse_lines(path: str) -> tuple[list[tuple[int, str, dict]], bool]:
  """(line number, text, record) of every line, and whether a cut last line
  was dropped. A bad line before the last raises `MetricsError`."""
  with open(path) as f:
    lines = f.read().split("\n")
  if lines and lines[-1] == "":
    lines.pop()
  out, torn = [], False
  for i, line in enumerate(lines, start=1):
    try:
      rec = json.loads(line)
      if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        raise ValueError("not a JSON object with an integer 'step'")
    except ValueError as e:
      if i == len(lines):
        torn = True  # cut by a kill mid-write; the rerun writes it again
        break
      raise MetricsError(
        f"{path}:{i}: unreadable metrics line ({e}): {line[:80]!r}. Lines "
        "before the last are written whole, so this one was edited or "
        "damaged; no line has been dropped. Repair that line (or restore "
        "the file), or start the run over with --restart (deletes its "
        "files) or in another --config.log.results_dir"
      ) from None
    out.append((i, line, rec))
  return out, torn


class MetricsWriter:
  """Appends metrics as JSON lines, flushed per line.

  On resume from step `s` the file must hold one line for each step 0..s,
  in order (lines for later steps, written after the last checkpoint by a
  killed run, are dropped: the rerun writes them again, identically). A cut
  last line is dropped; any other unreadable line, or missing or repeated
  steps up to `s`, raise `MetricsError` naming the file and line and leave
  the file as it is. From step 0 the file starts empty. The trimmed file
  replaces the old one atomically. `last` is the last kept record.
  """

  def __init__(self, path: str, resume_step: int = 0):
    self.path = path
    self.last = None
    if os.path.exists(path):
      self._trim(resume_step)
    elif resume_step:
      raise MetricsError(
        f"{path} is missing, but the run resumes from its checkpoint at step "
        f"{resume_step}: the metrics of steps 0..{resume_step} would be lost. "
        "Restore the file, or start the run over with --restart (deletes its "
        "files) or in another --config.log.results_dir"
      )
    self._f = open(path, "a")

  def _trim(self, step: int) -> None:
    parsed, torn = _parse_lines(self.path)
    kept = [(i, line, r) for i, line, r in parsed if step and r["step"] <= step]
    steps = [r["step"] for _, _, r in kept]
    if steps != list(range(step + 1)) and step:
      where = next(
        (
          f"line {i} has step {r['step']}, expected {k}"
          for k, (i, _, r) in enumerate(kept)
          if r["step"] != k
        ),
        f"the last step kept is {steps[-1] if steps else 'none'}",
      )
      raise MetricsError(
        f"{self.path} does not hold one line per step 0..{step} (the step "
        f"of the checkpoint restored): {where}. Nothing was changed. Restore "
        "the file, or start the run over with --restart (deletes its files) "
        "or in another --config.log.results_dir"
      )
    if len(kept) == len(parsed) and not torn:
      self.last = kept[-1][2] if kept else None
      return
    fd, tmp = tempfile.mkstemp(
      dir=os.path.dirname(os.path.abspath(self.path)),
      prefix=".metrics.jsonl.",
      suffix=".tmp",
    )
    os.fchmod(fd, _FILE_MODE)
    with os.fdopen(fd, "w") as f:
      f.writelines(line + "\n" for _, line, _ in kept)
      f.flush()
      os.fsync(f.fileno())
    faults.point("during_metrics_trim")
    os.replace(tmp, self.path)
    self.last = kept[-1][2] if kept else None

  def write(self, record: dict) -> None:
    self._f.write(json.dumps(_plain(record), sort_keys=True) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_metrics(path: str) -> list[dict]:
  """All records of a metrics.jsonl file (a cut last line is ignored).

  Raises:
    MetricsError: a line before the last is unreadable (names file:line).
  """
  return [r for _, _, r in _parse_lines(path)[0]]


def read_whole_metrics(path: str) -> list[tuple[int, dict]]:
  """`(line number, record)` of every line of a metrics.jsonl, for readers
  that take a run's records as its measurements (`scripts.advise`).

  Stricter than `read_metrics`: a cut last line is refused too (a run
  being written, or killed mid-line), and the steps must run 0, 1, ...,
  one line each, as `MetricsWriter` leaves them.

  Raises:
    MetricsError: an unreadable line (cut or not) or a step out of place;
      the message names the file, the line and the fix.
  """
  parsed, torn = _parse_lines(path)
  if torn:
    raise MetricsError(
      f"{path}:{len(parsed) + 1}: the last line is not a whole record (a "
      "run being written, or one killed mid-line): wait for the run, or "
      "resume it (its rerun writes that step again), then read it again"
    )
  for k, (i, _, r) in enumerate(parsed):
    if r["step"] != k:
      raise MetricsError(
        f"{path}:{i}: step {r['step']} where step {k} belongs: a run writes "
        "one line per step, in order, from step 0, so the file was edited "
        "or mixed with another run's. Restore the file, or rerun the run "
        "with --restart (deletes its files)"
      )
  return [(i, r) for i, _, r in parsed]


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
    **distributed.topology(),  # process_count and each one's devices
    "git_revision": git_revision(),
    "argv": sys.argv,
    "overrides": overrides,
  }

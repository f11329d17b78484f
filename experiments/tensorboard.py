"""Metrics as TensorBoard event files, when `log.tensorboard` is on.

The JSONL metrics stay the record; the event files are for watching a run
live (`tensorboard --logdir results/`). Written by process 0 only, through
tensorboardX, an optional dependency (`pip install '.[tensorboard]'`).
"""

from __future__ import annotations

import math
import os

SUBDIR = "tensorboard"


def require() -> None:
  """Raises ValueError naming the fix if tensorboardX is not installed."""
  try:
    import tensorboardX  # noqa: F401
  except ImportError as e:
    raise ValueError(
      "log.tensorboard=True needs tensorboardX: .venv/bin/pip install "
      "'.[tensorboard]' (or set --config.log.tensorboard=False)"
    ) from e


class EventWriter:
  """Writes each metrics record's finite scalars at its step."""

  def __init__(self, run_dir: str):
    require()
    from tensorboardX import SummaryWriter

    self._writer = SummaryWriter(os.path.join(run_dir, SUBDIR))

  def write(self, record: dict) -> None:
    step = int(record["step"])
    for key, value in record.items():
      if key == "step" or isinstance(value, bool):
        continue
      if isinstance(value, int | float) and math.isfinite(value):
        self._writer.add_scalar(key, value, step)

  def close(self) -> None:
    self._writer.close()

"""Progress lines and TensorBoard event files, through the real entry point."""

import glob
import os
import struct

from tensorboardX.proto import event_pb2

from tests.train_test import _losses, _run


def _scalars(run_dir):
  """{tag: {step: value}} from the TFRecord event files, read by hand."""
  out = {}
  for path in glob.glob(os.path.join(run_dir, "tensorboard", "events.*")):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out.setdefault(v.tag, {})[event.step] = v.simple_value
  return out


def test_tensorboard_events_mirror_the_metrics_and_progress_skips_compile(
  tmp_path,
):
  out = _run(
    tmp_path,
    "--config=configs/smoke.py:arm=rn_bf16",
    "--config.log.tensorboard=True",
    devices=1,
  )
  assert out.returncode == 0, out.stdout + out.stderr
  lines = out.stdout.splitlines()
  compiling = [
    i for i, s in enumerate(lines) if "compiling the train step" in s
  ]
  compiled = [i for i, s in enumerate(lines) if "compiled (" in s]
  progress = [i for i, s in enumerate(lines) if "steps/s" in s]
  assert compiling and compiled and progress
  assert compiling[0] < compiled[0] < progress[0]
  scalars = _scalars(os.path.join(tmp_path, "smoke", "rn_bf16", "seed0"))
  want = {s: loss for s, loss, _ in _losses(tmp_path) if loss is not None}
  assert set(scalars["loss"]) == set(want)
  for step, loss in want.items():
    assert abs(scalars["loss"][step] - loss) <= 1e-6 * abs(loss)
  assert "erased_fraction" in scalars and "val_loss" in scalars

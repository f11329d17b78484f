"""`scripts.peer_stream`: the PyTorch side's gradient stream, and a pulse.

The checksums below were taken from the arrays that the PyTorch side's
own generator writes (numpy 2.4, ml_dtypes 0.7): the first 20 steps of
gradients, the initial weights and the learning rates, byte for byte.
"""

import zlib

import numpy as np

from scripts import peer_stream


def test_stream_is_the_recorded_one_byte_for_byte():
  g, w0, lr = peer_stream.stream(steps=20)
  assert g.shape == (20, 16384) and g.dtype == np.float32
  assert zlib.crc32(g.tobytes()) == 294644744
  assert zlib.crc32(w0.tobytes()) == 2488168456
  assert zlib.crc32(lr.tobytes()) == 3416621296
  np.testing.assert_array_equal(
    g[19, :4],
    np.float32([0.1953125, 0.076171875, 0.0015411376953125, -0.60546875]),
  )
  # bf16 values; the schedule's warmup, peak and end.
  bf = g.astype(np.float32).view(np.uint32) & 0xFFFF
  assert not bf.any()
  np.testing.assert_array_equal(lr[[0, 49, 50]], np.float32([2e-5, 1e-3, 1e-3]))
  assert 0 < lr[-1] < 1e-8


def test_table_has_a_pulse():
  """Twenty steps of two recipes: finite distances from float32 AdamW,
  the bytes of two 8-bit moments with a float32 scale per 256."""
  lines = []
  rows = peer_stream.table(
    steps=20, seeds=1, recipes=peer_stream.RECIPES[:2], out=lines.append
  )
  assert len(rows) == 2 and len(lines) == 5
  for label, size, rms, peer, _ in rows:
    assert size == 2 + 8 / 256, label
    assert 0 < rms < 1000 and peer, label

"""Counter-based sampling: which examples a batch holds, from (seed, step).

Every batch is a pure function of `(seed, step, split)`: the random bits for
step `t` come from a Philox4x64 bit generator keyed by `(seed, stream)` with
its counter set to `t << 128`, so step `t`'s batch is computed directly,
without replaying steps `0..t-1`, and a resumed run reads the same batches as
an uninterrupted one. Only raw Philox words are used (`random_raw`), whose
stream NumPy keeps stable across versions; no `Generator` method is involved.
"""

from __future__ import annotations

import numpy as np

# Stream ids keep the splits (and other uses) statistically independent.
SPLITS = {"train": 1, "val": 2}
_U64 = 1 << 64


def check_split(split: str) -> int:
  """Returns the stream id of `split`; raises ValueError for an unknown one."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
  return SPLITS[split]


def random_bits(seed: int, stream: int, counter: int, n: int) -> np.ndarray:
  """Returns `n` uint64 words of Philox keyed by (seed, stream) at `counter`.

  Args:
    seed: the run's seed, in [0, 2**64).
    stream: a small id separating uses of the same seed, in [0, 2**64).
    counter: the block index (a step or an epoch), in [0, 2**128).
    n: how many words.

  Returns:
    uint64 array of shape [n]; the same arguments give the same words.

  Raises:
    ValueError: if `seed` or `stream` is negative or does not fit 64 bits.

  Example:
    ```python
    random_bits(0, 1, 5, 2).dtype
    # dtype('uint64')
    ```
  """
  seed, stream, counter = int(seed), int(stream), int(counter)
  if not 0 <= seed < _U64 or not 0 <= stream < _U64:
    raise ValueError(
      f"seed and stream must be in [0, 2**64); got {seed}, {stream}"
    )
  if not 0 <= counter < _U64 * _U64:
    raise ValueError(f"counter must be in [0, 2**128); got {counter}")
  gen = np.random.Philox(key=(stream << 64) | seed, counter=counter << 128)
  return gen.random_raw(int(n))


def window_starts(
  seed: int, step: int, split: str, *, batch_size: int, num_starts: int
) -> np.ndarray:
  """Start positions of a step's windows, uniform over [0, num_starts).

  The reduction `bits mod num_starts` has a relative bias below
  `num_starts / 2**64` (under 1e-9 for any real token file).

  Args:
    seed: the run's seed.
    step: the training step, >= 0.
    split: "train" or "val".
    batch_size: number of windows.
    num_starts: number of valid start positions (> 0).

  Returns:
    int64 array of shape [batch_size].

  Example:
    ```python
    window_starts(0, 3, "train", batch_size=4, num_starts=10).shape
    # (4,)
    ```
  """
  bits = random_bits(seed, check_split(split), step, batch_size)
  return (bits % np.uint64(num_starts)).astype(np.int64)


def permutation(seed: int, stream: int, counter: int, n: int) -> np.ndarray:
  """A permutation of range(n), a pure function of its arguments."""
  keys = random_bits(seed, stream, counter, n)
  return np.argsort(keys, kind="stable").astype(np.int64)


def epoch_indices(
  seed: int, step: int, split: str, *, batch_size: int, num_examples: int
) -> np.ndarray:
  """Example indices of a step's batch, drawn without replacement per epoch.

  Position `p = step * batch_size + i` of the example stream is element
  `p % num_examples` of epoch `p // num_examples`'s permutation; a batch may
  straddle two epochs. Every epoch visits each example exactly once.

  Args:
    seed: the run's seed.
    step: the training step, >= 0.
    split: "train" or "val".
    batch_size: number of examples in a batch.
    num_examples: size of the array dataset (> 0).

  Returns:
    int64 array of shape [batch_size] with values in [0, num_examples).

  Example:
    ```python
    sorted(epoch_indices(0, 0, "train", batch_size=5, num_examples=5))
    # [0, 1, 2, 3, 4]
    ```
  """
  stream = check_split(split)
  pos = step * batch_size + np.arange(batch_size, dtype=np.int64)
  epochs, within = np.divmod(pos, num_examples)
  out = np.empty(batch_size, dtype=np.int64)
  for epoch in np.unique(epochs):
    sel = epochs == epoch
    out[sel] = permutation(seed, stream, int(epoch), num_examples)[within[sel]]
  return out


def even_starts(count: int, num_starts: int) -> np.ndarray:
  """`count` start positions spread evenly over [0, num_starts), int64."""
  if count <= 1:
    return np.zeros(count, dtype=np.int64)
  i = np.arange(count, dtype=np.int64)
  return (i * (num_starts - 1)) // (count - 1)

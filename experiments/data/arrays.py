"""In-memory array data sets, and synthetic regression on random features.

`ArrayData` serves (inputs, targets) batches from arrays held in memory
(images, regression features) with the same interface as
`tokens.TokenData`: the global batch of a step is a pure function of
(seed, step, split), drawn without replacement within each epoch.

`regression_data` makes the "linear regression on frozen random features"
problem: inputs `x ~ N(0, I)` in `d_in` dimensions, a frozen random map
`W ~ N(0, 1/d_in)` of shape [d_in, n_features], features
`phi = sqrt(2) * relu(x W)` (unit second moment), a teacher
`w* ~ N(0, 1/n_features)` and targets `y = phi w* + noise * eps`,
`eps ~ N(0, 1)`. The model learns a linear map of `phi` to `y`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from experiments.data import sampling

# One Philox stream per component, so the draws of one do not depend on the
# sizes of the others.
_STREAMS = {"w": 11, "teacher": 12, "x": 13, "eps": 14}


class ArrayData:
  """(inputs, targets) batches from in-memory train and held-out arrays.

  The "val" split is the held-out (test) arrays. `batch(step)` draws the
  global batch of a step without replacement within each epoch of the train
  arrays, as a pure function of (seed, step, split); `rows` picks a subset of
  its rows for one process's shard. `eval_batches()` covers the held-out
  arrays in order, in full batches (a final partial batch is dropped so
  every batch has the same shape).

  Attributes:
    train_x, train_y, test_x, test_y: the arrays (first axis: examples).
    batch_size: global batch size.
    seed: seed of the sampling order.
    num_classes: for classification sets, else None.

  Example:
    >>> x, y = np.zeros((10, 3), np.float32), np.arange(10)
    >>> data = ArrayData(x, y, x, y, batch_size=4, seed=0)
    >>> data.batch(step=2)[0].shape
    (4, 3)
  """

  def __init__(
    self,
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    *,
    batch_size: int,
    seed: int = 0,
    num_classes: int | None = None,
  ):
    """Wraps the arrays; raises ValueError on mismatched lengths."""
    for x, y, name in ((train_x, train_y, "train"), (test_x, test_y, "test")):
      if len(x) != len(y) or len(x) == 0:
        raise ValueError(
          f"{name} inputs and targets need the same nonzero length; got "
          f"{len(x)} and {len(y)}"
        )
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    self.train_x, self.train_y = train_x, train_y
    self.test_x, self.test_y = test_x, test_y
    self.batch_size = batch_size
    self.seed = seed
    self.num_classes = num_classes

  def __repr__(self) -> str:
    return (
      f"ArrayData(train={self.train_x.shape}, test={self.test_x.shape}, "
      f"batch_size={self.batch_size}, seed={self.seed})"
    )

  def _arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    sampling.check_split(split)
    if split == "train":
      return self.train_x, self.train_y
    return self.test_x, self.test_y

  def batch(
    self,
    step: int,
    split: str = "train",
    rows: slice | np.ndarray | None = None,
  ) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (or its `rows`) as (inputs, targets).

    Args:
      step: training step, >= 0.
      split: "train" or "val" (the held-out arrays).
      rows: optional slice or index array into the global batch's rows.

    Returns:
      (inputs, targets) with leading dimension batch_size (or len(rows)).
    """
    if step < 0:
      raise ValueError(f"step must be >= 0; got {step}")
    x, y = self._arrays(split)
    idx = sampling.epoch_indices(
      self.seed, step, split, batch_size=self.batch_size, num_examples=len(x)
    )
    if rows is not None:
      idx = idx[rows]
    return x[idx], y[idx]

  def eval_batches(
    self, num_batches: int | None = None, rows: Callable | None = None
  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Consecutive full batches of the held-out arrays, in order.

    Args:
      num_batches: how many (at most the number of full batches); default
        all full batches, or one smaller batch if fewer than `batch_size`
        held-out examples exist.
      rows: `num_rows -> slice`, the rows of each batch to keep (a process's
        share of it); default all.

    Returns:
      A list of (inputs, targets); the same on every call and seed.
    """
    n = len(self.test_x)
    full = n // self.batch_size
    if full == 0:
      spans = [(0, n)]
    else:
      count = full if num_batches is None else min(num_batches, full)
      b = self.batch_size
      spans = [(i * b, (i + 1) * b) for i in range(count)]
    out = []
    for lo, hi in spans:
      part = slice(lo, hi)
      if rows is not None:
        r = rows(hi - lo)
        part = slice(
          lo + (r.start or 0), lo + (hi - lo if r.stop is None else r.stop)
        )
      out.append((self.test_x[part], self.test_y[part]))
    return out


class Regression(NamedTuple):
  """Synthetic regression data.

  Attributes:
    features: float32 [n, n_features], `sqrt(2) * relu(x W)`.
    targets: float32 [n], `features @ teacher + noise * eps`.
    teacher: float32 [n_features], the teacher weights `w*`.
  """

  features: np.ndarray
  targets: np.ndarray
  teacher: np.ndarray


def _normal(seed: int, part: str, shape: tuple[int, ...]) -> np.ndarray:
  key = (_STREAMS[part] << 64) | seed
  gen = np.random.Generator(np.random.Philox(key=key))
  return gen.standard_normal(shape)


def regression_data(
  seed: int, n: int, d_in: int, n_features: int, noise: float
) -> Regression:
  """Linear regression on frozen random features; a pure function.

  See the module docstring for the model. Each component (map, teacher,
  inputs, noise) has its own Philox stream keyed by `seed`, so the random
  draws of the first `k` rows are the same for every `n >= k`. Computed in
  float64, returned as float32.

  Args:
    seed: problem seed, in [0, 2**64).
    n: number of examples.
    d_in: input dimension.
    n_features: number of random features.
    noise: standard deviation of the label noise (>= 0).

  Returns:
    `Regression(features, targets, teacher)`.

  Raises:
    ValueError: a size below 1, negative noise or seed.

  Example:
    >>> r = regression_data(0, n=100, d_in=8, n_features=32, noise=0.1)
    >>> r.features.shape, r.targets.shape, r.teacher.shape
    ((100, 32), (100,), (32,))
  """
  if min(n, d_in, n_features) < 1 or noise < 0 or seed < 0:
    raise ValueError(
      f"need n, d_in, n_features >= 1, noise >= 0 and seed >= 0; got "
      f"n={n}, d_in={d_in}, n_features={n_features}, noise={noise}, "
      f"seed={seed}"
    )
  w = _normal(seed, "w", (d_in, n_features)) / np.sqrt(d_in)
  teacher = _normal(seed, "teacher", (n_features,)) / np.sqrt(n_features)
  x = _normal(seed, "x", (n, d_in))
  features = np.sqrt(2.0) * np.maximum(x @ w, 0.0)
  targets = features @ teacher + noise * _normal(seed, "eps", (n,))
  return Regression(
    features.astype(np.float32),
    targets.astype(np.float32),
    teacher.astype(np.float32),
  )

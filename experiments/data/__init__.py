"""Data for the studies: token files, the built-in corpus, images, regression.

Every data set serves `batch(step, split="train", rows=None)`, the global
(inputs, targets) batch of a step as a pure function of (seed, step, split),
so a resumed run reads the same batches and any step's batch is computed
directly; `rows` selects one process's shard of it. `eval_batches()` is a
fixed evaluation set, the same for every seed.

Configs name a data set by `data.name`; `build` looks it up in `DATASETS`:

* `builtin_text`: Python's own documentation, byte-level (no download);
* `tokens`: `train.bin` / `val.bin` uint16 token files in `data_dir`;
* `mnist`: the four MNIST IDX files in `data_dir`;
* `digits`: scikit-learn's bundled 8x8 digits, the offline MNIST stand-in;
* `regression`: linear regression on frozen random features.

Example:
  >>> data = build("builtin_text", seq_len=64, batch_size=8, seed=0)
  >>> inputs, targets = data.batch(step=0)
  >>> inputs.shape
  (8, 64)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from experiments.data.arrays import ArrayData, Regression, regression_data
from experiments.data.corpus import (
  builtin_text_bytes,
  builtin_text_dir,
  default_cache_dir,
)
from experiments.data.images import (
  MNIST_FILES,
  NUM_CLASSES,
  load_digits,
  load_mnist,
  read_idx,
)
from experiments.data.text import (
  list_text_files,
  prepare_text,
  write_token_files,
)
from experiments.data.tokenizer import (
  Tokenizer,
  byte_tokenizer,
  get_tokenizer,
  gpt2_tokenizer,
)
from experiments.data.tokens import TokenData, open_tokens, read_meta
from lowprec.grids import choices as names


def builtin_text(
  *,
  seq_len: int,
  batch_size: int,
  seed: int = 0,
  cache_dir: str | None = None,
  vocab_size: int | None = None,
  corpus: str = "text",
) -> TokenData:
  """The built-in corpus (built and cached on first use) as `TokenData`.

  Args:
    seq_len: window length.
    batch_size: global batch size.
    seed: sampling seed.
    cache_dir: cache parent directory; see `corpus.default_cache_dir`.
    vocab_size: the model's vocabulary if it is to be checked (>= 256);
      default 256 from `meta.json`.
    corpus: "text" (Python's documentation) or "code" (its sources).

  Returns:
    A `TokenData` with byte-level ids.
  """
  return TokenData(
    builtin_text_dir(cache_dir, corpus),
    seq_len=seq_len,
    batch_size=batch_size,
    seed=seed,
    vocab_size=vocab_size,
  )


# The built-in code corpus (standard-library sources, byte-level; see
# `corpus`): `builtin_text`'s arguments.
builtin_code = functools.partial(builtin_text, corpus="code")


def token_files(
  *,
  data_dir: str,
  seq_len: int,
  batch_size: int,
  seed: int = 0,
  vocab_size: int | None = None,
) -> TokenData:
  """Token files `train.bin` / `val.bin` in `data_dir` as `TokenData`."""
  return TokenData(
    data_dir,
    seq_len=seq_len,
    batch_size=batch_size,
    seed=seed,
    vocab_size=vocab_size,
  )


def mnist(*, data_dir: str, batch_size: int, seed: int = 0) -> ArrayData:
  """MNIST from the IDX files in `data_dir` (see `load_mnist`)."""
  return ArrayData(
    *load_mnist(data_dir),
    batch_size=batch_size,
    seed=seed,
    num_classes=NUM_CLASSES,
  )


def digits(*, batch_size: int, seed: int = 0, num_test: int = 297) -> ArrayData:
  """scikit-learn's bundled 8x8 digits (see `load_digits`)."""
  return ArrayData(
    *load_digits(num_test),
    batch_size=batch_size,
    seed=seed,
    num_classes=NUM_CLASSES,
  )


def regression(
  *,
  batch_size: int,
  seed: int = 0,
  data_seed: int = 0,
  num_train: int = 1024,
  num_test: int = 1024,
  d_in: int = 32,
  n_features: int = 256,
  noise: float = 0.1,
) -> ArrayData:
  """Regression on frozen random features (see `regression_data`).

  One call of `regression_data(data_seed, num_train + num_test, ...)`; the
  first `num_train` rows train, the rest are held out. `data_seed` fixes the
  problem; `seed` only the batch order, so seeds of a study share a problem.

  Returns:
    `ArrayData` with float32 features [N, n_features] and targets [N].
  """
  r = regression_data(data_seed, num_train + num_test, d_in, n_features, noise)
  return ArrayData(
    r.features[:num_train],
    r.targets[:num_train],
    r.features[num_train:],
    r.targets[num_train:],
    batch_size=batch_size,
    seed=seed,
  )


DATASETS: dict[str, Callable[..., TokenData | ArrayData]] = {
  "builtin_text": builtin_text,
  "builtin_code": builtin_code,
  "tokens": token_files,
  "mnist": mnist,
  "digits": digits,
  "regression": regression,
}


def build(name: str, **kwargs) -> TokenData | ArrayData:
  """Builds the data set `name` from `DATASETS` with keyword arguments.

  Args:
    name: a key of `DATASETS`.
    **kwargs: the constructor's arguments (e.g. `seq_len`, `batch_size`,
      `seed`).

  Returns:
    A `TokenData` or `ArrayData`.

  Raises:
    ValueError: unknown name (the message lists the valid ones and the
      closest), or arguments the constructor does not take or lacks.

  Example:
    >>> data = build("regression", batch_size=32, seed=1)
    >>> data.batch(0)[0].shape
    (32, 256)
  """
  names.check_choice("data set", name, DATASETS)
  ctor = DATASETS[name]
  try:
    inspect.signature(ctor).bind(**kwargs)
  except TypeError as e:
    params = ", ".join(inspect.signature(ctor).parameters)
    raise ValueError(
      f"data set {name!r} takes {params}; got {sorted(kwargs)} ({e})"
    ) from None
  return ctor(**kwargs)


__all__ = [
  "DATASETS",
  "MNIST_FILES",
  "ArrayData",
  "Regression",
  "TokenData",
  "Tokenizer",
  "build",
  "builtin_code",
  "builtin_text",
  "builtin_text_bytes",
  "builtin_text_dir",
  "byte_tokenizer",
  "default_cache_dir",
  "digits",
  "get_tokenizer",
  "gpt2_tokenizer",
  "list_text_files",
  "load_digits",
  "load_mnist",
  "mnist",
  "open_tokens",
  "prepare_text",
  "read_idx",
  "read_meta",
  "regression",
  "regression_data",
  "token_files",
  "write_token_files",
]

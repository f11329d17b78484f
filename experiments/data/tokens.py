"""Token files: flat little-endian uint16 ids, memory-mapped (nanoGPT layout).

A data directory holds `train.bin` and `val.bin`, each the raw bytes of a
1-D `uint16` little-endian array of token ids with no header, plus an optional
`meta.json` (written by `scripts/prepare_text.py`) giving `vocab_size`. A batch
is `batch_size` windows of `seq_len + 1` consecutive tokens; inputs are the
first `seq_len`, targets the last `seq_len` (inputs shifted by one). Window
starts are a pure function of (seed, step, split), see `sampling`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from experiments.data import sampling

TOKEN_DTYPE = np.dtype("<u2")
# Files up to this many tokens are range-checked whole when opened; larger
# ones in evenly spaced chunks (and every batch is checked as it is read).
_FULL_CHECK_TOKENS = 1 << 26
_FULL_CHECK_CHUNK = 1 << 23
_CHECK_CHUNK = 1 << 20
_CHECK_CHUNKS = 64
_FIX = "make token files with `python -m scripts.prepare_text`"


def token_path(data_dir: str, split: str) -> str:
  """Returns `<data_dir>/<split>.bin` after checking the split name."""
  sampling.check_split(split)
  return os.path.join(data_dir, f"{split}.bin")


def read_meta(data_dir: str) -> dict | None:
  """Returns the parsed `meta.json` of a token directory, or None if absent."""
  path = os.path.join(data_dir, "meta.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    meta = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(
      f"{path} is not valid JSON ({e}); re-create the token directory "
      f"({_FIX}), or delete meta.json if model.vocab_size is right"
    ) from None
  if not isinstance(meta, dict):
    raise ValueError(f"{path} must hold a JSON object; {_FIX}")
  return meta


def _check_range(
  tokens: np.ndarray, vocab_size: int, where: str, offset: int = 0
) -> None:
  top = int(tokens.max()) if tokens.size else -1
  if top >= vocab_size:
    pos = offset + int(np.argmax(tokens >= vocab_size))
    raise ValueError(
      f"{where}: token id {top} at position {pos} is >= vocab_size "
      f"{vocab_size}. The file was made with a larger vocabulary (GPT-2 BPE "
      "has 50257, bytes 256): set the data/model vocab_size to at least "
      f"{top + 1}, or re-create the file with the intended tokenizer."
    )


def open_tokens(
  path: str, *, seq_len: int, vocab_size: int | None = None
) -> np.memmap:
  """Opens a flat uint16 token file read-only and checks it.

  Files up to 2**26 tokens are range-checked whole (a few milliseconds per
  million tokens); larger ones in 64 evenly spaced 1M-token chunks, and
  `TokenData` checks every batch it reads as well.

  Args:
    path: a `.bin` file of little-endian uint16 token ids, no header.
    seq_len: the window length; the file needs at least `seq_len + 1` tokens.
    vocab_size: if given, every id must be below it (always true from
      65536 on, the most uint16 can address).

  Returns:
    A read-only `np.memmap` of dtype `<u2` and shape [num_tokens].

  Raises:
    FileNotFoundError: the file does not exist.
    ValueError: odd byte size (truncated or not uint16), fewer than
      `seq_len + 1` tokens, or an id >= `vocab_size`.

  Example:
    ```python
    tokens = open_tokens("data/train.bin", seq_len=128, vocab_size=256)
    ```
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"token file {path} not found; {_FIX} (e.g. `python -m "
      f"scripts.prepare_text --input TEXT_DIR --out "
      f"{os.path.dirname(path) or '.'}`), or use data.name = "
      "'builtin_text', which needs no files."
    )
  if vocab_size is not None and vocab_size < 1:
    raise ValueError(f"vocab_size must be >= 1; got {vocab_size}")
  size = os.path.getsize(path)
  if size % TOKEN_DTYPE.itemsize:
    raise ValueError(
      f"{path} is {size} bytes, an odd number: a uint16 token file has an "
      f"even size, so this one is truncated or not uint16 ids; {_FIX}."
    )
  num = size // TOKEN_DTYPE.itemsize
  if num < seq_len + 1:
    raise ValueError(
      f"{path} holds {num} tokens; windows of seq_len={seq_len} need at "
      f"least {seq_len + 1}. Lower model.seq_len or use more text."
    )
  tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", shape=(num,))
  if vocab_size is not None and vocab_size < 1 << 16:
    if num <= _FULL_CHECK_TOKENS:
      for lo in range(0, num, _FULL_CHECK_CHUNK):
        _check_range(tokens[lo : lo + _FULL_CHECK_CHUNK], vocab_size, path, lo)
    else:
      for lo in sampling.even_starts(_CHECK_CHUNKS, num - _CHECK_CHUNK + 1):
        lo = int(lo)
        _check_range(tokens[lo : lo + _CHECK_CHUNK], vocab_size, path, lo)
  return tokens


class TokenData:
  """Train/val token files served as (inputs, targets) batches.

  `batch(step)` returns the global batch of a step: `batch_size` windows whose
  starts are uniform over the file and a pure function of (seed, step, split),
  so any step's batch is computed directly and a resumed run reads the same
  data. `rows` selects a subset of the global batch's rows, so each process
  of a multi-host run reads only its own shard (e.g. inside
  `jax.make_array_from_callback`). `eval_batches()` is a fixed set of windows
  spread evenly over `val.bin`, the same for every seed.

  Attributes:
    data_dir: the directory with `train.bin` and `val.bin`.
    seq_len: window length (inputs and targets are [batch, seq_len]).
    batch_size: global batch size.
    seed: seed of the sampling order.
    vocab_size: the given one, else `meta.json`'s, else None (unchecked).
    meta: the parsed `meta.json`, or None.
    train, val: the memory-mapped token arrays.

  Example:
    ```python
    data = TokenData("data/", seq_len=128, batch_size=8, seed=0)
    inputs, targets = data.batch(step=10)
    inputs.shape, inputs.dtype
    # ((8, 128), dtype('int32'))
    ```
  """

  def __init__(
    self,
    data_dir: str,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    vocab_size: int | None = None,
  ):
    """Opens and checks `train.bin` and `val.bin` in `data_dir`.

    Args:
      data_dir: the token directory.
      seq_len: window length, >= 1.
      batch_size: global batch size, >= 1.
      seed: sampling seed, in [0, 2**64).
      vocab_size: if given, ids must be below it; if None, `meta.json`'s
        `vocab_size` is used when present.

    Raises:
      FileNotFoundError, ValueError: see `open_tokens`.
    """
    if seq_len < 1 or batch_size < 1:
      raise ValueError(
        f"seq_len and batch_size must be >= 1; got {seq_len}, {batch_size}"
      )
    self.data_dir = data_dir
    self.seq_len = seq_len
    self.batch_size = batch_size
    self.seed = seed
    self.meta = read_meta(data_dir)
    if vocab_size is None and self.meta is not None:
      vocab_size = self.meta.get("vocab_size")
    self.vocab_size = vocab_size
    self.train = open_tokens(
      token_path(data_dir, "train"), seq_len=seq_len, vocab_size=vocab_size
    )
    self.val = open_tokens(
      token_path(data_dir, "val"), seq_len=seq_len, vocab_size=vocab_size
    )

  def __repr__(self) -> str:
    return (
      f"TokenData({self.data_dir!r}, seq_len={self.seq_len}, "
      f"batch_size={self.batch_size}, seed={self.seed}, "
      f"vocab_size={self.vocab_size}, train={self.train.size} tokens, "
      f"val={self.val.size} tokens)"
    )

  def _tokens(self, split: str) -> np.memmap:
    sampling.check_split(split)
    return self.train if split == "train" else self.val

  def starts(self, step: int, split: str = "train") -> np.ndarray:
    """Start positions of the global batch of `step`, int64 [batch_size]."""
    if step < 0:
      raise ValueError(f"step must be >= 0; got {step}")
    tokens = self._tokens(split)
    return sampling.window_starts(
      self.seed,
      step,
      split,
      batch_size=self.batch_size,
      num_starts=tokens.size - self.seq_len,
    )

  def windows(
    self, starts: np.ndarray, split: str = "train"
  ) -> tuple[np.ndarray, np.ndarray]:
    """Reads the windows at `starts` as (inputs, targets), int32 [n, seq_len].

    Raises:
      ValueError: a window holds an id >= `vocab_size`.
    """
    tokens = self._tokens(split)
    idx = np.asarray(starts, np.int64)[:, None] + np.arange(self.seq_len + 1)
    window = np.asarray(tokens[idx], dtype=np.int32)
    if self.vocab_size is not None:
      _check_range(window, self.vocab_size, token_path(self.data_dir, split))
    return window[:, :-1], window[:, 1:]

  def batch(
    self,
    step: int,
    split: str = "train",
    rows: slice | np.ndarray | None = None,
  ) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (or its `rows`) as (inputs, targets).

    Args:
      step: training step, >= 0.
      split: "train" or "val".
      rows: optional slice or index array into the global batch's rows.

    Returns:
      (inputs, targets), int32 arrays of shape [rows, seq_len], with
      `targets[:, :-1] == inputs[:, 1:]`.

    Raises:
      ValueError: unknown split, negative step, or an id >= `vocab_size`.
    """
    starts = self.starts(step, split)
    if rows is not None:
      starts = starts[rows]
    return self.windows(starts, split)

  def eval_starts(self, num_batches: int | None = None) -> np.ndarray:
    """Start positions of the fixed evaluation windows, int64 [n, batch].

    Windows are spread evenly over `val.bin`, first to last token. By default
    as many full batches of non-overlapping windows as fit (at least one).
    """
    num_starts = self.val.size - self.seq_len
    if num_batches is None:
      fit = (self.val.size - 1) // self.seq_len
      num_batches = max(1, fit // self.batch_size)
    count = num_batches * self.batch_size
    return sampling.even_starts(count, num_starts).reshape(num_batches, -1)

  def eval_batches(
    self, num_batches: int | None = None, rows: Callable | None = None
  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The fixed evaluation set: `num_batches` (inputs, targets) from val.

    Args:
      num_batches: how many batches; by default as many full batches of
        non-overlapping windows as `val.bin` holds (at least one).
      rows: `num_rows -> slice`, the rows of each batch to read (a process's
        share of it); default all. Only those windows are read.

    Returns:
      A list of (inputs, targets), int32 [batch_size, seq_len]; the same for
      every seed and every call.
    """
    starts = self.eval_starts(num_batches)
    if rows is not None:
      starts = starts[:, rows(starts.shape[1])]
    return [self.windows(s, "val") for s in starts]

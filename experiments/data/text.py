"""Text to token files: list local text, tokenize it, write `.bin` files.

`write_token_files` streams token chunks to `train.bin` / `val.bin` (flat
uint16 little-endian, the layout `tokens.TokenData` reads) with the last
`val_fraction` of the tokens as validation, and writes `meta.json`.
`prepare_text` does the whole job for files and directories; see
`tokenizer` for the tokenizers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence

import numpy as np

from experiments.data.tokenizer import Tokenizer, get_tokenizer
from experiments.data.tokens import TOKEN_DTYPE

DEFAULT_SUFFIXES = (".txt", ".md", ".rst")


def list_text_files(
  inputs: Sequence[str], suffixes: Sequence[str] | None = DEFAULT_SUFFIXES
) -> list[str]:
  """Lists text files, in a deterministic order.

  A file in `inputs` is taken as is. A directory is walked recursively in
  sorted order, skipping names that start with "."; a file is taken when its
  lower-cased suffix is in `suffixes` (all files when `suffixes` is None).

  Args:
    inputs: files and directories, taken in the given order.
    suffixes: file-name endings to take from directories, e.g. (".txt",).

  Returns:
    The file paths.

  Raises:
    FileNotFoundError: an input does not exist.
    ValueError: no file was found.

  Example:
    ```python
    list_text_files(["notes.txt"])
    # ['notes.txt']
    ```
  """
  found = []
  for inp in inputs:
    if os.path.isfile(inp):
      found.append(inp)
      continue
    if not os.path.isdir(inp):
      raise FileNotFoundError(f"input {inp} is neither a file nor a directory")
    for root, dirs, files in os.walk(inp):
      dirs[:] = sorted(d for d in dirs if not d.startswith("."))
      for name in sorted(files):
        if name.startswith("."):
          continue
        if suffixes is None or os.path.splitext(name)[1].lower() in suffixes:
          found.append(os.path.join(root, name))
  if not found:
    raise ValueError(
      f"no text files in {list(inputs)} with suffixes {suffixes}; name files "
      "directly or change the suffixes"
    )
  return found


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""):
      h.update(block)
  return h.hexdigest()


def write_token_files(
  out_dir: str,
  chunks: Iterable[np.ndarray],
  *,
  tokenizer: Tokenizer,
  val_fraction: float = 0.1,
  meta: dict | None = None,
) -> dict:
  """Writes `train.bin`, `val.bin` and `meta.json` from token chunks.

  The chunks are concatenated in order; the last `round(n * val_fraction)`
  tokens become `val.bin`, the rest `train.bin`. Memory stays at one chunk:
  tokens stream to disk and the tail is moved afterwards. Files appear under
  their final names only when complete (`meta.json` last).

  Args:
    out_dir: output directory (created if needed).
    chunks: 1-D integer arrays of ids, each in [0, tokenizer.vocab_size).
    tokenizer: the tokenizer that made the ids (name, vocab_size, eot go into
      `meta.json`).
    val_fraction: share of tokens for validation, in (0, 1).
    meta: extra entries for `meta.json` (e.g. sources).

  Returns:
    The dict written to `meta.json`: vocab_size, tokenizer, eot_token,
    dtype, train_tokens, val_tokens, val_fraction, sha256 of each file, and
    the entries of `meta`.

  Raises:
    ValueError: `val_fraction` outside (0, 1), an id out of range, or too few
      tokens for both splits (at least 2 each).

  Example:
    ```python
    chunks = [np.arange(100) % 256]
    meta = write_token_files("out", chunks, tokenizer=byte_tokenizer())
    meta["train_tokens"], meta["val_tokens"]
    # (90, 10)
    ```
  """
  if not 0 < val_fraction < 1:
    raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
  os.makedirs(out_dir, exist_ok=True)
  paths = {s: os.path.join(out_dir, f"{s}.bin") for s in ("train", "val")}
  tmp = {s: p + ".tmp" for s, p in paths.items()}
  itemsize = TOKEN_DTYPE.itemsize
  try:
    total = 0
    with open(tmp["train"], "wb") as f:
      for chunk in chunks:
        chunk = np.asarray(chunk)
        vocab = tokenizer.vocab_size
        if chunk.size and (chunk.min() < 0 or chunk.max() >= vocab):
          raise ValueError(
            f"token ids must be in [0, {vocab}); got "
            f"{chunk.min()}..{chunk.max()}"
          )
        f.write(chunk.astype(TOKEN_DTYPE).tobytes())
        total += chunk.size
    num_val = int(round(total * val_fraction))
    num_train = total - num_val
    if min(num_val, num_train) < 2:
      raise ValueError(
        f"only {total} tokens: too few for train and val splits at "
        f"val_fraction={val_fraction}; add text"
      )
    with open(tmp["train"], "r+b") as src, open(tmp["val"], "wb") as dst:
      src.seek(num_train * itemsize)
      shutil.copyfileobj(src, dst, 1 << 24)
      src.truncate(num_train * itemsize)
    out = {
      "vocab_size": tokenizer.vocab_size,
      "tokenizer": tokenizer.name,
      "eot_token": tokenizer.eot,
      "dtype": "uint16 little-endian, flat, no header",
      "train_tokens": num_train,
      "val_tokens": num_val,
      "val_fraction": val_fraction,
      "sha256": {f"{s}.bin": _sha256(tmp[s]) for s in tmp},
      **(meta or {}),
    }
    for s in tmp:
      os.replace(tmp[s], paths[s])
    meta_path = os.path.join(out_dir, "meta.json")
    with open(meta_path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(out, f, indent=2, sort_keys=True)
      f.write("\n")
    os.replace(meta_path + ".tmp", meta_path)
  finally:
    for p in tmp.values():
      with contextlib.suppress(FileNotFoundError):
        os.remove(p)
  return out


def prepare_text(
  inputs: Sequence[str],
  out_dir: str,
  *,
  tokenizer: str = "byte",
  tokenizer_path: str | None = None,
  val_fraction: float = 0.1,
  suffixes: Sequence[str] | None = DEFAULT_SUFFIXES,
) -> dict:
  """Tokenizes local text files into `train.bin`, `val.bin`, `meta.json`.

  Files are listed by `list_text_files` and tokenized one at a time in that
  order; `meta.json` records each source path and size.

  Args:
    inputs: text files and directories.
    out_dir: output directory.
    tokenizer: "byte" or "gpt2" (see `get_tokenizer`).
    tokenizer_path: optional local tokenizer file or directory for "gpt2".
    val_fraction: share of tokens (the last ones) for `val.bin`.
    suffixes: file-name endings taken from directories; None for all.

  Returns:
    The `meta.json` contents.

  Raises:
    FileNotFoundError, ValueError, RuntimeError: see `list_text_files`,
      `get_tokenizer`, `write_token_files`; ValueError also for a file that
      is not UTF-8 under the gpt2 tokenizer.

  Example:
    ```python
    meta = prepare_text(["my_texts/"], "data/my_texts")
    meta["vocab_size"]
    # 256
    ```
  """
  tok = get_tokenizer(tokenizer, tokenizer_path)
  files = list_text_files(inputs, suffixes)

  def chunks():
    for path in files:
      with open(path, "rb") as f:
        data = f.read()
      try:
        yield tok.encode(data)
      except UnicodeDecodeError as e:
        raise ValueError(
          f"{path} is not UTF-8 text ({e}); remove it from the inputs or use "
          "--tokenizer byte"
        ) from e

  meta = {"sources": [{"path": p, "bytes": os.path.getsize(p)} for p in files]}
  if tokenizer_path is not None:
    meta["tokenizer_path"] = tokenizer_path
  return write_token_files(
    out_dir, chunks(), tokenizer=tok, val_fraction=val_fraction, meta=meta
  )

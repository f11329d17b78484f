"""Tokenizers that work offline: byte-level, and GPT-2 BPE from local files.

* `byte`: the UTF-8 bytes themselves, vocabulary 256; always available.
* `gpt2`: GPT-2's BPE (vocabulary 50257, end-of-text 50256), only from files
  already on this machine: a `tokenizer.json` or tokenizer directory given as
  `path`, tiktoken's cached `gpt2` encoding, or a cached Hugging Face `gpt2`
  tokenizer (`local_files_only=True`). Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

# tiktoken names its cache files by the SHA-1 of these source addresses.
_TIKTOKEN_GPT2 = tuple(
  "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/" + name
  for name in ("vocab.bpe", "encoder.json")
)


class Tokenizer(NamedTuple):
  """A tokenizer: `encode(bytes) -> int array`, plus its vocabulary facts.

  Attributes:
    name: "byte" or "gpt2"; recorded in `meta.json`.
    vocab_size: number of ids (at most 65536, so ids fit uint16).
    encode: maps a document's bytes to a 1-D integer array of ids.
    eot: the end-of-text id appended after each document, or None.
  """

  name: str
  vocab_size: int
  encode: Callable[[bytes], np.ndarray]
  eot: int | None


def _encode_bytes(data: bytes) -> np.ndarray:
  if data and not data.endswith(b"\n"):
    data += b"\n"  # keeps the last line of one file off the next one's first
  return np.frombuffer(data, dtype=np.uint8)


def byte_tokenizer() -> Tokenizer:
  """Byte-level tokenizer: ids are the bytes, vocabulary 256.

  Each document keeps its bytes exactly, plus a newline if it lacks a final
  one; there is no end-of-text id.

  Example:
    ```python
    byte_tokenizer().encode(b"hi").tolist()
    # [104, 105, 10]
    ```
  """
  return Tokenizer("byte", 256, _encode_bytes, None)


def _from_encode(
  text_encode: Callable[[str], Sequence[int]], vocab_size: int, eot: int
) -> Tokenizer:
  def encode(data: bytes) -> np.ndarray:
    ids = text_encode(data.decode("utf-8"))
    return np.asarray([*ids, eot], dtype=np.int64)

  return Tokenizer("gpt2", vocab_size, encode, eot)


def _tiktoken_gpt2(tried: list[str]) -> Tokenizer | None:
  try:
    import tiktoken
  except ImportError:
    tried.append("tiktoken: not installed")
    return None
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"
  )
  candidates = [
    os.environ.get("TIKTOKEN_CACHE_DIR"),
    os.environ.get("DATA_GYM_CACHE_DIR"),
    os.path.join(cache_home, "tiktoken"),
    os.path.join(tempfile.gettempdir(), "data-gym-cache"),
  ]
  keys = [hashlib.sha1(url.encode()).hexdigest() for url in _TIKTOKEN_GPT2]
  for cache in filter(None, candidates):
    if all(os.path.isfile(os.path.join(cache, k)) for k in keys):
      break
  else:
    tried.append(
      "tiktoken: no cached gpt2 encoding in "
      + ", ".join(filter(None, candidates))
    )
    return None
  # Point tiktoken at the directory that holds the files, so it reads them
  # from there rather than looking elsewhere and fetching.
  saved = os.environ.get("TIKTOKEN_CACHE_DIR")
  os.environ["TIKTOKEN_CACHE_DIR"] = cache
  try:
    enc = tiktoken.get_encoding("gpt2")
  except Exception as e:  # any failure means "not available offline"
    tried.append(f"tiktoken: {e}")
    return None
  finally:
    if saved is None:
      del os.environ["TIKTOKEN_CACHE_DIR"]
    else:
      os.environ["TIKTOKEN_CACHE_DIR"] = saved
  return _from_encode(enc.encode_ordinary, enc.n_vocab, enc.eot_token)


def _transformers_tokenizer(
  name_or_dir: str, tried: list[str]
) -> Tokenizer | None:
  try:
    import transformers
  except ImportError:
    tried.append("transformers: not installed")
    return None
  try:
    tok = transformers.AutoTokenizer.from_pretrained(
      name_or_dir, local_files_only=True
    )
  except Exception as e:  # any failure means "not available offline"
    tried.append(f"transformers {name_or_dir!r}: {type(e).__name__}: {e}")
    return None
  return _from_encode(
    lambda text: tok.encode(text, add_special_tokens=False, verbose=False),
    len(tok),
    tok.eos_token_id,
  )


def _tokenizers_file(path: str, tried: list[str]) -> Tokenizer | None:
  try:
    import tokenizers
  except ImportError:
    tried.append("tokenizers: not installed")
    return None
  tok = tokenizers.Tokenizer.from_file(path)
  eot = tok.token_to_id("<|endoftext|>")
  if eot is None:
    tried.append(f"{path}: has no <|endoftext|> token")
    return None
  return _from_encode(
    lambda text: tok.encode(text, add_special_tokens=False).ids,
    tok.get_vocab_size(),
    eot,
  )


def gpt2_tokenizer(path: str | None = None) -> Tokenizer:
  """GPT-2 BPE from files already on this machine; never downloads.

  Tries, in order: `path` (a `tokenizer.json` read with `tokenizers`, or a
  tokenizer directory read with `transformers`), else tiktoken's cached
  `gpt2` encoding, else a cached Hugging Face `gpt2` tokenizer. Each document
  is decoded as UTF-8, encoded, and followed by the end-of-text id.

  Args:
    path: optional local `tokenizer.json` file or tokenizer directory.

  Returns:
    A `Tokenizer` named "gpt2".

  Raises:
    RuntimeError: nothing usable is available offline; the message lists
      what was tried and how to make one available.

  Example:
    ```python
    tok = gpt2_tokenizer("gpt2/tokenizer.json")
    tok.vocab_size
    # 50257
    ```
  """
  tried: list[str] = []
  if path is not None:
    if not os.path.exists(path):
      raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if os.path.isfile(path):
      tok = _tokenizers_file(path, tried)
    else:
      tok = _transformers_tokenizer(path, tried)
  else:
    tok = _tiktoken_gpt2(tried) or _transformers_tokenizer("gpt2", tried)
  if tok is not None and tok.vocab_size > 1 << 16:
    raise ValueError(
      f"tokenizer has {tok.vocab_size} ids; uint16 token files hold at most "
      "65536"
    )
  if tok is None:
    raise RuntimeError(
      "no GPT-2 tokenizer is available offline (nothing is downloaded). "
      "Tried: " + "; ".join(tried) + ". Fix: pass --tokenizer-path to a "
      "local tokenizer.json (with `pip install tokenizers`) or tokenizer "
      "directory (with `pip install transformers`), or cache tiktoken's gpt2 "
      "encoding on a machine with network access and copy it here, or use "
      "--tokenizer byte."
    )
  return tok


TOKENIZERS = {"byte": byte_tokenizer, "gpt2": gpt2_tokenizer}


def get_tokenizer(name: str, path: str | None = None) -> Tokenizer:
  """Returns the tokenizer `name` ("byte" or "gpt2").

  Raises:
    ValueError: unknown name (the message lists the valid ones), or a
      `path` given for the byte tokenizer.
    RuntimeError: see `gpt2_tokenizer`.
  """
  if name not in TOKENIZERS:
    raise ValueError(
      f"unknown tokenizer {name!r}; valid: {', '.join(TOKENIZERS)}"
    )
  if name == "byte":
    if path is not None:
      raise ValueError("the byte tokenizer takes no tokenizer path")
    return byte_tokenizer()
  return gpt2_tokenizer(path)

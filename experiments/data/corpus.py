"""The built-in text corpus: Python's own documentation, byte-level tokens.

Every CPython installation ships `pydoc_data/topics.py`, the text of the
language reference topics that `help()` shows (about 470 KB of English prose
and code examples). The corpus is those topics in sorted key order, each
followed by a blank line, encoded as UTF-8 and tokenized byte-level
(vocabulary 256); the last 10% of the bytes is the validation split. The text
is fixed per Python release, so the token files are the same bytes on every
machine with the same Python version; `meta.json` records that version and
the files' SHA-256.

A second built-in corpus, `builtin_code`, is source code rather than prose:
the `.py` files of the standard library's `email`, `http` and `json`
packages (about 640 KB), in sorted path order, each followed by a blank
line, tokenized and split the same way. A study checks a prediction on it
in a setting that shares neither text nor (with another architecture) the
model of the setting the prediction was developed on.

The files are built on first use into `<cache_dir>/builtin_text-v1-py<X.Y.Z>/`
(`builtin_code-v1-...` for the code corpus),
atomically (a directory renamed into place), so concurrent processes are safe.
`cache_dir` defaults to `$LOWPREC_CACHE_DIR`, else `$XDG_CACHE_HOME/lowprec`,
else `~/.cache/lowprec`.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile

from experiments.data import text, tokenizer

VERSION = 1
VAL_FRACTION = 0.1


def default_cache_dir() -> str:
  """Returns `$LOWPREC_CACHE_DIR`, `$XDG_CACHE_HOME/lowprec` or ~/.cache."""
  if os.environ.get("LOWPREC_CACHE_DIR"):
    return os.environ["LOWPREC_CACHE_DIR"]
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"
  )
  return os.path.join(cache_home, "lowprec")


def builtin_text_bytes() -> bytes:
  """The corpus text: `pydoc_data.topics.topics` in sorted key order, UTF-8.

  Raises:
    RuntimeError: this Python installation lacks `pydoc_data` (some minimal
      distributions strip it).

  Example:
    >>> len(builtin_text_bytes()) > 100_000
    True
  """
  try:
    from pydoc_data.topics import topics
  except ImportError as e:
    raise RuntimeError(
      "the built-in corpus needs the standard library's pydoc_data module, "
      "which this Python installation lacks; install the full standard "
      "library (e.g. Debian's libpython3-stdlib) or make token files from "
      "your own text with `python -m scripts.prepare_text` and use "
      "data.name = 'tokens'"
    ) from e
  return "".join(topics[k] + "\n\n" for k in sorted(topics)).encode("utf-8")


CODE_PACKAGES = ("email", "http", "json")


def builtin_code_bytes() -> bytes:
  """The code corpus: the `.py` files of `CODE_PACKAGES`, each package's
  files in sorted relative path order, each followed by a blank line,
  UTF-8."""
  import importlib.util

  out = []
  for pkg in CODE_PACKAGES:
    root = os.path.dirname(importlib.util.find_spec(pkg).origin)
    files = sorted(
      os.path.relpath(os.path.join(d, f), root)
      for d, _, fs in os.walk(root)
      for f in fs
      if f.endswith(".py")
    )
    for rel in files:
      with open(os.path.join(root, rel), encoding="utf-8") as fh:
        out.append(fh.read() + "\n\n")
  return "".join(out).encode("utf-8")


_CORPORA = {
  "text": (
    builtin_text_bytes,
    "pydoc_data/topics.py of the Python standard library: the `topics` "
    "dict in sorted key order, each text followed by a blank line, UTF-8",
  ),
  "code": (
    builtin_code_bytes,
    "the .py files of the standard library's "
    + ", ".join(CODE_PACKAGES)
    + " packages, each package's files in sorted path order, each followed "
    "by a blank line, UTF-8",
  ),
}


def builtin_text_dir(cache_dir: str | None = None, corpus: str = "text") -> str:
  """Returns the built-in corpus directory, building it on first use.

  Args:
    cache_dir: parent directory of the cache; see the module docstring for
      the default.
    corpus: "text" (the default) or "code".

  Returns:
    A directory holding `train.bin`, `val.bin` and `meta.json`.

  Raises:
    OSError: the cache directory is not writable (the message names the fix).
    RuntimeError: see `builtin_text_bytes`.

  Example:
    >>> from experiments.data.tokens import TokenData
    >>> data = TokenData(builtin_text_dir(), seq_len=64, batch_size=4)
  """
  cache_dir = cache_dir or default_cache_dir()
  read, source = _CORPORA[corpus]
  name = f"builtin_{corpus}-v{VERSION}-py{platform.python_version()}"
  final = os.path.join(cache_dir, name)
  if os.path.exists(os.path.join(final, "meta.json")):
    return final
  try:
    os.makedirs(cache_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir)
  except OSError as e:
    raise OSError(
      f"cannot write the built-in corpus cache under {cache_dir} ({e}); set "
      "$LOWPREC_CACHE_DIR to a writable directory"
    ) from e
  try:
    data = read()
    tok = tokenizer.byte_tokenizer()
    text.write_token_files(
      work,
      [tok.encode(data)],
      tokenizer=tok,
      val_fraction=VAL_FRACTION,
      meta={
        "corpus": f"builtin_{corpus} v{VERSION}",
        "python_version": platform.python_version(),
        "sources": [source],
      },
    )
    try:
      os.rename(work, final)
    except OSError:
      if not os.path.exists(os.path.join(final, "meta.json")):
        raise OSError(
          f"{final} exists but holds no complete corpus; delete it to rebuild"
        ) from None
      # Otherwise another process built the same bytes first.
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return final

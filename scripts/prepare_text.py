"""Make `train.bin` / `val.bin` token files from local text.

  python -m scripts.prepare_text --input TEXT [TEXT ...] --out DIR \\
      [--tokenizer byte|gpt2] [--tokenizer-path PATH] [--val-fraction 0.1] \\
      [--suffixes .txt,.md,.rst]

Each TEXT is a file (always taken) or a directory (walked in sorted order,
taking files with one of `--suffixes`; `--suffixes '*'` takes every file).
The token ids are written as flat little-endian uint16 (the nanoGPT layout):
the last `--val-fraction` of the tokens go to `val.bin`, the rest to
`train.bin`, and `meta.json` records the vocabulary size, tokenizer, token
counts, SHA-256 of each file and the source files. Train on them with
`data.name = "tokens"` and `data.data_dir = DIR`.

`byte` (vocabulary 256) always works. `gpt2` (vocabulary 50257) needs a
tokenizer already on this machine (`--tokenizer-path` to a `tokenizer.json`
or tokenizer directory, tiktoken's cached encoding, or a cached Hugging Face
tokenizer); nothing is downloaded.

With no `--input`, writes the built-in corpus (Python's own documentation,
byte-level) to `--out`, the same files `data.name = "builtin_text"` uses.
"""

from __future__ import annotations

if not __package__:  # run as a file, `python scripts/prepare_text.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.prepare_text ..."
  )


import argparse
import json
import os
import shutil
import sys

from experiments import data


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--input",
    nargs="+",
    default=None,
    help="text files and directories (default: the built-in corpus)",
  )
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument(
    "--tokenizer", default="byte", choices=sorted(data.tokenizer.TOKENIZERS)
  )
  parser.add_argument(
    "--tokenizer-path",
    default=None,
    help="local tokenizer.json or tokenizer directory (gpt2 only)",
  )
  parser.add_argument("--val-fraction", type=float, default=0.1)
  parser.add_argument(
    "--suffixes",
    default=",".join(data.text.DEFAULT_SUFFIXES),
    help="comma-separated file endings taken from directories, or '*'",
  )
  args = parser.parse_args(argv)
  if args.input is None:
    if args.tokenizer != "byte" or args.tokenizer_path:
      parser.error("the built-in corpus is byte-level; pass --input for gpt2")
    src = data.builtin_text_dir()
    os.makedirs(args.out, exist_ok=True)
    for name in ("train.bin", "val.bin", "meta.json"):
      shutil.copyfile(os.path.join(src, name), os.path.join(args.out, name))
    meta = data.read_meta(args.out)
  else:
    suffixes = None
    if args.suffixes.strip() != "*":
      parts = [s.strip().lower() for s in args.suffixes.split(",")]
      suffixes = tuple(s if s.startswith(".") else "." + s for s in parts if s)
    try:
      meta = data.prepare_text(
        args.input,
        args.out,
        tokenizer=args.tokenizer,
        tokenizer_path=args.tokenizer_path,
        val_fraction=args.val_fraction,
        suffixes=suffixes,
      )
    except (FileNotFoundError, ValueError, RuntimeError) as e:
      sys.exit(f"prepare_text: {e}")
  summary = {
    k: meta[k]
    for k in ("tokenizer", "vocab_size", "train_tokens", "val_tokens")
  }
  print(f"wrote {args.out}: {json.dumps(summary)}")


if __name__ == "__main__":
  main()

"""Data: token files, text, built-in corpus, IDX, digits and regression.

Every data file is made here, in `tmp_path`; nothing is downloaded.
"""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import data
from experiments.data import sampling
from experiments.data import tokens as tokens_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_tokens(path, ids):
  np.asarray(ids, dtype="<u2").tofile(path)


def _token_dir(tmp_path, n_train=5000, n_val=700, meta=None):
  """Token files whose id at position p is p (train) and 30000 + p (val)."""
  _write_tokens(tmp_path / "train.bin", np.arange(n_train))
  _write_tokens(tmp_path / "val.bin", 30000 + np.arange(n_val))
  if meta is not None:
    (tmp_path / "meta.json").write_text(json.dumps(meta))
  return str(tmp_path)


# ---- token files ----------------------------------------------------------


@pytest.mark.parametrize(
  "seq_len,batch_size",
  [(1, 1), (16, 4), (64, 32)],
  ids=["T1B1", "T16B4", "T64B32"],
)
@pytest.mark.parametrize("split", ["train", "val"])
def test_token_batches_are_windows_shifted_by_one(
  tmp_path, seq_len, batch_size, split
):
  d = data.TokenData(
    _token_dir(tmp_path), seq_len=seq_len, batch_size=batch_size, seed=3
  )
  base = 0 if split == "train" else 30000
  n = d.train.size if split == "train" else d.val.size
  for step in range(5):
    inputs, targets = d.batch(step, split)
    assert inputs.shape == targets.shape == (batch_size, seq_len)
    assert inputs.dtype == targets.dtype == np.int32
    starts = inputs[:, 0] - base
    assert np.all((starts >= 0) & (starts + seq_len + 1 <= n))
    np.testing.assert_array_equal(starts, d.starts(step, split))
    np.testing.assert_array_equal(
      inputs, base + starts[:, None] + np.arange(seq_len)
    )
    np.testing.assert_array_equal(targets, inputs + 1)


def test_token_round_trip_reads_file_bytes(tmp_path):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 65536, size=3000)
  _write_tokens(tmp_path / "train.bin", ids)
  _write_tokens(tmp_path / "val.bin", ids[:100])
  assert (tmp_path / "train.bin").read_bytes()[:2] == int(ids[0]).to_bytes(
    2, "little"
  )
  d = data.TokenData(str(tmp_path), seq_len=8, batch_size=4)
  inputs, targets = d.batch(7)
  for row, start in enumerate(d.starts(7)):
    np.testing.assert_array_equal(inputs[row], ids[start : start + 8])
    np.testing.assert_array_equal(targets[row], ids[start + 1 : start + 9])


def test_token_batches_are_deterministic(tmp_path):
  path = _token_dir(tmp_path)
  a = data.TokenData(path, seq_len=16, batch_size=8, seed=1)
  b = data.TokenData(path, seq_len=16, batch_size=8, seed=1)
  other_seed = data.TokenData(path, seq_len=16, batch_size=8, seed=2)
  for step in (0, 1, 10**9):
    np.testing.assert_array_equal(a.batch(step)[0], b.batch(step)[0])
    assert not np.array_equal(a.batch(step)[0], other_seed.batch(step)[0])
  steps = [a.starts(s).tolist() for s in range(20)]
  assert len({tuple(s) for s in steps}) == 20
  assert not np.array_equal(a.starts(0, "train"), a.starts(0, "val"))


def test_token_batch_at_step_k_equals_sequential_pass(tmp_path):
  path = _token_dir(tmp_path)
  run = data.TokenData(path, seq_len=16, batch_size=4, seed=5)
  sequential = [run.batch(step) for step in range(12)]
  resumed = data.TokenData(path, seq_len=16, batch_size=4, seed=5)
  for k in (11, 3, 7):
    for got, want in zip(resumed.batch(k), sequential[k], strict=True):
      np.testing.assert_array_equal(got, want)


def test_token_rows_assemble_the_global_batch(tmp_path):
  d = data.TokenData(_token_dir(tmp_path), seq_len=8, batch_size=8, seed=0)
  full = d.batch(4)
  shards = [d.batch(4, rows=slice(i, i + 2)) for i in range(0, 8, 2)]
  for j in range(2):
    np.testing.assert_array_equal(
      np.concatenate([s[j] for s in shards]), full[j]
    )
  np.testing.assert_array_equal(
    d.batch(4, rows=np.array([5, 1]))[0], full[0][[5, 1]]
  )


def test_eval_batches_are_fixed_and_span_val(tmp_path):
  path = _token_dir(tmp_path, n_val=700)
  a = data.TokenData(path, seq_len=10, batch_size=4, seed=0)
  b = data.TokenData(path, seq_len=10, batch_size=4, seed=99)
  ea, eb = a.eval_batches(), b.eval_batches()
  assert len(ea) == (700 - 1) // 10 // 4
  for (xa, ya), (xb, yb) in zip(ea, eb, strict=True):
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
  starts = a.eval_starts().ravel()
  assert starts[0] == 0 and starts[-1] == 700 - 10 - 1
  assert np.all(np.diff(starts) >= 10)  # non-overlapping by default
  assert len(a.eval_batches(num_batches=3)) == 3


def test_vocab_size_comes_from_meta(tmp_path):
  d = data.TokenData(
    _token_dir(tmp_path, meta={"vocab_size": 40000}), seq_len=4, batch_size=2
  )
  assert d.vocab_size == 40000
  with pytest.raises(ValueError, match="token id 30699.*vocab_size 30500"):
    data.TokenData(str(tmp_path), seq_len=4, batch_size=2, vocab_size=30500)
  big = data.TokenData(str(tmp_path), seq_len=4, batch_size=2, vocab_size=70000)
  assert big.vocab_size == 70000  # any uint16 id is below it


def _missing(tmp_path):
  return tmp_path / "nothing" / "train.bin", {}


def _odd(tmp_path):
  (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
  return tmp_path / "train.bin", {}


def _short(tmp_path):
  _write_tokens(tmp_path / "train.bin", np.arange(16))
  return tmp_path / "train.bin", {}


def _empty(tmp_path):
  (tmp_path / "train.bin").write_bytes(b"")
  return tmp_path / "train.bin", {}


def _out_of_vocab(tmp_path):
  ids = np.full(100, 7)
  ids[63] = 300
  _write_tokens(tmp_path / "train.bin", ids)
  return tmp_path / "train.bin", {"vocab_size": 256}


def _vocab_zero(tmp_path):
  _write_tokens(tmp_path / "train.bin", np.arange(100))
  return tmp_path / "train.bin", {"vocab_size": 0}


@pytest.mark.parametrize(
  "make,error,pattern",
  [
    (_missing, FileNotFoundError, r"nothing/train.bin not found.*prepare_text"),
    (_odd, ValueError, r"3 bytes, an odd number.*truncated.*prepare_text"),
    (_short, ValueError, r"holds 16 tokens.*at least 17.*seq_len"),
    (_empty, ValueError, r"holds 0 tokens"),
    (_out_of_vocab, ValueError, r"token id 300 at position 63.*vocab_size 256"),
    (_vocab_zero, ValueError, r"vocab_size must be >= 1; got 0"),
  ],
  ids=[
    "missing",
    "odd_size",
    "too_short",
    "empty",
    "out_of_vocab",
    "vocab_zero",
  ],
)
def test_bad_token_files_name_the_fix(tmp_path, make, error, pattern):
  path, kwargs = make(tmp_path)
  with pytest.raises(error, match=pattern):
    data.open_tokens(str(path), seq_len=16, **kwargs)


def test_missing_val_file_is_named(tmp_path):
  _write_tokens(tmp_path / "train.bin", np.arange(100))
  with pytest.raises(FileNotFoundError, match="val.bin"):
    data.TokenData(str(tmp_path), seq_len=8, batch_size=2)


def test_large_files_are_checked_in_chunks_and_per_batch(tmp_path, monkeypatch):
  monkeypatch.setattr(tokens_lib, "_FULL_CHECK_TOKENS", 100)
  monkeypatch.setattr(tokens_lib, "_CHECK_CHUNK", 10)
  ids = np.zeros(10_000, np.int64)
  ids[0] = 999  # first sampled chunk starts at 0
  _write_tokens(tmp_path / "train.bin", ids)
  with pytest.raises(ValueError, match="token id 999 at position 0"):
    data.open_tokens(str(tmp_path / "train.bin"), seq_len=4, vocab_size=256)
  ids[0], ids[5000:] = 0, 999  # only in unsampled places past chunk starts
  starts = sampling.even_starts(64, 10_000 - 10 + 1)
  for s in starts[starts >= 5000]:
    ids[s : s + 10] = 0
  _write_tokens(tmp_path / "train.bin", ids)
  _write_tokens(tmp_path / "val.bin", np.zeros(100))
  d = data.TokenData(str(tmp_path), seq_len=4, batch_size=64, vocab_size=256)
  with pytest.raises(ValueError, match="token id 999"):
    for step in range(10):
      d.batch(step)


def test_unknown_split_and_negative_step(tmp_path):
  d = data.TokenData(_token_dir(tmp_path), seq_len=4, batch_size=2)
  with pytest.raises(
    ValueError, match="unknown split 'test'; valid: train, val"
  ):
    d.batch(0, "test")
  with pytest.raises(ValueError, match="step must be >= 0"):
    d.batch(-1)


# ---- text preparation -----------------------------------------------------


def _text_dir(tmp_path):
  src = tmp_path / "texts"
  (src / "sub").mkdir(parents=True)
  (src / ".hidden").mkdir()
  files = {
    "b.txt": "second file, ünïcode ✓\n",
    "a.md": "first file without a final newline",
    "sub/c.rst": "nested\n" * 20,
    "skip.bin": "not taken: wrong suffix\n",
    ".dot.txt": "not taken: hidden\n",
    ".hidden/x.txt": "not taken: hidden dir\n",
  }
  for name, body in files.items():
    (src / name).write_text(body, encoding="utf-8")
  taken = ["a.md", "b.txt", "sub/c.rst"]
  expected = b"".join(
    files[n].encode() + (b"" if files[n].endswith("\n") else b"\n")
    for n in taken
  )
  return src, taken, expected


def test_prepare_text_byte_level_round_trip(tmp_path):
  src, taken, expected = _text_dir(tmp_path)
  out = tmp_path / "out"
  meta = data.prepare_text([str(src)], str(out), val_fraction=0.25)
  train = np.fromfile(out / "train.bin", dtype="<u2")
  val = np.fromfile(out / "val.bin", dtype="<u2")
  assert bytes(np.concatenate([train, val]).astype(np.uint8)) == expected
  assert len(val) == round(len(expected) * 0.25)
  assert meta == json.loads((out / "meta.json").read_text())
  assert meta["vocab_size"] == 256 and meta["tokenizer"] == "byte"
  assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
  assert [s["path"] for s in meta["sources"]] == [str(src / n) for n in taken]
  assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
  d = data.TokenData(str(out), seq_len=8, batch_size=2)
  assert d.vocab_size == 256


def test_prepare_text_script(tmp_path):
  src, _, expected = _text_dir(tmp_path)
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "scripts.prepare_text"]  # from the root
  args = ["--input", str(src), "--out", str(out), "--suffixes", "txt,.MD"]
  res = subprocess.run(cmd + args, capture_output=True, text=True, cwd=ROOT)
  assert res.returncode == 0, res.stderr
  meta = json.loads((out / "meta.json").read_text())
  assert len(meta["sources"]) == 2
  assert f"wrote {out}" in res.stdout
  bad = subprocess.run(
    cmd + ["--input", str(tmp_path / "nope"), "--out", str(out)],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert bad.returncode != 0 and "neither a file nor a directory" in bad.stderr


def test_gpt2_without_offline_tokenizer_names_the_fix(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tiktoken", None)
  monkeypatch.setitem(sys.modules, "transformers", None)
  with pytest.raises(RuntimeError, match=r"offline.*--tokenizer byte"):
    data.prepare_text(
      [str(_text_dir(tmp_path)[0])], str(tmp_path / "o"), tokenizer="gpt2"
    )
  with pytest.raises(
    ValueError, match="unknown tokenizer 'bpe'; valid: byte, gpt2"
  ):
    data.get_tokenizer("bpe")


def test_write_token_files_rejects_bad_input(tmp_path):
  tok = data.byte_tokenizer()
  with pytest.raises(ValueError, match="too few"):
    data.write_token_files(str(tmp_path), [np.arange(3)], tokenizer=tok)
  with pytest.raises(ValueError, match=r"must be in \[0, 256\)"):
    data.write_token_files(str(tmp_path), [np.array([1, 256])], tokenizer=tok)
  with pytest.raises(ValueError, match="val_fraction"):
    data.write_token_files(str(tmp_path), [], tokenizer=tok, val_fraction=1.0)
  assert os.listdir(tmp_path) == []  # nothing half-written is left


# ---- built-in corpus ------------------------------------------------------


def test_builtin_corpus_is_deterministic_and_cached(tmp_path):
  first = data.builtin_text_dir(str(tmp_path / "a"))
  second = data.builtin_text_dir(str(tmp_path / "b"))
  for name in ("train.bin", "val.bin", "meta.json"):
    with open(os.path.join(first, name), "rb") as f1:
      with open(os.path.join(second, name), "rb") as f2:
        assert f1.read() == f2.read(), name
  meta = data.read_meta(first)
  assert meta["python_version"] == ".".join(map(str, sys.version_info[:3]))
  assert meta["vocab_size"] == 256
  assert meta["train_tokens"] > 300_000 and meta["val_tokens"] > 30_000
  assert os.listdir(tmp_path / "a") == [os.path.basename(first)]
  mtime = os.path.getmtime(os.path.join(first, "train.bin"))
  assert data.builtin_text_dir(str(tmp_path / "a")) == first
  assert os.path.getmtime(os.path.join(first, "train.bin")) == mtime
  text = data.builtin_text_bytes()
  train = np.fromfile(os.path.join(first, "train.bin"), dtype="<u2")
  assert bytes(train.astype(np.uint8)) == text[: len(train)]
  assert b"import" in text and text.decode("utf-8")


def test_builtin_text_dataset(tmp_path):
  d = data.build(
    "builtin_text", seq_len=32, batch_size=4, cache_dir=str(tmp_path)
  )
  inputs, targets = d.batch(0)
  assert inputs.shape == (4, 32) and inputs.max() < 256
  np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])


def test_builtin_code_corpus_is_the_packages_sources(tmp_path):
  # The code corpus: the .py files of email, http and json, each package
  # in sorted path order, read here independently; its own cache entry,
  # its tokens the bytes, and the data set that the configs name.
  import importlib.util

  from experiments.data import corpus

  want = []
  for pkg in ("email", "http", "json"):
    root = os.path.dirname(importlib.util.find_spec(pkg).origin)
    paths = []
    for d, _, fs in os.walk(root):
      paths += [os.path.join(d, f) for f in fs if f.endswith(".py")]
    for path in sorted(paths, key=lambda q: os.path.relpath(q, root)):
      with open(path, "rb") as f:
        want.append(f.read().decode("utf-8") + "\n\n")
  code = corpus.builtin_code_bytes()
  assert code == "".join(want).encode("utf-8")
  where = corpus.builtin_text_dir(str(tmp_path), corpus="code")
  assert os.path.basename(where).startswith("builtin_code-v1-py")
  train = np.fromfile(os.path.join(where, "train.bin"), dtype="<u2")
  assert bytes(train.astype(np.uint8)) == code[: len(train)]
  assert "email" in data.read_meta(where)["sources"][0]
  d = data.build(
    "builtin_code", seq_len=32, batch_size=4, cache_dir=str(tmp_path)
  )
  inputs, _ = d.batch(0)
  assert inputs.shape == (4, 32)


# ---- MNIST IDX ------------------------------------------------------------


def _idx(magic, array):
  header = magic.to_bytes(4, "big") + b"".join(
    d.to_bytes(4, "big") for d in array.shape
  )
  return header + array.astype(np.uint8).tobytes()


def _mnist_dir(tmp_path, gz=False, n_train=6, n_test=3, hw=(4, 5)):
  rng = np.random.default_rng(0)
  arrays = {
    "train_images": rng.integers(0, 256, (n_train, *hw)),
    "train_labels": rng.integers(0, 10, n_train),
    "test_images": rng.integers(0, 256, (n_test, *hw)),
    "test_labels": rng.integers(0, 10, n_test),
  }
  for key, name in data.MNIST_FILES.items():
    magic = 2051 if key.endswith("images") else 2049
    blob = _idx(magic, arrays[key])
    if gz:
      blob, name = gzip.compress(blob, mtime=0), name + ".gz"
    (tmp_path / name).write_bytes(blob)
  return tmp_path, arrays


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_mnist_idx_round_trip(tmp_path, gz):
  path, arrays = _mnist_dir(tmp_path, gz=gz)
  train_x, train_y, test_x, test_y = data.load_mnist(str(path))
  assert train_x.shape == (6, 4, 5, 1) and test_x.shape == (3, 4, 5, 1)
  assert train_x.dtype == np.float32 and train_y.dtype == np.int32
  np.testing.assert_array_equal(train_x[..., 0] * 255, arrays["train_images"])
  np.testing.assert_array_equal(test_y, arrays["test_labels"])
  assert 0.0 <= train_x.min() and train_x.max() <= 1.0
  d = data.build("mnist", data_dir=str(path), batch_size=4)
  assert d.batch(0)[0].shape == (4, 4, 5, 1) and d.num_classes == 10


def _swap_magic(path):
  images = path / "train-images-idx3-ubyte"
  blob = images.read_bytes()
  images.write_bytes((2049).to_bytes(4, "big") + blob[4:])
  return "train-images", r"magic number 2049 \(0x00000801\), expected 2051"


def _truncate(path):
  labels = path / "t10k-labels-idx1-ubyte"
  labels.write_bytes(labels.read_bytes()[:-1])
  return (
    "t10k-labels",
    r"truncated: dimensions \(3,\) need 3 data bytes, found 2",
  )


def _truncate_header(path):
  images = path / "t10k-images-idx3-ubyte"
  images.write_bytes(images.read_bytes()[:10])
  return "t10k-images", "truncated inside its header"


def _extra_bytes(path):
  images = path / "train-images-idx3-ubyte"
  images.write_bytes(images.read_bytes() + b"\x00")
  return "train-images", "longer than its header says"


def _label_count(path):
  labels = path / "train-labels-idx1-ubyte"
  labels.write_bytes(_idx(2049, np.zeros(5)))
  return "train-labels", "5 labels for 6 images"


def _truncate_gz(path):
  images = path / "train-images-idx3-ubyte"
  (path / "train-images-idx3-ubyte.gz").write_bytes(
    gzip.compress(images.read_bytes())[:-6]
  )
  images.unlink()
  return "train-images-idx3-ubyte.gz", "truncated or corrupt gzip"


@pytest.mark.parametrize(
  "corrupt",
  [
    _swap_magic,
    _truncate,
    _truncate_header,
    _extra_bytes,
    _label_count,
    _truncate_gz,
  ],
  ids=[
    "wrong_magic",
    "truncated",
    "header",
    "extra_bytes",
    "label_count",
    "gz",
  ],
)
def test_bad_idx_files_give_clear_errors(tmp_path, corrupt):
  path, _ = _mnist_dir(tmp_path)
  name, pattern = corrupt(path)
  with pytest.raises(ValueError, match=pattern) as info:
    data.load_mnist(str(path))
  assert name in str(info.value)


def test_missing_mnist_files_are_listed(tmp_path):
  path, _ = _mnist_dir(tmp_path)
  (path / "t10k-images-idx3-ubyte").unlink()
  with pytest.raises(FileNotFoundError) as info:
    data.load_mnist(str(path))
  msg = str(info.value)
  assert (
    "missing in" in msg and "t10k-images-idx3-ubyte" in msg.split("Expected")[0]
  )
  assert all(n in msg for n in data.MNIST_FILES.values())
  assert ".gz" in msg and "digits" in msg
  with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
    data.load_mnist(str(tmp_path / "empty"))


# ---- digits stand-in ------------------------------------------------------


def test_digits_stand_in():
  train_x, train_y, test_x, test_y = data.load_digits()
  assert train_x.shape == (1500, 8, 8, 1) and test_x.shape == (297, 8, 8, 1)
  assert train_x.dtype == test_x.dtype == np.float32
  assert train_y.dtype == test_y.dtype == np.int32
  assert train_x.min() == 0.0 and train_x.max() == 1.0
  assert set(np.unique(train_y)) == set(range(10))
  again = data.load_digits()
  np.testing.assert_array_equal(again[2], test_x)
  np.testing.assert_array_equal(again[3], test_y)
  flat = {x.tobytes() for x in test_x}
  assert sum(x.tobytes() in flat for x in train_x) < 10  # a few true duplicates


# ---- array data and regression -------------------------------------------


@pytest.mark.parametrize("batch_size", [5, 7], ids=["divides", "straddles"])
def test_array_data_epochs_visit_each_example_once(batch_size):
  n = 35
  x = np.arange(n)
  d = data.ArrayData(x, x, x[:3], x[:3], batch_size=batch_size, seed=4)
  seen = np.concatenate([d.batch(s)[0] for s in range(2 * n // batch_size)])
  assert sorted(seen[:n]) == list(range(n)) and sorted(seen[n:]) == list(
    range(n)
  )
  assert not np.array_equal(seen[:n], seen[n:])  # each epoch reshuffled
  fresh = data.ArrayData(x, x, x[:3], x[:3], batch_size=batch_size, seed=4)
  np.testing.assert_array_equal(fresh.batch(3)[0], d.batch(3)[0])
  np.testing.assert_array_equal(
    fresh.batch(3, rows=slice(1, 3))[0], d.batch(3)[0][1:3]
  )
  assert [len(b[0]) for b in d.eval_batches()] == [3]


def test_regression_is_a_pure_function():
  args = dict(seed=3, n=200, d_in=8, n_features=64, noise=0.0)
  a, b = data.regression_data(**args), data.regression_data(**args)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)
  assert a.features.shape == (200, 64) and a.targets.shape == (200,)
  assert a.features.dtype == a.targets.dtype == a.teacher.dtype == np.float32
  np.testing.assert_allclose(
    a.targets, a.features @ a.teacher, rtol=1e-4, atol=1e-5
  )
  assert 0.5 < float(np.mean(a.features**2)) < 1.5
  other = data.regression_data(**{**args, "seed": 4})
  assert not np.array_equal(other.features, a.features)
  noisy = data.regression_data(**{**args, "noise": 0.5})
  np.testing.assert_array_equal(noisy.features, a.features)
  assert 0.3 < float(np.std(noisy.targets - a.targets)) < 0.7
  d = data.build("regression", batch_size=16, seed=1, num_train=64, num_test=32)
  assert d.batch(0)[0].shape == (16, 256) and len(d.eval_batches()) == 2


# ---- registry ---------------------------------------------------------------


def test_registry_names_and_errors():
  assert set(data.DATASETS) == {
    "builtin_text",
    "builtin_code",
    "tokens",
    "mnist",
    "digits",
    "regression",
  }
  with pytest.raises(
    ValueError, match=r"unknown data set 'digit'.*valid: .*mnist.*'digits'"
  ):
    data.build("digit", batch_size=2)
  with pytest.raises(
    ValueError, match=r"'digits' takes batch_size, seed, num_test"
  ):
    data.build("digits", batch_size=2, seq_len=8)
  with pytest.raises(ValueError, match="'tokens' takes"):
    data.build("tokens", seq_len=8, batch_size=2)


def test_sampling_rejects_bad_seeds():
  with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
    sampling.random_bits(-1, 1, 0, 4)
  bits = sampling.random_bits(2**64 - 1, 1, 2**100, 4)
  assert bits.dtype == np.uint64 and bits.shape == (4,)


def test_eval_batches_read_only_a_process_rows(tmp_path):
  d = data.TokenData(_token_dir(tmp_path, n_val=700), seq_len=10, batch_size=4)
  full = d.eval_batches()
  read = []
  windows = d.windows
  d.windows = lambda starts, split: (
    read.append(len(starts)) or windows(starts, split)
  )
  half = d.eval_batches(rows=lambda n: slice(n // 2, n))
  assert read == [2] * len(full)  # two of each batch's four windows
  for (x, y), (hx, hy) in zip(full, half, strict=True):
    np.testing.assert_array_equal(hx, x[2:])
    np.testing.assert_array_equal(hy, y[2:])
  x = np.arange(10)
  for test in (x, x[:3]):  # full batches of 4, and one short batch
    a = data.ArrayData(x, x, test, test, batch_size=4, seed=0)
    rows = lambda n: slice(0, n // 2)  # noqa: E731
    got = [b[0] for b in a.eval_batches(rows=rows)]
    want = [b[0][: len(b[0]) // 2] for b in a.eval_batches()]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]

"""Image classification sets: MNIST from IDX files, and scikit-learn's digits.

Both return `(train_x, train_y, test_x, test_y)`: float32 images in [0, 1] of
shape [N, H, W, 1] and int32 labels in 0..9.

MNIST is read from the four standard IDX files in a directory the config
names (plain or `.gz`); nothing is downloaded. IDX layout: a big-endian int32
magic number (2051 for images, 2049 for labels: two zero bytes, type code
0x08 for unsigned bytes, the number of dimensions), then one big-endian
uint32 per dimension, then the bytes.

The offline stand-in is scikit-learn's bundled `load_digits` (1797 8x8
digits, pixel values 0..16), split into 1500 train and 297 test images by a
fixed permutation that does not depend on the run's seed.
"""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from experiments.data import sampling

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
MNIST_FILES = {
  "train_images": "train-images-idx3-ubyte",
  "train_labels": "train-labels-idx1-ubyte",
  "test_images": "t10k-images-idx3-ubyte",
  "test_labels": "t10k-labels-idx1-ubyte",
}
NUM_CLASSES = 10
_DIGITS_STREAM = 0xD1_6175  # fixed split, independent of any run's seed


def _read_bytes(path: str) -> bytes:
  if not path.endswith(".gz"):
    with open(path, "rb") as f:
      return f.read()
  try:
    with gzip.open(path, "rb") as f:
      return f.read()
  except (EOFError, OSError, zlib.error) as e:
    raise ValueError(
      f"{path} is a truncated or corrupt gzip file ({e}); download it again"
    ) from e


def read_idx(path: str, magic: int) -> np.ndarray:
  """Reads an unsigned-byte IDX file (plain or `.gz`) and checks it.

  Args:
    path: the file.
    magic: the expected magic number, `IMAGES_MAGIC` (2051, 3 dimensions) or
      `LABELS_MAGIC` (2049, 1 dimension).

  Returns:
    uint8 array with the file's dimensions.

  Raises:
    ValueError: wrong magic number, a zero dimension, or a file shorter or
      longer than its header says (the message names the file and the fix).

  Example:
    ```python
    labels = read_idx("mnist/t10k-labels-idx1-ubyte", LABELS_MAGIC)
    labels.shape
    # (10000,)
    ```
  """
  data = _read_bytes(path)
  fix = "download the file again"
  if len(data) < 4:
    raise ValueError(
      f"{path} is truncated: {len(data)} bytes, no header; {fix}"
    )
  got = int.from_bytes(data[:4], "big")
  if got != magic:
    kind = {IMAGES_MAGIC: "images", LABELS_MAGIC: "labels"}.get(magic, "IDX")
    raise ValueError(
      f"{path} has magic number {got} (0x{got:08x}), expected {magic} "
      f"(0x{magic:08x}) for unsigned-byte {kind}: not an IDX {kind} file, or "
      f"the files are swapped; {fix}"
    )
  ndim = magic & 0xFF
  header = 4 + 4 * ndim
  if len(data) < header:
    raise ValueError(f"{path} is truncated inside its header; {fix}")
  dims = tuple(
    int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
  )
  if 0 in dims:
    raise ValueError(f"{path} has an empty dimension {dims}; {fix}")
  want = int(np.prod(dims))
  have = len(data) - header
  if have != want:
    what = "truncated" if have < want else "longer than its header says"
    raise ValueError(
      f"{path} is {what}: dimensions {dims} need {want} data bytes, found "
      f"{have}; {fix}"
    )
  return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _find(data_dir: str, name: str) -> str | None:
  for candidate in (name, name + ".gz"):
    path = os.path.join(data_dir, candidate)
    if os.path.isfile(path):
      return path
  return None


def _to_float(images: np.ndarray, top: float) -> np.ndarray:
  return (images.astype(np.float32) / np.float32(top))[..., None]


def _check_labels(path: str, labels: np.ndarray, num_images: int) -> None:
  if labels.shape[0] != num_images:
    raise ValueError(
      f"{path} has {labels.shape[0]} labels for {num_images} images: the "
      "image and label files do not belong together"
    )
  if labels.max() >= NUM_CLASSES:
    raise ValueError(f"{path} has label {labels.max()}; MNIST labels are 0..9")


def load_mnist(
  data_dir: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Reads MNIST from its four IDX files (each may end in `.gz`).

  Args:
    data_dir: directory holding `train-images-idx3-ubyte`,
      `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and
      `t10k-labels-idx1-ubyte` (or the same names plus `.gz`).

  Returns:
    (train_x, train_y, test_x, test_y): float32 images in [0, 1] of shape
    [N, 28, 28, 1] (60000 and 10000 for real MNIST) and int32 labels [N].

  Raises:
    FileNotFoundError: files are missing; the message lists the expected
      names.
    ValueError: see `read_idx`; also label count or range mismatches.

  Example:
    ```python
    train_x, train_y, test_x, test_y = load_mnist("data/mnist")
    train_x.shape, train_y.dtype
    # ((60000, 28, 28, 1), dtype('int32'))
    ```
  """
  paths = {k: _find(data_dir, n) for k, n in MNIST_FILES.items()}
  missing = [MNIST_FILES[k] for k, p in paths.items() if p is None]
  if missing:
    raise FileNotFoundError(
      f"MNIST files missing in {data_dir}: {', '.join(missing)}. Expected "
      f"the four IDX files {', '.join(MNIST_FILES.values())} (each may also "
      "end in .gz) in that directory; put them there and set data.path, "
      "or use data.name = 'digits', the offline stand-in."
    )
  out = []
  for split in ("train", "test"):
    images = read_idx(paths[f"{split}_images"], IMAGES_MAGIC)
    labels = read_idx(paths[f"{split}_labels"], LABELS_MAGIC)
    _check_labels(paths[f"{split}_labels"], labels, images.shape[0])
    out += [_to_float(images, 255.0), labels.astype(np.int32)]
  if out[0].shape[1:] != out[2].shape[1:]:
    raise ValueError(
      f"MNIST train and test images in {data_dir} differ in size: "
      f"{out[0].shape[1:3]} vs {out[2].shape[1:3]}"
    )
  return tuple(out)


def load_digits(
  num_test: int = 297,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """scikit-learn's bundled 8x8 digits, split into train and test.

  The split is a fixed permutation (the same on every run and seed): the
  first `1797 - num_test` permuted images train, the rest test.

  Args:
    num_test: number of test images, in [1, 1796].

  Returns:
    (train_x, train_y, test_x, test_y): float32 images in [0, 1] (pixel / 16)
    of shape [N, 8, 8, 1] and int32 labels [N].

  Raises:
    ImportError: scikit-learn is not installed (the message names the fix).

  Example:
    ```python
    train_x, train_y, test_x, test_y = load_digits()
    train_x.shape, test_x.shape
    # ((1500, 8, 8, 1), (297, 8, 8, 1))
    ```
  """
  try:
    from sklearn import datasets
  except ImportError as e:
    raise ImportError(
      "the digits data set ships with scikit-learn: `pip install "
      "scikit-learn` (part of the `experiments` extra)"
    ) from e
  bunch = datasets.load_digits()
  n = bunch.images.shape[0]
  if not 0 < num_test < n:
    raise ValueError(f"num_test must be in [1, {n - 1}]; got {num_test}")
  order = sampling.permutation(0, _DIGITS_STREAM, 0, n)
  images = _to_float(bunch.images[order], 16.0)
  labels = bunch.target[order].astype(np.int32)
  cut = n - num_test
  return images[:cut], labels[:cut], images[cut:], labels[cut:]

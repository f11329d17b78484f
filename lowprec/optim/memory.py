"""Bytes per parameter of the params and the optimizer state.

Counted from the leaves' actual dtypes and shapes, so it works for any
optax chain (and on `jax.eval_shape` outputs, without allocating): float32
AdamW is 4 + 8 = 12 bytes per parameter; bfloat16 weights with AdamW's
moments in float32 and a bfloat16 Kahan buffer are 2 + 8 + 2 = 12; with
the moments stored in bfloat16 as well, 2 + 4 + 2 = 8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from lowprec.engine.weights import is_array, path_name
from lowprec.optim.split import SplitState
from lowprec.optim.stored_state import StoredState


class BytesPerParam(NamedTuple):
  """Memory of params and optimizer state, per parameter.

  `params`, `state` and `total` are bytes per parameter (floats): `state`
  holds the state leaves kept per parameter (moments, buffers, remainders,
  and the scales of moments stored with a scale). `fixed` is the bytes of
  the other state leaves (step counters, PRNG keys, telemetry scalars,
  hyperparameters), in total and left out of `state` and `total`: they do
  not grow with the parameters' sizes (telemetry scalars grow with their
  number), except a state leaf shaped like no parameter, such as
  Adafactor's factored second moments.
  """

  params: float  # bytes of the parameter leaves / parameters.
  state: float  # bytes of the per-parameter state leaves / parameters.
  total: float  # params + state.
  fixed: int  # bytes of the other state leaves, in total.


def bytes_per_param(params, opt_state=None) -> BytesPerParam:
  """Bytes of `params` and `opt_state` per parameter, from their leaves.

  Parameters are the array leaves of `params` (every dtype; leaves that
  are not arrays are skipped), counted by their number of elements. A
  state leaf counts per parameter when

  - it has the shape of some parameter and at least one axis (moments,
    buffers, remainders), or
  - it is a scalar whose path ends with the path of a scalar parameter,
    inside a copy of the parameter tree (the same names with the same
    shapes, as Adam's `mu` is): the moments of a 0-d parameter;
  - it is a scale of `lowprec.store_state` (per block or per tensor) of a
    stored leaf that counts per parameter: scales count with the leaf
    they scale, whatever their shape;
  - it is the correction of a parameter in a `lowprec.split_writeback`
    state (a scalar parameter's too, where other parameters have none).

  The rest is `fixed`.

  Args:
    params: a pytree of arrays (or `jax.ShapeDtypeStruct`s, or an NNX
      state).
    opt_state: the optimizer state, in any view (NNX Variables are read
      through), or None for the params alone.

  Returns:
    A `BytesPerParam` with `params`, `state`, `total` and `fixed`.

  Raises:
    ValueError: `params` has no array leaves, or looks like an optimizer
      state (it holds an optax or lowprec state, a step count or a PRNG
      key): the arguments are `(params, opt_state)`, in that order.

  Example:
    ```python
    params = {"w": jnp.zeros((256, 256), jnp.bfloat16)}
    tx = optax.chain(lowprec.in_float32(optax.adam(1e-3)),
                     lowprec.kahan_writeback("bfloat16"))
    lowprec.bytes_per_param(params, tx.init(params)).total
    # 12.0
    ```
  """
  params = nnx.as_pure(params)
  _refuse_a_state(params)
  flat = [
    (path_name(p), x)
    for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    if is_array(x)
  ]
  n = sum(int(np.prod(x.shape)) for _, x in flat)
  if not n:
    raise ValueError(
      "bytes_per_param: params has no array leaves with elements; pass the "
      "parameter pytree (e.g. nnx.state(model, nnx.Param))"
    )
  per, fixed = 0, 0
  for size, is_per in _state_leaves(dict(flat), nnx.as_pure(opt_state)):
    if is_per:
      per += size
    else:
      fixed += size
  p = sum(_nbytes(x) for _, x in flat) / n
  return BytesPerParam(params=p, state=per / n, total=p + per / n, fixed=fixed)


def _state_leaves(params: dict, state):
  """`(bytes, per parameter?)` of every array leaf of `state`."""
  shapes = {tuple(x.shape) for x in params.values() if x.ndim}
  scalars = [name for name, x in params.items() if not x.ndim]
  wanted = {name: tuple(x.shape) for name, x in params.items()}
  leaves = {
    path_name(p): x
    for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
    if is_array(x)
  }
  served = _served(state, leaves)
  unpacked = _unpacked_shapes(state)
  corrections = _corrections(state, wanted)
  copies = {}  # prefix -> whether the leaves under it copy the params

  def is_copy(prefix: str) -> bool:
    if prefix not in copies:
      under = {
        name[len(prefix) :]: tuple(x.shape)
        for name, x in leaves.items()
        if name.startswith(prefix) and name not in served
      }
      copies[prefix] = under == wanted
    return copies[prefix]

  def per_param(name: str, x) -> bool:
    if name in corrections:
      return True
    if name in unpacked:  # 4-bit codes two to a byte: the shape they code
      return unpacked[name] in shapes
    if x.ndim:
      return tuple(x.shape) in shapes
    for p in scalars:
      if name == p or name.endswith("/" + p):
        if is_copy(name[: len(name) - len(p)]):
          return True
    return False

  kinds = {n: per_param(n, x) for n, x in leaves.items() if n not in served}
  for name, x in leaves.items():
    if name in served:
      yield _nbytes(x), kinds.get(served[name], False)
    else:
      yield _nbytes(x), kinds[name]


def _stored_nodes(state):
  """`(prefix, node)` of every `store_state` state in `state` (typed, or a
  dict view of one), the prefix its path and "/" ("" at the root)."""
  # A view has no `recipe`: a static record, not an array.
  fields = set(StoredState._fields) - {"recipe"}

  def stored(x) -> bool:
    return isinstance(x, StoredState) or (
      isinstance(x, Mapping) and {str(k) for k in x} == fields
    )

  nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=stored)[0]
  for path, node in nodes:
    if stored(node):
      pre = path_name(path)
      yield (pre + "/" if pre else ""), node


def _unpacked_shapes(state) -> dict[str, tuple[int, ...]]:
  """Leaf name -> the shape its codes unpack to, for every leaf that a
  `store_state` state keeps two codes to a byte (from its record; a view
  has none)."""
  out = {}
  for pre, node in _stored_nodes(state):
    recipe = getattr(node, "recipe", None)
    for name, shape in recipe.shapes if recipe is not None else ():
      out[pre + "inner/" + name] = tuple(shape)
  return out


def _served(state, leaves: dict) -> dict[str, str]:
  """Scale leaf name -> name of the stored leaf it scales, for every
  `store_state` state in `state` (typed, or a dict view of one)."""
  out = {}
  for pre, _ in _stored_nodes(state):
    for name in leaves:
      if name.startswith(pre + "scales/"):
        out[name] = pre + "inner/" + name[len(pre + "scales/") :]
  return out


def _corrections(state, wanted: dict) -> set[str]:
  """Names of the leaves that are a parameter's correction in a
  `split_writeback` state (typed, or a dict view of one)."""

  def split(x) -> bool:
    return isinstance(x, SplitState) or (
      isinstance(x, Mapping)
      and {"count", "correction"} <= {str(k) for k in x}
      and {str(k) for k in x} <= set(SplitState._fields)
    )

  out = set()
  nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=split)[0]
  for path, node in nodes:
    if not split(node):
      continue
    pre = path_name(path)
    codes = (
      node.correction if isinstance(node, SplitState) else node["correction"]
    )
    for name, x in codes.items():
      if is_array(x) and wanted.get(str(name)) == tuple(x.shape):
        out.add(f"{pre}/correction/{name}" if pre else f"correction/{name}")
  return out


def _refuse_a_state(params) -> None:
  """Raises if `params` holds what only an optimizer state holds."""

  def state_node(x) -> bool:
    module = getattr(type(x), "__module__", "") or ""
    return hasattr(x, "_fields") and module.split(".")[0] in (
      "optax",
      "lowprec",
    )

  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=state_node)[0]
  for path, x in flat:
    name = path_name(path) or "the root"
    what = None
    if state_node(x):
      what = f"an optax state ({type(x).__name__}) at {name!r}"
    elif is_array(x) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      what = f"a PRNG key at {name!r}"
    elif (
      is_array(x)
      and jax.dtypes.issubdtype(x.dtype, np.integer)
      and name.split("/")[-1] == "count"
    ):
      what = f"a step count at {name!r}"
    if what:
      raise ValueError(
        f"bytes_per_param: params holds {what}, so it looks like an "
        "optimizer state; the arguments are (params, opt_state), in that "
        "order: bytes_per_param(params, tx.init(params))"
      )


def _nbytes(x) -> int:
  dtype = x.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return int(np.prod(x.shape)) * 8  # threefry's two uint32 words
  return int(np.prod(x.shape)) * np.dtype(dtype).itemsize

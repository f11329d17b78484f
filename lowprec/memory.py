"""Bytes per parameter of the params and the optimizer state.

Counted from the leaves' actual dtypes and shapes, so it works for any
optax chain (and on `jax.eval_shape` outputs, without allocating): float32
AdamW is 4 + 8 = 12 bytes per parameter; bfloat16 weights with AdamW's
moments in float32 and a bfloat16 Kahan buffer are 2 + 8 + 2 = 12; with
the moments stored in bfloat16 as well, 2 + 4 + 2 = 8.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from lowprec.storage import is_array


class BytesPerParam(NamedTuple):
  """Memory of params and optimizer state, per parameter.

  `params`, `state` and `total` are bytes per parameter (floats). `fixed`
  is the bytes of state leaves shaped like no parameter (step counters,
  PRNG keys, telemetry scalars, hyperparameters): a constant that does not
  grow with the model, left out of `state` and `total`.
  """

  params: float  # bytes of the parameter leaves / parameters.
  state: float  # bytes of the state leaves shaped like a parameter / ditto.
  total: float  # params + state.
  fixed: int  # bytes of the other state leaves, in total.


def bytes_per_param(params, opt_state=None) -> BytesPerParam:
  """Bytes of `params` and `opt_state` per parameter, from their leaves.

  Parameters are the array leaves of `params` (every dtype; leaves that
  are not arrays are skipped), counted by their number of elements. A
  state leaf counts per parameter when its shape is the shape of some
  parameter (moments, buffers, remainders); the rest is `fixed`.

  Args:
    params: a pytree of arrays (or `jax.ShapeDtypeStruct`s, or an NNX
      state).
    opt_state: the optimizer state, in any view (NNX Variables are read
      through), or None for the params alone.

  Returns:
    A `BytesPerParam` with `params`, `state`, `total` and `fixed`.

  Raises:
    ValueError: `params` has no array leaves.

  Example:
    ```python
    params = {"w": jnp.zeros((256, 256), jnp.bfloat16)}
    tx = optax.chain(lowprec.in_float32(optax.adam(1e-3)),
                     lowprec.kahan_writeback("bfloat16"))
    lowprec.bytes_per_param(params, tx.init(params)).total
    # 12.0
    ```
  """
  leaves = [x for x in jax.tree.leaves(nnx.as_pure(params)) if is_array(x)]
  n = sum(int(np.prod(x.shape)) for x in leaves)
  if not n:
    raise ValueError(
      "bytes_per_param: params has no array leaves with elements; pass the "
      "parameter pytree (e.g. nnx.state(model, nnx.Param))"
    )
  shapes = {tuple(x.shape) for x in leaves}
  per, fixed = 0, 0
  for x in jax.tree.leaves(nnx.as_pure(opt_state)):
    if not is_array(x):
      continue
    size = _nbytes(x)
    if tuple(x.shape) in shapes and x.ndim:
      per += size
    else:
      fixed += size
  p = sum(_nbytes(x) for x in leaves) / n
  return BytesPerParam(params=p, state=per / n, total=p + per / n, fixed=fixed)


def _nbytes(x) -> int:
  dtype = x.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return int(np.prod(x.shape)) * 8  # threefry's two uint32 words
  return int(np.prod(x.shape)) * np.dtype(dtype).itemsize

"""The write-back of one leaf in one pass: a Pallas kernel.

`lowprec.writeback(..., kernel=)` steps each leaf it can by this kernel:
it reads the weights (in their stored dtype) and the proposals, rounds
`w + u` onto the grid, and writes the exact delta and, with telemetry,
each row's counts, every array read or written once. Written with XLA's
ops, the counts are a second consumer of the rounded value: XLA:CPU
recomputes the whole write-back in the counting reduction, reading the
weights and proposals twice (56 MiB against 40 a 1024 x 1024 leaf by its
cost analysis, docs/benchmarks.md), and an optimizer step is bound by
its bytes on an accelerator.

The kernel's arithmetic is the XLA path's: its tile runs
`leafwise.Plain.elements`, the function the XLA path runs on the whole
leaf, and its random bits are `writeback`'s (the leaf's key, hashed with
each element's row-major index, which the kernel computes from its place
in the grid). It holds plain float grids (bfloat16, float16, the float8
formats and any `eXmY`), any rounding, overflow and non-finite mode, on
leaves whose size is a whole number of 128-element rows; a leaf it does
not take (MX scaled formats, integer grids, other sizes) takes the XLA
path, leaf by leaf. On this CPU it runs in Pallas's interpreter, for
tests (tests/writeback_kernel_test.py checks it bit for bit against the
XLA path); Triton compiles it for an NVIDIA GPU.

Where it runs (`kernel`), as `scale_by_stored_adam`'s: "auto" on one
NVIDIA GPU (weights stored in a one-byte float dtype on one whose Triton
converts float8, compute capability 8.9 or more), the XLA path elsewhere;
"pallas" everywhere (interpreted off a GPU); "xla" never (the default).
Under `jax.shard_map` a kernel sees its shard as the whole leaf, so its
random bits follow the shard's indices (unbiased, but not the bits of
one device).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton

from lowprec.engine import counting, leafwise
from lowprec.grids import choices
from lowprec.grids import rng as rng_lib
from lowprec.grids.formats import Format
from lowprec.optim import fused_adam

__all__ = ["KERNELS", "leaf_kernel"]

KERNELS = ("auto", "pallas", "xla")
# Elements of a row: a leaf is taken as rows of this many.
_LANES = 128


def leaf_kernel(kernel: str):
  """`leafwise.step`'s `kernel` hook for `kernel` ("auto", "pallas",
  "xla"), or None where the XLA path runs every leaf."""
  choices.check_choice("kernel", kernel, KERNELS)
  if kernel == "xla":
    return None
  return functools.partial(_step, kernel)


def _takes(leaf, fmt, w) -> bool:
  """Whether the kernel holds this leaf: a plain float grid, no MX
  scales, a size of whole rows."""
  del leaf
  size = int(np.prod(jnp.shape(w)))
  return (
    isinstance(fmt, Format)
    and fmt.is_float
    and size > 0
    and size % _LANES == 0
    and size < 2**32
  )


def _here(kernel: str, w) -> bool:
  """ "pallas": always; "auto": on one NVIDIA GPU, with weights in a
  one-byte float dtype only on one whose Triton converts float8."""
  if kernel == "pallas":
    return True
  if jax.default_backend() != "gpu" or jax.device_count() != 1:
    return False
  if jnp.dtype(w.dtype).itemsize == 1:
    return fused_adam._capability(jax.devices()[0]) >= (8, 9)
  return True


def _step(kernel, leaf, fmt, w, u32, key):
  """`(delta, counts)` of one leaf by the kernel, or None where it does
  not take the leaf (the caller runs the XLA path)."""
  if not _takes(leaf, fmt, w) or not _here(kernel, w):
    return None
  shape = jnp.shape(w)
  rows = int(np.prod(shape)) // _LANES
  tile = fused_adam._tile(rows, _LANES)
  seeds = (
    jnp.zeros([2], jnp.uint32)
    if key is None
    else jnp.stack(rng_lib._seeds(key))
  )
  n_counts = len(leafwise.PLAIN_COUNTS) if leaf.telemetry else 0
  spec = lambda w: pl.BlockSpec((tile, w), lambda i: (i, 0))  # noqa: E731
  out_shape = (
    jax.ShapeDtypeStruct((rows, _LANES), jnp.float32),
    *[jax.ShapeDtypeStruct((rows, 1), jnp.int32)] * n_counts,
  )

  def call(interpret, *args):
    body = functools.partial(_body, leaf, fmt, tile, key is not None)
    out = pl.pallas_call(
      body,
      out_shape=out_shape,
      grid=(pl.cdiv(rows, tile),),
      in_specs=[
        pl.BlockSpec(seeds.shape, lambda i: (0,)),
        spec(_LANES),
        spec(_LANES),
      ],
      out_specs=[spec(_LANES), *[spec(1)] * n_counts],
      interpret=interpret,
      compiler_params=None if interpret else triton.CompilerParams(),
      name="writeback",
    )(*args)
    # The rows' counts summed (int32: in any order, the same count).
    return (out[0], *(jnp.sum(c, dtype=jnp.int32) for c in out[1:]))

  def xla(seeds, w, u):
    bits = None
    if key is not None:
      bits = rng_lib.hash_at(rng_lib.global_index(w.shape), seeds[0], seeds[1])
    delta, counts = leaf(None, w.astype(jnp.float32), u, fmt, bits)
    return (delta, *counts)

  delta, *counts = jax.lax.platform_dependent(
    seeds,
    jnp.reshape(w, (rows, _LANES)),
    jnp.reshape(u32, (rows, _LANES)),
    cuda=functools.partial(call, False),
    default=functools.partial(call, True) if kernel == "pallas" else xla,
  )
  return jnp.reshape(delta, shape), tuple(counts)


def _body(leaf, fmt, tile, random, s_ref, w_ref, u_ref, d_ref, *count_refs):
  """One tile: `leaf.elements` on its rows, each row's counts summed."""
  w = w_ref[...].astype(jnp.float32)
  u = u_ref[...]
  bits = None
  if random:
    index = fused_adam._indices(tile, _LANES, 1, w.shape)[0]
    bits = rng_lib.hash_at(index, s_ref[0], s_ref[1])
  delta, masks, _ = leaf.elements(w, u, fmt, bits)
  d_ref[...] = delta
  for ref, c in zip(count_refs, counting.row_counts(masks), strict=True):
    ref[...] = c

"""Adam with 8- and 4-bit moments in one pass: a Pallas kernel per leaf.

`scale_by_stored_adam` is `store_state(optax.scale_by_adam(...), {"mu":
mu, "nu": nu}, telemetry=False)`, the same state and the same bits, with
the step of each leaf done by one kernel: it reads the gradient and the
two moments' codes and block scales, runs Adam's update, takes each new
moment's block maximum, and writes the new codes, scales and Adam's
direction, each array read or written once. Written with XLA's ops, the
same step writes each float32 moment out between its block reduction and
its encoding and reads it back (2.1-2.8x AdamW's bytes by XLA's count,
docs/benchmarks.md), and an optimizer step is bound by its bytes on an
accelerator.

The kernel holds FlashOptim's `companded8` (first moment) and `sqrt8`
(second moment), whose codes and values have closed forms, and
bitsandbytes' `dynamic8` (either moment) and `dynamic8u` (second
moment), whose codes it finds in the same tables the XLA path reads
(`CodeMap.tables()`, passed to the kernel whole); Li, Chen and Zhu's
4-bit `dynamic4` (either moment) and `uint4nz` (second moment), whose
codes it packs two to a byte as `store_state` stores them, reading a
tile's even and odd entries apart (the low and the high nibbles); and
float8 e4m3 codes under power-of-two or amax block scales (torchao's
AdamWFp8 is `"float8_e4m3fn:nearest:block256:amax"` for both), rounded
as `lowprec.grids.rounding` rounds, on bit patterns (on a GPU of compute
capability 8.9 or more, whose Triton converts to float8; "auto" takes
the XLA path on an older one). Blocks of 32 or any power of two,
nearest, stochastic or dead-zone rounding; either moment may take any of
these its role allows. Stochastic rounding draws the bits `store_state`
draws, from the same key (one split a step, folded by the leaf's path)
and each element's index in its leaf, which the kernel computes from its
place in the grid: the codes are the same bit for bit. (Under
`jax.shard_map` a kernel sees its shard as the whole leaf, so its random
bits follow the shard's indices, not the leaf's: still unbiased, but not
the bits of one device.) Its arithmetic is the XLA path's, operation for
operation (the same float32 expressions, the same selects that keep a
product from being contracted into an FMA, the same correctly rounded
divisions and roots: for Triton, PTX's `div.rn.f32` and `sqrt.rn.f32`,
which XLA's compile to, where Triton's own `/` is the approximate
`div.full.f32`; `lowprec.grids._ieee`), so its codes, scales and updates
are the XLA path's bit for bit (tests/fused_adam_test.py, on this CPU in
Pallas's interpret mode, for twelve pairs of formats; on a GPU the
write-back benchmark compares the two). Not e5m2: XLA:CPU converts a NaN
to an e5m2 NaN of one payload or another depending on the program around
it. One caveat is XLA:CPU's, not the kernel's: where it contracts Adam's
`b * m + (1 - b) * g` into an FMA, and which product it contracts,
depends on how it fuses the program around it, so where dead-zone
rounding or the counts read the old moments a second time, the
interpreted kernel's last bits may leave the XLA path's (as
`store_state`'s own do between telemetry on and off); without FMA
instructions they agree, and the tests check them so. A leaf the kernel
does not take (a last axis that is not a whole number of blocks, a
scalar) takes the XLA path, leaf by leaf.

Where it runs (`kernel`): "auto" runs the kernel on an NVIDIA GPU
(Pallas's Triton backend) when one device is in use, and the XLA path
elsewhere, another GPU included: on a CPU the XLA path is the faster
one (the kernel runs there only in Pallas's interpreter), and on
several devices XLA cannot split the
kernel's call along a sharded leaf (it would gather the leaf whole onto
every device; run the transform under `jax.shard_map(...,
check_vma=False)` with `kernel="pallas"` to have each device step its
own shard, whose blocks are whole where the shard's last axis is a
multiple of the block: tests/fused_adam_test.py does so on 8 devices).
"pallas" runs the kernel everywhere (interpreted off a GPU: for tests),
"xla" never.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton

from lowprec.engine import codec as codec_lib
from lowprec.engine import counting, leafwise
from lowprec.engine.weights import path_name
from lowprec.grids import _ieee, choices
from lowprec.grids import rng as rng_lib
from lowprec.optim import stored_state as stored_lib
from lowprec.optim.stored_state import _FIELDS

__all__ = ["KERNELS", "scale_by_stored_adam"]

KERNELS = ("auto", "pallas", "xla")
# The code maps the kernel holds, by moment.
_MAPS = {
  "mu": ("companded8", "dynamic8", "dynamic4"),
  "nu": ("sqrt8", "dynamic8u", "dynamic8", "uint4nz", "dynamic4"),
}
# The float formats it holds, for either moment, under power-of-two or
# amax block scales. (Not e5m2: XLA:CPU converts a NaN to an e5m2 NaN of
# one payload or another depending on the program around it, so the
# kernel's NaN codes could differ from the XLA path's; e4m3fn has one
# NaN a sign.)
_FLOATS = ("float8_e4m3fn",)


def scale_by_stored_adam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  *,
  mu: str = "companded8:block32",
  nu: str = "sqrt8:block32",
  kernel: str = "auto",
  key: jax.Array | None = None,
  telemetry: bool = False,
) -> optax.GradientTransformation:
  """`optax.scale_by_adam` with both moments stored as 8- or 4-bit codes,
  each leaf's step one kernel (module docstring).

  The same transform, state and bits as `lowprec.store_state(optax.
  scale_by_adam(b1, b2, eps, eps_root), {"mu": mu, "nu": nu},
  telemetry=telemetry, key=key)`: a state of either continues in the
  other. Chain it
  as `optax.scale_by_adam` is chained, e.g. AdamW:

  ```python
  tx = optax.chain(
      lowprec.scale_by_stored_adam(0.9, 0.95),
      optax.add_decayed_weights(0.1),
      optax.scale_by_learning_rate(3e-4))
  ```

  Args:
    b1: Adam's first-moment decay, as `optax.scale_by_adam` takes it.
    b2: Adam's second-moment decay.
    eps: added to the root of the second moment.
    eps_root: added to the second moment inside the root.
    mu: the first moment's spec, `"companded8:block<N>"`,
      `"dynamic8:block<N>"`, `"dynamic4:block<N>"` or
      `"float8_e4m3fn:nearest:block<N>"` (with `:amax`, and `:float16`,
      for amax scales), N a power of two; `":stochastic"` after the
      format rounds stochastically (e.g. `"dynamic8:stochastic:block256"`,
      the `q8` state recipe's), `":deadzone"` by dead zone.
    nu: the second moment's, `"sqrt8:block<N>"`, `"dynamic8u:block<N>"`,
      `"dynamic8:block<N>"`, `"uint4nz:block<N>"`, `"dynamic4:block<N>"`
      or an e4m3 spec as for `mu`.
    kernel: "auto", "pallas" or "xla" (module docstring).
    key: a JAX PRNG key, required where a moment rounds stochastically
      or by dead zone, as `store_state` takes it: the same key gives
      `store_state`'s bits.
    telemetry: count each moment leaf's changed, erased, flushed,
      saturated, non-finite and stalled entries as `store_state` does
      (`lowprec.telemetry` reads them); the kernel counts each row as it
      writes it, so the counts cost no pass of their own.

  Raises:
    ValueError: an unknown `kernel`; with `kernel="pallas"`, a spec the
      kernel does not hold (naming the ones it does, and `kernel="xla"`
      for any other `store_state` spec).
  """
  choices.check_choice("kernel", kernel, KERNELS)
  specs = {"mu": mu, "nu": nu}
  formats = {n: stored_lib.parse_state_format(s) for n, s in specs.items()}
  random = [n for n, f in formats.items() if f.rounding != "nearest"]
  impl = None
  if random:
    impl = rng_lib.state_key(
      key, "scale_by_stored_adam with a random rounding"
    )[1]
  reason = _unheld(formats)
  if reason and kernel == "pallas":
    raise ValueError(
      f"scale_by_stored_adam: the kernel does not hold {reason}; it holds "
      "mu 'companded8', 'dynamic8' or 'dynamic4' and nu 'sqrt8', "
      "'dynamic8u', 'dynamic8', 'uint4nz' or 'dynamic4', as "
      "':block<N>', or 'float8_e4m3fn:nearest:block<N>' "
      "(':amax' allowed) for either (N a power of two, any "
      "rounding): use those, or kernel='xla', or "
      "lowprec.store_state(optax.scale_by_adam(...), rules) for any "
      "other spec"
    )
  reference = stored_lib.store_state(
    optax.scale_by_adam(b1, b2, eps, eps_root),
    specs,
    telemetry=telemetry,
    key=key,
  )
  if reason or kernel == "xla":
    return reference
  codecs = {n: f.codec() for n, f in formats.items()}
  hyper = (b1, b2, eps, eps_root)

  def update_fn(updates, state, params=None):
    if not _kernel_here(kernel, codecs):
      return reference.update(updates, state, params)
    count, corrections = _corrections(hyper, state)
    flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
    mus = treedef.flatten_up_to(state.inner.mu)
    nus = treedef.flatten_up_to(state.inner.nu)
    names = [path_name(path) for path, _ in flat_g]
    new_key, keys = _step_keys(state, impl, random, names)
    out_u, out_mu, out_nu, scales, per = [], [], [], {}, {}
    for name, (_, g), m, v in zip(names, flat_g, mus, nus, strict=True):
      mu_s = state.scales[f"mu/{name}"]
      nu_s = state.scales[f"nu/{name}"]
      seeds = _seeds([keys.get(f"{n}/{name}") for n in ("mu", "nu")])
      step = _moment_step(kernel, g, codecs, telemetry)
      u, m2, ms, v2, vs, *counts = step(
        codecs, hyper, corrections, seeds, g, m, mu_s, v, nu_s
      )
      if telemetry:
        per[f"mu/{name}"] = counts[: len(_FIELDS)]
        per[f"nu/{name}"] = counts[len(_FIELDS) :]
      out_u.append(u)
      out_mu.append(m2)
      out_nu.append(v2)
      scales[f"mu/{name}"] = ms
      scales[f"nu/{name}"] = vs
    new = _new_state(
      state, count, treedef, (out_mu, out_nu), scales, per, new_key, telemetry
    )
    return jax.tree_util.tree_unflatten(treedef, out_u), new

  return optax.GradientTransformation(
    reference.init, _checked(reference, update_fn)
  )


def _moment_step(kernel, g, codecs, telemetry):
  """The step of one leaf's moments: the kernel where it takes the leaf
  (`_held`), else the XLA path (`_reference_step`)."""
  if _held(g, codecs):
    return functools.partial(
      _leaf_step, telemetry=telemetry, interpret=kernel == "pallas"
    )
  return functools.partial(_reference_step, telemetry=telemetry)


def _corrections(hyper, state) -> tuple[jax.Array, jax.Array]:
  """`(count, Adam's two bias corrections as float32 [2])` of this update
  of the stored state `state`, as `optax.scale_by_adam` computes them."""
  b1, b2 = hyper[:2]
  count = optax.safe_increment(state.inner.count)
  corrections = jnp.stack(
    [(1 - b1**count).astype(jnp.float32), (1 - b2**count).astype(jnp.float32)]
  )
  return count, corrections


def _step_keys(state, impl, random, names) -> tuple:
  """`(new key words, {"mu/<leaf>": key})`: `store_state`'s keys, one
  split a step, folded by each stored leaf's path (`lowprec.grids.rng`),
  for the moments in `random`; none where it is empty."""
  if not random:
    return state.counts.key, {}
  new_key, step_key = rng_lib.next_step(state.counts.key, impl)
  paths = [f"{m}/{n}" for n in names for m in random]
  return new_key, rng_lib.leaf_keys(step_key, paths)


def _new_state(state, count, treedef, moments, scales, per, key, telemetry):
  """The stored state after an update: the new codes `moments` (`(mus,
  nus)`, flat in `treedef`'s order), scales, per-leaf counts and key."""
  mus, nus = moments
  inner = optax.ScaleByAdamState(
    count,
    jax.tree_util.tree_unflatten(treedef, mus),
    jax.tree_util.tree_unflatten(treedef, nus),
  )
  counts = state.counts._replace(
    count=optax.safe_increment(state.counts.count),
    key=key,
    **counting.by_field(per, _FIELDS, telemetry),
  )
  return stored_lib.StoredState(inner, scales, counts, state.recipe)


def _checked(reference, update_fn):
  """`update_fn`, refusing a state recorded under other specs as the
  reference does (its update, traced for shapes only, checks)."""

  def update(updates, state, params=None):
    jax.eval_shape(reference.update, updates, state, params)
    return update_fn(updates, state, params)

  return update


def _kernel_here(kernel: str, codecs) -> bool:
  """Whether the kernel runs: "pallas" everywhere; "auto" on one GPU
  (on one that is not NVIDIA's, `_leaf_step` takes the XLA path), and
  with e4m3 codes only on one whose Triton converts to float8 (compute
  capability 8.9 or more). On several devices XLA cannot split a
  kernel's call across them: it would gather each sharded leaf whole
  onto every device."""
  if kernel == "pallas":
    return True
  if jax.default_backend() != "gpu" or jax.device_count() != 1:
    return False
  if all(c.mapped for c in codecs.values()):
    return True
  return _capability(jax.devices()[0]) >= (8, 9)


def _capability(device) -> tuple[int, int]:
  """An NVIDIA device's compute capability; (0, 0) where it has none."""
  text = str(getattr(device, "compute_capability", "0.0"))
  major, _, minor = text.partition(".")
  try:
    return int(major), int(minor or 0)
  except ValueError:
    return 0, 0


def _unheld(formats) -> str | None:
  """What the kernel does not hold of `{"mu": StateFormat, "nu": ...}`,
  or None."""
  for name, f in formats.items():
    if f.mapped and f.fmt.name not in _MAPS[name]:
      return f"{name} {str(f)!r} (its map)"
    if not f.mapped and getattr(f.fmt, "name", None) not in _FLOATS:
      return f"{name} {str(f)!r} (its format)"
    block = f.scale
    if not isinstance(block, int) or block < 2 or block & (block - 1):
      return f"{name} {str(f)!r} (its blocks)"
  if formats["mu"].scale != formats["nu"].scale:
    return "moments in blocks of two sizes"
  return None


def _held(g, codecs) -> bool:
  block = codecs["mu"].scale
  shape = jnp.shape(g)
  return bool(shape) and shape[-1] % block == 0 and jnp.size(g) > 0


def _moments(hyper, corrections, g, mu, nu, compiled=False):
  """Adam's new moments and direction from float32 `mu`, `nu` read back:
  `optax.scale_by_adam`'s expressions, with its bias corrections given.

  `compiled`: the direction as XLA compiles optax's expression, written
  out for a compiler that takes it as written. XLA's simplifier turns
  `(mu / c1) / den` into `mu / (c1 den)` (one rounding fewer) and drops
  an `eps_root` of 0. (Where one leaf alone reads a correction, a
  broadcast scalar, XLA:CPU also takes the division by it as a product
  with its rounded reciprocal; the kernel does not, so on a one-leaf
  tree its direction may differ from the XLA path's in the last bit.
  The moments do not.)"""
  b1, b2, eps, eps_root = hyper
  mu = optax.tree.update_moment(g, mu, b1, 1)
  nu = optax.tree.update_moment_per_elem_norm(g, nu, b2, 2)
  if not compiled:
    mu_hat = mu / corrections[0]
    nu_hat = nu / corrections[1]
    return mu, nu, mu_hat / (jnp.sqrt(nu_hat + eps_root) + eps)
  nu_hat = _ieee.div(nu, corrections[1])
  if not (isinstance(eps_root, int | float) and eps_root == 0):
    nu_hat = nu_hat + eps_root
  return mu, nu, _ieee.div(mu, corrections[0] * (_ieee.sqrt(nu_hat) + eps))


def _seeds(keys) -> jax.Array:
  """uint32 [4]: the hash's two key words (`rng_lib.hash_at`) of the
  first moment's key, then the second's (zeros for a moment rounded to
  nearest, whose key is None)."""
  words = []
  for key in keys:
    pair = (
      (jnp.uint32(0), jnp.uint32(0)) if key is None else rng_lib._seeds(key)
    )
    words.extend(pair)
  return jnp.stack(words)


def _reference_step(
  codecs, hyper, corrections, seeds, g, m, ms, v, vs, *, telemetry
):
  """One leaf by XLA's ops (`store_state`'s arithmetic): the direction,
  each moment's codes and scales, and (`telemetry`) each moment's
  counts (`stored_state._FIELDS`, int32 scalars, the first moment's
  then the second's; none without)."""
  g = jnp.asarray(g, jnp.float32)
  shape, cm, cv = jnp.shape(g), codecs["mu"], codecs["nu"]
  m_old = codec_lib.unpack(cm, m, shape)
  v_old = codec_lib.unpack(cv, v, shape)
  mu0 = codec_lib.decode(cm, m_old, ms)
  nu0 = codec_lib.decode(cv, v_old, vs)
  mu, nu, u = _moments(hyper, corrections, g, mu0, nu0)
  index = rng_lib.global_index(shape)
  bits = [
    rng_lib.hash_at(index, seeds[i], seeds[i + 1]) if c.random else None
    for i, c in ((0, cm), (2, cv))
  ]
  em = codec_lib.encode(cm, mu, mu0, bits[0])
  en = codec_lib.encode(cv, nu, nu0, bits[1])
  m2, v2 = codec_lib.pack(cm, em.code), codec_lib.pack(cv, en.code)
  counts = ()
  if telemetry:
    counts = (
      *stored_lib._state_counts(mu, mu0, em, m_old),
      *stored_lib._state_counts(nu, nu0, en, v_old),
    )
  return (u, m2, em.scales, v2, en.scales, *counts)


class Apply(NamedTuple):
  """What a kernel that also applies the step does after Adam's
  direction `u`, as optax's AdamW chain and `lowprec.writeback` do:
  `u + weight_decay * w` (skipped for a decay of 0, as optax skips it),
  times the step size (a scalar given at run time), then the write-back
  of the weights `w` on the grid `fmt` by `leaf`
  (`leafwise.Plain`), whose deltas the kernel writes in place of `u`."""

  leaf: Any
  fmt: Any
  weight_decay: float


def _decayed(apply, u, w, step_size):
  """optax's `add_decayed_weights` then `scale_by_learning_rate` of one
  leaf: `(u + weight_decay * w) * step_size`, the product with the decay
  in the weights' dtype, as optax's weakly typed constant gives it."""
  if apply.weight_decay != 0:
    u = u + (np.asarray(apply.weight_decay, w.dtype) * w).astype(jnp.float32)
  return u * step_size


def _reference_apply(apply, out, seeds, w, step_size):
  """`_reference_step`'s outputs with the direction replaced by the
  write-back's deltas of `w`, and the write-back's counts appended."""
  u, *rest = out
  bits = None
  if apply.leaf.rounding != "nearest":
    bits = rng_lib.hash_at(rng_lib.global_index(u.shape), seeds[4], seeds[5])
  delta, counts = apply.leaf(
    None,
    w.astype(jnp.float32),
    _decayed(apply, u, w, step_size),
    apply.fmt,
    bits,
  )
  return (delta, *rest, *counts)


def _leaf_step(
  codecs,
  hyper,
  corrections,
  seeds,
  g,
  m,
  ms,
  v,
  vs,
  *,
  telemetry,
  interpret,
  apply=None,
  w=None,
  step_size=None,
):
  """One leaf by the kernel: the leaf as rows of one block each, in
  tiles of `_tile` rows; compiled by Triton for CUDA, and on any other
  platform run by Pallas's interpreter (`interpret`) or else by the XLA
  path (`_reference_step`: "auto" on a GPU that is not NVIDIA's, whose
  kernels Triton-on-CUDA does not compile). Where a moment's codes
  are packed two to a byte, the rows are read and written as their even
  and odd entries apart (`_lanes`), the low and the high nibbles.

  With `apply` (an `Apply`), the kernel also reads the weights `w` and
  writes their write-back's deltas in place of the direction, and (with
  the write-back's telemetry) its counts after the moments'; `seeds`
  then holds the write-back's two key words after the moments' four,
  and `step_size` is the float32 scalar the decayed direction is
  multiplied by."""
  block = codecs["mu"].scale
  width = {n: block // 2 if c.packed else block for n, c in codecs.items()}
  lanes = _lanes(block, any(c.packed for c in codecs.values()))
  shape = jnp.shape(g)
  rows = int(np.prod(shape)) // block
  tile = _tile(rows, block)
  flat = lambda a, w: jnp.reshape(a, (rows, w))  # noqa: E731
  spec = lambda w: pl.BlockSpec((tile, w), lambda i: (i, 0))  # noqa: E731
  consts = jnp.concatenate(
    [corrections, jax.lax.optimization_barrier(_CONSTANTS)]
  )
  if apply is not None:
    consts = jnp.concatenate([consts, jnp.reshape(step_size, [1])])
  tables = {
    n: _padded(c.fmt.tables() if c.mapped else {}) for n, c in codecs.items()
  }
  names = {n: tuple(t) for n, t in tables.items()}
  arrays = [a for t in tables.values() for a in t.values()]
  whole = [pl.BlockSpec(a.shape, lambda i: (0,)) for a in arrays]
  # With telemetry, each row's counts of each field, each moment.
  n_counts = 2 * len(_FIELDS) if telemetry else 0
  if apply is not None and apply.leaf.telemetry:
    n_counts += len(leafwise.PLAIN_COUNTS)
  weights = [] if apply is None else [flat(w, block)]
  out_shape = (
    jax.ShapeDtypeStruct((rows, block), jnp.float32),
    jax.ShapeDtypeStruct((rows, width["mu"]), m.dtype),
    jax.ShapeDtypeStruct((rows, 1), ms.dtype),
    jax.ShapeDtypeStruct((rows, width["nu"]), v.dtype),
    jax.ShapeDtypeStruct((rows, 1), vs.dtype),
    *[jax.ShapeDtypeStruct((rows, 1), jnp.int32)] * n_counts,
  )

  def call(interpret, *args):
    layout = (tile, block, lanes, apply)
    body = functools.partial(
      _kernel, codecs, hyper, names, layout, telemetry, not interpret
    )
    out = pl.pallas_call(
      body,
      out_shape=out_shape,
      grid=(pl.cdiv(rows, tile),),
      in_specs=[
        pl.BlockSpec(consts.shape, lambda i: (0,)),
        pl.BlockSpec(seeds.shape, lambda i: (0,)),
        spec(block),
        spec(width["mu"]),
        spec(1),
        spec(width["nu"]),
        spec(1),
        *[spec(block)] * len(weights),
        *whole,
      ],
      out_specs=[
        spec(block),
        spec(width["mu"]),
        spec(1),
        spec(width["nu"]),
        spec(1),
        *[spec(1)] * n_counts,
      ],
      interpret=interpret,
      # Triton: elementwise arithmetic, row reductions and reads of a
      # table by index on tiles of any power-of-two shape (Mosaic GPU
      # wants warpgroup-sized copies).
      compiler_params=None if interpret else triton.CompilerParams(),
      name="stored_adam" if apply is None else "stored_adamw_writeback",
    )(*args)
    # The rows' counts summed (int32: in any order, the same count).
    return (*out[:5], *(jnp.sum(c, dtype=jnp.int32) for c in out[5:]))

  def xla(*_):
    out = _reference_step(
      codecs,
      hyper,
      corrections,
      seeds,
      g,
      m,
      ms,
      v,
      vs,
      telemetry=telemetry,
    )
    if apply is not None:
      out = _reference_apply(apply, out, seeds, w, step_size)
    widths = (block, width["mu"], 1, width["nu"], 1)
    return (
      *(flat(a, w) for a, w in zip(out[:5], widths, strict=True)),
      *out[5:],
    )

  u, m2, ms2, v2, vs2, *counts = jax.lax.platform_dependent(
    consts,
    seeds,
    flat(jnp.asarray(g, jnp.float32), block),
    flat(m, width["mu"]),
    flat(ms, 1),
    flat(v, width["nu"]),
    flat(vs, 1),
    *weights,
    *arrays,
    cuda=functools.partial(call, False),
    default=functools.partial(call, True) if interpret else xla,
  )
  return (
    jnp.reshape(u, shape),
    jnp.reshape(m2, jnp.shape(m)),
    jnp.reshape(ms2, jnp.shape(ms)),
    jnp.reshape(v2, jnp.shape(v)),
    jnp.reshape(vs2, jnp.shape(vs)),
    *counts,
  )


# Elements a program takes: a tile of `_ELEMENTS // block` rows (at
# most), 256 blocks of 32 or 32 of 256.
_ELEMENTS = 8192


def _tile(rows: int, block: int) -> int:
  """Rows a program takes: the largest power of two at most `rows` and
  `_ELEMENTS // block` (the last tile may hang over the leaf's end:
  Pallas masks what it reads and writes there, and each row is a block
  of its own)."""
  most = max(1, _ELEMENTS // block)
  return min(most, 1 << (rows.bit_length() - 1))


def _padded(tables: dict) -> dict:
  """A map's tables (`CodeMap.tables`) padded to a power-of-two length,
  as a kernel's blocks must be (with what no index reaches: the last
  entry repeated)."""
  out = {}
  for name, a in tables.items():
    n = 1 << (len(a) - 1).bit_length()
    out[name] = jnp.asarray(np.concatenate([a, np.repeat(a[-1:], n - len(a))]))
  return out


# Divisors the kernel reads at run time: a division by a constant XLA
# (and a compiler after it) may turn into a product with its rounded
# reciprocal, which is not the IEEE quotient the tables hold.
_CONSTANTS = np.array([127.0, 255.0, 2.0, 1.0, 0.0, 0.0], np.float32)


def _lanes(block: int, split: bool) -> tuple:
  """How a tile's rows are read: whole, or (`split`) as their even and
  odd entries apart, each a strided index into a ref."""
  if not split:
    return ((slice(None), slice(None)),)
  return tuple((slice(None), pl.ds(k, block // 2, stride=2)) for k in (0, 1))


def _kernel(codecs, hyper, names, layout, telemetry, ptx, *refs):
  """The kernel's body; `ptx`: traced for Triton, so divisions and roots
  are PTX's correctly rounded ones (`lowprec.grids._ieee`), as XLA's
  are."""
  with _ieee.ptx(ptx):
    _body(codecs, hyper, names, layout, telemetry, *refs)


def _body(codecs, hyper, names, layout, telemetry, c_ref, s_ref, *refs):
  g_ref, m_ref, ms_ref, v_ref, vs_ref, *refs = refs
  tile, block, lanes, apply = layout
  if apply is not None:
    w_ref, *refs = refs
  tables = {}
  for moment in ("mu", "nu"):
    tables[moment] = dict(zip(names[moment], refs, strict=False))
    refs = refs[len(names[moment]) :]
  u_ref, m_out, ms_out, v_out, vs_out, *count_refs = refs
  m_codes = _codes_in(codecs["mu"], m_ref, lanes)
  v_codes = _codes_in(codecs["nu"], v_ref, lanes)
  ms, vs = ms_ref[...], vs_ref[...]
  indices = None
  random_apply = apply is not None and apply.leaf.rounding != "nearest"
  if any(c.random for c in codecs.values()) or random_apply:
    indices = _indices(tile, block, len(lanes), m_codes[0].shape)
  mus, nus, divs, olds, applied = [], [], [], [], None
  for k, (lane, m_code, v_code) in enumerate(
    zip(lanes, m_codes, v_codes, strict=True)
  ):
    # The scalars the kernel divides by, spread to every element by
    # adding a zero made of the codes (finite, so the sum is exact): a
    # division by a broadcast scalar XLA compiles as a product with the
    # rounded reciprocal, which is not the IEEE quotient that the tables
    # and the XLA path's divisions hold.
    zero = _bits_of(m_code).astype(jnp.float32) * np.float32(0)

    def spread(i, zero=zero):
      return c_ref[i] + zero

    divisors = {"companded8": spread(2), "sqrt8": spread(3), "two": spread(4)}
    mu0 = _read(codecs["mu"], m_code, ms, divisors, tables["mu"])
    nu0 = _read(codecs["nu"], v_code, vs, divisors, tables["nu"])
    mu, nu, u = _moments(
      hyper, (spread(0), spread(1)), g_ref[lane], mu0, nu0, True
    )
    if apply is not None:
      u, applied = _apply_lane(
        apply, u, w_ref[lane], c_ref[8], s_ref, indices, k, applied
      )
    u_ref[lane] = u
    mus.append(mu)
    nus.append(nu)
    divs.append(divisors)
    olds.append((mu0, nu0))
  for i, (moment, xs, out, s_out) in enumerate(
    (("mu", mus, m_out, ms_out), ("nu", nus, v_out, vs_out))
  ):
    codec = codecs[moment]
    bits = [None] * len(lanes)
    if codec.random:
      k0, k1 = s_ref[2 * i], s_ref[2 * i + 1]
      bits = [rng_lib.hash_at(index, k0, k1) for index in indices]
    lanes_in = [
      _Lane(x, old[i], b, d)
      for x, old, b, d in zip(xs, olds, bits, divs, strict=True)
    ]
    codes, s_out[...], read = _write(codec, lanes_in, tables[moment], telemetry)
    _codes_out(codec, out, lanes, codes)
    if telemetry:
      old_codes = m_codes if moment == "mu" else v_codes
      fields = _FIELDS
      refs_i = count_refs[i * len(fields) : (i + 1) * len(fields)]
      for ref, c in zip(
        refs_i,
        _row_counts(xs, [o[i] for o in olds], read, codes, old_codes),
        strict=True,
      ):
        ref[...] = c
  if applied is not None:  # the write-back's counts, after the moments'
    for ref, c in zip(count_refs[-len(applied) :], applied, strict=True):
      ref[...] = c


def _apply_lane(apply, u, w, step_size, s_ref, indices, k, totals):
  """The write-back's deltas of one lane of weights `w` under the
  direction `u`, and (its telemetry) each row's counts added to
  `totals`."""
  bits = None
  if apply.leaf.rounding != "nearest":
    bits = rng_lib.hash_at(indices[k], s_ref[4], s_ref[5])
  u = _decayed(apply, u, w, step_size)
  delta, masks, _ = apply.leaf.elements(
    w.astype(jnp.float32), u, apply.fmt, bits
  )
  return delta, (counting.row_counts(masks, totals) if masks else None)


class _Lane(NamedTuple):
  """What `_write` encodes of one lane of a tile: the new moment `x`,
  the value its old code read back as (dead zone), its random bits
  (None: nearest) and the lane's spread divisors (`_read`)."""

  x: jax.Array
  old: jax.Array
  bits: jax.Array | None
  divisors: dict


def _indices(tile, block, n_lanes, shape) -> list:
  """Each lane's global element indices in its leaf (uint32, row-major,
  as `rng_lib.global_index` numbers them, for `rng_lib.hash_at`): this
  program's rows are `tile` rows from `program_id * tile`, each a block;
  a split row's lanes are its even and odd entries."""
  row0 = pl.program_id(0).astype(jnp.uint32) * np.uint32(tile)
  r = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) + row0
  c = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
  base = r * np.uint32(block)
  if n_lanes == 1:
    return [base + c]
  return [base + c * np.uint32(2) + np.uint32(k) for k in range(n_lanes)]


def _codes_in(codec, ref, lanes) -> list:
  """A tile's codes by lane: a packed byte's low nibble is the even
  entry, its high one the odd (`codec_lib.pack`)."""
  if not codec.packed:
    return [ref[lane] for lane in lanes]
  b = ref[...]
  return [b & np.uint8(0xF), b >> np.uint8(4)]


def _codes_out(codec, ref, lanes, codes) -> None:
  if not codec.packed:
    for lane, code in zip(lanes, codes, strict=True):
      ref[lane] = code
    return
  lo, hi = (c.astype(jnp.uint8) & np.uint8(0xF) for c in codes)
  ref[...] = lo | (hi << np.uint8(4))


def _bits_of(code):
  """Integer codes as they are, float8 codes as their bits (finite)."""
  if jnp.issubdtype(code.dtype, jnp.integer):
    return code
  return jax.lax.bitcast_convert_type(code, jnp.uint8)


def _read(codec, code, scale, divisors, tables):
  """`decode`: float32 values of codes under their block's scale (rows,
  1). A table map reads its table by index; `companded8` and `sqrt8`
  compute their table entry as their table was computed (IEEE divisions
  by the `divisors`, spread to every element), then times the scale,
  through `decode`'s select."""
  m = codec.fmt
  per = scale.astype(jnp.float32)
  if not codec.mapped:
    return codec_lib._kept(code.astype(jnp.float32) * per)
  if m.name not in ("companded8", "sqrt8"):
    return codec_lib._kept(m.value(m.index_of(code), per, tables))
  z = _ieee.div(code.astype(jnp.float32), divisors[m.name])
  if m.name == "companded8":
    # Through a select: XLA turns `(c / 127) / d` into `c / (127 d)`.
    z = codec_lib._kept(z)
    z = _ieee.div(z, divisors["two"] - jnp.abs(z))
  v = z * per
  if m.name == "sqrt8":
    v = v * v
  return codec_lib._kept(v)


def _row_max(xs):
  """The largest entry of each row over the lanes `xs`, at least 0."""
  each = [jnp.max(x, axis=-1, keepdims=True, initial=0.0) for x in xs]
  return functools.reduce(jnp.maximum, each)


def _write(codec, lanes, tables, telemetry=False):
  """`encode(codec, x, old, bits)`'s codes (by lane) and scales for rows
  of one block each, given as `_Lane`s, and each lane's `(value read
  back, overflow flag)` (`Encoded.value`, `.over`; a map's values only
  where it rounds stochastically or `telemetry` counts them, else
  None)."""
  m = codec.fmt
  xs = [lane.x for lane in lanes]
  if not codec.mapped:
    amax = _row_max([jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0) for x in xs])
    pow2 = codec.scale_rule == "pow2"
    scales = (codec_lib._pow2_of if pow2 else codec_lib._scales_of)(codec)
    scales = scales(amax, None)
    per = scales.astype(jnp.float32)
    codes, read = [], []
    for lane in lanes:
      y = codec_lib._quotient(codec, lane.x, per)
      q, over, v = codec_lib.rounded(codec, lane.x, y, per, lane.old, lane.bits)
      codes.append(q.astype(codec.dtype()))
      read.append((v, over))
    return codes, scales, read
  pre = None if m.signed else m.pre
  amax = _row_max(
    [jnp.where(jnp.isfinite(x), x if pre else jnp.abs(x), 0.0) for x in xs]
  )
  if pre is not None:
    amax = jnp.abs(pre(amax))
  bad = _row_max([jnp.isnan(x).astype(jnp.float32) for x in xs]) > 0
  scales = codec_lib._scales_of(codec)(amax, bad)
  per = scales.astype(jnp.float32)
  lo = -1.0 if m.signed else 0.0
  codes, read = [], []
  for lane in lanes:
    x = lane.x
    raw = jnp.where(per > 0, codec_lib._divide(m.pre(x), per), 0.0)
    index = m.nearest_index(jnp.clip(raw, lo, 1.0), tables or None)

    def value(i, lane=lane):
      return _read(codec, m.code_of(i), scales, lane.divisors, tables)

    v = value(index) if codec.random or telemetry else None
    index, v = codec_lib.map_rounded(
      codec, x, index, v, value, lane.old, lane.bits
    )
    codes.append(m.code_of(index).astype(codec.dtype()))
    over = (jnp.abs(raw) > 1) | ((x < 0) if not m.signed else False)
    read.append((v, over & ~jnp.isnan(per)))
  return codes, scales, read


def _row_counts(xs, olds, read, codes, old_codes) -> list:
  """Each row's `store_state` counts (`stored_state._FIELDS`, int32
  (rows, 1)) over the lanes: `xs` the new float32 values, `olds` the
  old ones read back, `read` each lane's new values read back and
  overflow flags, `codes` and `old_codes` the codes."""
  totals = None
  for x, old, (v, over), code, code_old in zip(
    xs, olds, read, codes, old_codes, strict=True
  ):
    masks = stored_lib._state_masks(x, old, v, over, code, code_old)
    totals = counting.row_counts(masks, totals)
  return totals

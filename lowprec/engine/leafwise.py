"""The loop over a model's weights that every write-back runs.

A write-back's `init` and `update` walk the parameters the same way,
whatever it keeps beside them: find each parameter's format (and refuse
what no write-back can take), check the params are on their grids, pass
None updates through (Equinox's for leaves it does not differentiate),
check each proposal, split the key once per step and fold it per
parameter path, and collect each parameter's delta and what the recipe
keeps. `weights` and `step` are that loop; a recipe gives the one-tensor
step, `(path, w, u, fmt, bits) -> (delta, kept)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.engine import stacked
from lowprec.engine.codec import Codec, encode, land, tally
from lowprec.engine.weights import (
  Float8ParamsWarning,
  check_on_grid,
  check_shape,
  check_storage,
  leaf_format,
  path_name,
)
from lowprec.grids import rng as rng_lib
from lowprec.grids import scaled
from lowprec.grids.formats import Format, check_writeback_format

# (key path, w, u float32 arrays, fmt, bits or None) -> (delta, kept)
LeafStep = Callable[[str, Any, Any, Any, Any], tuple[Any, Any]]


def weight_format(lookup, path, w) -> Format | scaled.ScaledFormat | None:
  """The format of the parameter at `path`, checked against its storage;
  None for a leaf that is not an array or that the spec leaves alone."""
  fmt = leaf_format(lookup, path, w)
  if fmt is None:
    return None
  name = path_name(path)
  check_storage(name, w.dtype, fmt)
  if isinstance(fmt, scaled.ScaledFormat):
    check_writeback_format(fmt, f"parameter {name!r}")
    return fmt
  if not fmt.is_float and not float(np.log2(fmt.scale)).is_integer():
    # float32(k * s) - float32(j * s) is not float32-exact for such s, so
    # no float32 delta lands on most of the grid.
    pow2 = 2.0 ** round(float(np.log2(fmt.scale)))
    raise ValueError(
      f"parameter {name!r}: write-back onto {fmt} needs a power-of-two "
      f"scale to land exactly in float32, got {fmt.scale}; use e.g. "
      f"get_format({fmt.name!r}, scale={pow2})"
    )
  return fmt


def weights(lookup, params, spec) -> dict[str, tuple[Any, Any, Any]]:
  """`{name: (key path, fmt, param)}` of the parameters that have a
  format, in tree order; concrete params are checked on their grids
  (raises if one is off)."""
  out = {}
  for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
    f = weight_format(lookup, path, w)
    if f is not None:
      out[path_name(path)] = (path, f, w)
  _warn_narrow(out)
  if _concrete(params):
    # Concrete params may still meet init inside a trace (closed over
    # under jit or vmap): evaluate the check now rather than stage it.
    with jax.ensure_compile_time_eval():
      check_on_grid(params, spec)
  return out


def _warn_narrow(weights: dict) -> None:
  """Warns, once per `init`, where weights are stored in a one-byte float
  dtype: the deltas are float32, which `optax.apply_updates` cannot add
  to them (JAX refuses to promote 8-bit floats), and its error does not
  name the fix."""
  narrow = [
    (n, np.dtype(w.dtype).name)
    for n, (_, _, w) in weights.items()
    if jnp.issubdtype(w.dtype, jnp.floating) and np.dtype(w.dtype).itemsize == 1
  ]
  if not narrow:
    return
  (name, dtype), more = narrow[0], len(narrow) - 1
  others = f" and {more} more" if more else ""
  warnings.warn(
    f"parameter {name!r}{others} stored as {dtype}: land the write-back's "
    "float32 deltas with lowprec.apply_updates(params, updates), which "
    "keeps the dtype; optax.apply_updates fails on them (JAX does not add "
    "float8 and float32 implicitly: a TypePromotionError)",
    Float8ParamsWarning,
    stacklevel=4,
  )


def step(
  caller: str,
  lookup,
  updates,
  params,
  key_state: tuple | None,
  leaf: LeafStep,
  kernel=None,
  *,
  layers: bool = False,
):
  """One write-back over the tree: `(deltas, new key words, {path:
  kept})`. `key_state` is `(key words, impl)` for a random rounding (None
  for nearest); each parameter draws 32 bits per element from
  `fold_in(split(key)[1], leaf_seed(path))`. `kernel(leaf, fmt, w, u32,
  key)`, where given, steps the leaves it takes (`(delta, kept)`, the
  same as `leaf`'s) and returns None for the others.

  With `layers`, a leaf holding stacked layers (`h_0:12/...`,
  `lowprec.engine.stacked`) is stepped as its layers one by one, under
  `jax.vmap`: each layer's bits from its own path's key, and what `leaf`
  keeps with the layers on its first axis. The kernel does not take
  such a leaf. Without `layers` (a caller whose state keeps one count
  per leaf), such a leaf is refused."""
  if params is None:
    raise ValueError(
      f"{caller} rounds w + u and needs the current params: call "
      "opt.update(updates, state, params)"
    )
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    updates, is_leaf=lambda x: x is None
  )
  ws = treedef.flatten_up_to(params)
  todo = []
  for (path, u), w in zip(flat, ws, strict=True):
    f = None if u is None else weight_format(lookup, path, w)
    todo.append((path, u, w, f))
  stacks = {
    path_name(p): stacked.layer_names(path_name(p))
    for p, _, _, f in todo
    if f is not None
  }
  stacks = {n: layer for n, layer in stacks.items() if layer is not None}
  if stacks and not layers:
    raise ValueError(
      f"{caller}: parameter {next(iter(stacks))!r} holds stacked layers, "
      f"which {caller} does not step one by one; store its layers apart "
      "(lowprec.engine.stacked.unstack)"
    )
  new_key = keys = None
  if key_state is not None:
    new_key, step_key = rng_lib.next_step(*key_state)
    keys = _keys(
      step_key, [path_name(p) for p, _, _, f in todo if f is not None], stacks
    )
  rows, statics, names = [], [], []
  for path, u, w, f in todo:
    if f is None:
      continue
    name = path_name(path)
    check_shape(caller, name, w, u)
    _check_proposal(name, u)
    u32 = jnp.asarray(u).astype(jnp.float32)
    rows.append((jnp.asarray(w), u32, None if keys is None else keys[name]))
    statics.append((path, f))
    names.append(name)

  def plain(path, f, w, u32, key):
    bits = None if key is None else rng_lib.random_bits(key, jnp.shape(w))
    return leaf(path, w.astype(jnp.float32), u32, f, bits)

  def one(static, w, u32, key):
    path, f = static
    if path_name(path) in stacks:  # its layers, one by one
      return jax.vmap(lambda *a: plain(path, f, *a))(w, u32, key)
    if kernel is not None:
      out = kernel(leaf, f, w, u32, key)
      if out is not None:
        return out
    return plain(path, f, w, u32, key)

  # Leaf by leaf, not stacked: stacking same-shaped leaves (`grouped`)
  # builds a deep model's step a few seconds sooner but copies every
  # weight and proposal in and every delta out, which made the 20M
  # write-back step 3-4x slower (docs/scaling.md#compile-time-measured).
  out = [one(st, *row) for st, row in zip(statics, rows, strict=True)]
  done = dict(zip(names, out, strict=True))
  deltas = [
    u if f is None else done[path_name(path)][0] for path, u, _, f in todo
  ]
  kept = {n: done[n][1] for n in names}
  return jax.tree_util.tree_unflatten(treedef, deltas), new_key, kept


def _keys(step_key, names, stacks) -> dict:
  """`{name: key words}`, for a stacked leaf its layers' words stacked:
  each layer's key is the one its own path gets stored apart."""
  flat = [layer for n in names for layer in stacks.get(n, [n])]
  words = rng_lib.leaf_keys(step_key, flat)
  return {
    n: jnp.stack([words[x] for x in stacks[n]]) if n in stacks else words[n]
    for n in names
  }


def same_shapes(rows, statics=None) -> list[list[int]]:
  """The indices of `rows` (tuples of arrays or None) in groups whose
  entries agree in shape and dtype, and in `statics[i]` where given, in
  order of first appearance. A GPT's layers give one group per kind of
  layer leaf, however deep the model."""
  found: dict = {}
  for i, row in enumerate(rows):
    sig = tuple(
      None if a is None else (jnp.shape(a), jnp.result_type(a)) for a in row
    )
    static = None if statics is None else statics[i]
    found.setdefault((sig, static), []).append(i)
  return list(found.values())


def stack(rows, group: list[int]) -> list:
  """Each entry of the group's rows stacked on a new first axis (None
  stays None)."""
  first = rows[group[0]]
  return [
    None if first[k] is None else jnp.stack([rows[i][k] for i in group])
    for k in range(len(first))
  ]


def grouped(fn, rows, statics=None, *, stacked: bool = False):
  """`[fn(statics[i], *rows[i]) for each i]`, with `fn` traced once per
  group of `same_shapes` rows: the group's arrays are stacked and `fn`
  runs under `jax.vmap`. The program then holds one copy of `fn` per
  kind of leaf rather than one per leaf, so its compile time does not
  grow with depth. `fn` must treat each row alone (elementwise work and
  reductions within the row). Its elementwise results and integer counts
  are then the per-row calls' bit for bit; a float reduction may round
  otherwise, since XLA orders a batched reduction its own way. A group of
  one is called as it is.

  With `stacked`, the results come back as one pytree of arrays stacked
  in row order (`fn`'s outputs must then agree in shape across groups):
  the groups' results are concatenated and put in order by one gather,
  where the list would slice every row out, a program of its own per row.
  """
  statics = [None] * len(rows) if statics is None else list(statics)
  out: list = [None] * len(rows)
  parts, order = [], []
  for group in same_shapes(rows, statics):
    static = statics[group[0]]
    if len(group) == 1:
      res = fn(static, *rows[group[0]])
      res = jax.tree.map(lambda x: x[None], res) if stacked else res
    else:
      args = stack(rows, group)
      axes = [None if a is None else 0 for a in args]
      res = jax.vmap(lambda *a, s=static: fn(s, *a), in_axes=axes)(*args)
    if stacked:
      parts.append(res)
      order.extend(group)
    elif len(group) == 1:
      out[group[0]] = res
    else:
      for j, i in enumerate(group):
        out[i] = jax.tree.map(lambda x, j=j: x[j], res)
  if not stacked:
    return out
  if not parts:
    raise ValueError("grouped(..., stacked=True) needs at least one row")
  where = np.argsort(np.asarray(order))  # row i is entry where[i]
  return jax.tree.map(lambda *p: jnp.concatenate(p)[where], *parts)


def grouped_apart(fn, rows, statics, apart):
  """`grouped(fn, rows, statics, stacked=True)` where some rows hold
  stacked layers (`lowprec.engine.stacked`), with the results stacked in
  the order of the leaves stored apart. `apart[i]` is row i's index
  among those leaves (`stacked.apart_index`) or, for a row of stacked
  layers (its arrays with the layers on their first axis), its layers'
  indices: `fn` then runs on each layer alone, under `vmap`. Rows of one
  leaf in apart order give `grouped`'s result as it is."""
  statics = [None] * len(rows) if statics is None else list(statics)
  lone = [i for i, a in enumerate(apart) if not isinstance(a, tuple)]
  if [apart[i] for i in lone] == list(range(len(rows))):
    return grouped(fn, rows, statics, stacked=True)
  parts, order = [], []
  if lone:
    lone_rows = [rows[i] for i in lone]
    parts.append(
      grouped(fn, lone_rows, [statics[i] for i in lone], stacked=True)
    )
    order += [apart[i] for i in lone]
  for i, a in enumerate(apart):
    if isinstance(a, tuple):
      parts.append(jax.vmap(lambda *r, s=statics[i]: fn(s, *r))(*rows[i]))
      order += list(a)
  where = np.argsort(np.asarray(order))  # leaf k is entry where[k]
  return jax.tree.map(lambda *p: jnp.concatenate(p)[where], *parts)


def _check_proposal(name: str, u) -> None:
  dtype = jnp.result_type(u)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    raise ValueError(
      f"the proposal for parameter {name!r} arrives as {dtype.name}: the "
      "transforms before writeback computed in the params' low-precision "
      "dtype, so their state (e.g. Adam's moments) is that narrow too and "
      "under- or overflows. Run them in float32: optax.chain("
      "lowprec.in_float32(optax.adam(...)), lowprec.writeback(...))"
    )


def _concrete(tree) -> bool:
  abstract = (jax.core.Tracer, jax.ShapeDtypeStruct)
  return not any(isinstance(x, abstract) for x in jax.tree.leaves(tree))


# The counts of `Plain`, in its masks' order.
PLAIN_COUNTS = (
  "proposals",
  "moved",
  "saturated",
  "unreachable",
  "nonfinite",
  "offgrid",
)


class Plain(NamedTuple):
  """The plain write-back of one tensor, `w' = Q(w + u)`: a `LeafStep`
  giving the delta that lands `w'` and, with telemetry, the counts
  `(proposals, moved, saturated, unreachable, nonfinite, offgrid)` (then,
  on a scaled format, its block count and the blocks whose scale
  changed). `offgrid` counts the finite weights `w` that are off their
  grid: the write-back's previous deltas put every weight on it, so
  they show that something changed the params after them (a transform
  chained after the write-back). `writeback` is this step over the
  tree; `eco` adds a fold."""

  rounding: str
  overflow: str
  nonfinite: str
  telemetry: bool
  scales: str

  def __call__(self, path, w, u, fmt, bits):
    """Delta and, with telemetry, the counts of one tensor (then, for a
    scaled format, its block count and the blocks whose scale changed)."""
    del path
    delta, masks, enc = self.elements(w, u, fmt, bits)
    if not self.telemetry:
      return delta, ()
    counts = tally(*masks)
    if not isinstance(fmt, scaled.ScaledFormat):
      return delta, counts
    new = enc.block_scales.block
    if self.scales == "keep":  # rounded with w's scales, by construction
      return delta, (*counts, jnp.int32(new.size), jnp.int32(0))
    old = scaled.compute_scales(w, fmt).block
    code = lambda s: jax.lax.bitcast_convert_type(s, jnp.uint8)  # noqa: E731
    changed = jnp.sum(code(old) != code(new), dtype=jnp.int32)
    return delta, (*counts, jnp.int32(old.size), changed)

  def elements(self, w, u, fmt, bits):
    """`(delta, masks, encoded)` of float32 `w`, `u`, elementwise: the
    masks (with telemetry; else ()) are what `__call__` counts, in its
    order. A kernel calls this on its tile and counts each row."""
    on_scaled = isinstance(fmt, scaled.ScaledFormat)
    # Values only (no code in the format's dtype: a kernel converts no
    # float8).
    codec = Codec(
      fmt,
      self.rounding,
      overflow=self.overflow,
      carrier="float32",
      keep_scales=self.scales == "keep",
    )
    enc = encode(codec, w + u, w, bits)
    q = enc.value
    finite = jnp.isfinite(u) & ~jnp.isnan(w)
    proposed = (u != 0) & finite
    written = proposed if self.nonfinite == "keep" else (u != 0) | ~finite
    if on_scaled:
      # New scales move the grid under every coordinate of a block: those
      # with u == 0 are rounded onto it too.
      written = finite if self.nonfinite == "keep" else jnp.ones_like(finite)
    # Keeping w itself (not an equal value) preserves the sign of zero.
    q = jnp.where(written & (q != w), q, w)
    delta, lands = land(w, q, fmt)
    if not self.telemetry:
      return delta, (), enc
    # The delta is -0 exactly where the weight stays, nonzero where it moves.
    moved = proposed & (delta != 0)
    offgrid = jnp.isfinite(w) & ~_on_grid(w, fmt)
    masks = (proposed, moved, enc.over & proposed, ~lands, ~finite, offgrid)
    return delta, masks, enc


def _on_grid(w, fmt):
  """Whether each value of `w` is on `fmt`'s grid (a scaled format's: of
  the block scales of `w` itself, which nearest rounding gives back)."""
  if isinstance(fmt, scaled.ScaledFormat):
    return scaled.fake_quantize(w, fmt) == w
  return fmt.is_on_grid(w)

"""Layers stored stacked: one array for each kind of leaf of a run of layers.

A deep model's layers (`h_0`, ..., `h_11`) hold the same leaves. Stored
apart, every per-leaf step of an optimizer is a program of its own per
layer, and a step's compile time grows with depth. Stored stacked (one
array per kind of leaf, the layers on a new first axis) the same step is
one program per kind of leaf, however deep the model.

The stacked subtree's key names its layers as a slice does: `h_0:12`
holds `h_0` to `h_11`, so the leaf `h_0:12/attn/kernel` is the leaves
`h_0/attn/kernel`, ..., `h_11/attn/kernel`, in that order on its first
axis. The engine treats such a leaf as those layers one by one: each
layer's format is looked up under its own path (they must agree), its
random bits come from its own path's key, and its counts are kept per
layer and reported under its own path. So a write-back gives the same
bits and the same telemetry whichever way the layers are stored.

`stack` and `unstack` convert any tree between the two forms: params,
and optimizer states, whose dict keys follow the params' (optax's
moments) or name them (`h_0:12/attn/kernel`, a write-back's counts).

Example:
  ```python
  groups = [("h", 0, 12)]
  stored = stacked.stack(params, groups)   # {"h_0:12": {...}, "wte": ...}
  params_again = stacked.unstack(stored)  # {"h_0": {...}, ..., "wte": ...}
  ```
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp

_STACKED = re.compile(r"^(.+)_(\d+):(\d+)$")
_LAYER = re.compile(r"^(.+)_(\d+)$")

# (prefix, start, stop): the layers `prefix_start` ... `prefix_{stop-1}`.
Group = tuple[str, int, int]


def stacked_key(prefix: str, start: int, stop: int) -> str:
  """The key of layers `prefix_start` to `prefix_{stop-1}` stacked."""
  return f"{prefix}_{start}:{stop}"


def key_of(names: Sequence[str]) -> str | None:
  """The stacked key of consecutive layers `names` (`["h_0", "h_1"]` ->
  `"h_0:2"`); None where they are not `prefix_i` for consecutive i."""
  found = [_LAYER.match(n) for n in names]
  if not names or any(m is None for m in found):
    return None
  prefix, start = found[0].group(1), int(found[0].group(2))
  expect = [f"{prefix}_{start + j}" for j in range(len(names))]
  if list(names) != expect:
    return None
  return stacked_key(prefix, start, start + len(names))


def _parse(component: str) -> Group | None:
  m = _STACKED.match(component)
  if m is None:
    return None
  prefix, start, stop = m.group(1), int(m.group(2)), int(m.group(3))
  if stop <= start:
    raise ValueError(
      f"stacked layers {component!r} name no layer: the stop must be past "
      "the start, as in h_0:12 for h_0 to h_11"
    )
  return prefix, start, stop


def _where(parts: Sequence[str]) -> tuple[int, Group] | None:
  """The index and group of the one stacked component of a name."""
  hits = [(i, g) for i, p in enumerate(parts) if (g := _parse(p)) is not None]
  if not hits:
    return None
  if len(hits) > 1:
    raise ValueError(
      f"{'/'.join(parts)!r} stacks layers twice ({len(hits)} components "
      "such as h_0:12); stack one run of layers per path"
    )
  return hits[0]


def layer_names(name: str) -> list[str] | None:
  """The names of the layers a stacked leaf holds, in order (`h_0:2/w` ->
  `["h_0/w", "h_1/w"]`); None for a leaf that holds one layer."""
  parts = name.split("/")
  found = _where(parts)
  if found is None:
    return None
  i, (prefix, start, stop) = found
  return [
    "/".join([*parts[:i], f"{prefix}_{j}", *parts[i + 1 :]])
    for j in range(start, stop)
  ]


def layer_paths(path) -> list[tuple] | None:
  """The key paths of the layers a stacked leaf at `path` holds (its
  stacked dict key replaced by each layer's); None for one layer."""
  path = tuple(path)
  keys = [getattr(k, "key", None) for k in path]
  parts = [k if isinstance(k, str) else "" for k in keys]
  found = _where(parts)
  if found is None:
    return None
  i, (prefix, start, stop) = found
  return [
    (*path[:i], jax.tree_util.DictKey(f"{prefix}_{j}"), *path[i + 1 :])
    for j in range(start, stop)
  ]


def refuse(caller: str, names) -> None:
  """Raises, naming the fix, where one of `names` holds stacked layers:
  for a transform that keeps one value per leaf (its keys, scales or
  counts), which would treat the layers as one."""
  for n in names:
    if layer_names(n) is not None:
      raise ValueError(
        f"{caller}: {n!r} holds stacked layers, which {caller} keeps as one "
        "leaf (one key, scale and count for all); store the layers apart "
        "(lowprec.engine.stacked.unstack)"
      )


def apart_index(names, apart_names) -> tuple[int | tuple[int, ...], ...]:
  """For each stored leaf of `names`, where it stands among
  `apart_names` (the same leaves stored apart, in their order): its
  index, or for a leaf of stacked layers its layers' indices (a tuple)."""
  where = {n: i for i, n in enumerate(apart_names)}
  return tuple(
    where[n] if (ls := layer_names(n)) is None else tuple(where[x] for x in ls)
    for n in names
  )


def count_shape(name: str) -> tuple[int, ...]:
  """The shape of one count of the leaf `name`: `(layers,)` stacked,
  `()` otherwise."""
  names = layer_names(name)
  return () if names is None else (len(names),)


def expand(per_name: dict) -> dict:
  """`{name: value}` with each stacked name replaced by its layers'
  names, its value's first axis split among them, sorted by name (as a
  state's dicts are after a jitted step); unchanged when nothing is
  stacked."""
  if not any(layer_names(n) for n in per_name):
    return per_name
  out = {}
  for n, v in per_name.items():
    names = layer_names(n)
    if names is None:
      out[n] = v
      continue
    for j, layer in enumerate(names):
      out[layer] = jax.tree.map(lambda x, j=j: x[j], v)
  return dict(sorted(out.items()))


def _map_dicts(tree, on_dict):
  """`tree` with every dict replaced by `on_dict(dict)`, innermost first
  (its values already mapped); other pytree nodes rebuilt as they are."""
  if isinstance(tree, dict):
    return on_dict({k: _map_dicts(v, on_dict) for k, v in tree.items()})
  children, treedef = jax.tree_util.tree_flatten(
    tree, is_leaf=lambda x: x is not tree
  )
  if treedef.num_nodes == 1 and treedef.num_leaves == 1:
    return tree  # a leaf (or a node that flattens to itself)
  kids = [_map_dicts(c, on_dict) for c in children]
  return jax.tree_util.tree_unflatten(treedef, kids)


def unstack(tree):
  """The tree with every run of stacked layers stored apart: each dict
  key with a stacked component (`h_0:12`, or a name `h_0:12/attn/w`)
  becomes one key per layer (`h_0`, ..., or `h_0/attn/w`, ...), each
  holding its layer's slice of every array below it."""

  def apart(node: dict) -> dict:
    out = {}
    for k, v in node.items():
      names = layer_names(k) if isinstance(k, str) else None
      if names is None:
        out[k] = v
        continue
      for j, layer in enumerate(names):
        out[layer] = jax.tree.map(lambda x, j=j: x[j], v)
    return out

  return _map_dicts(tree, apart)


def _layer_of(key: str, groups: Sequence[Group]) -> tuple[str, int] | None:
  """`(stacked key, position)` of a layer's dict key (`h_3` or
  `h_3/attn/w`) in one of `groups`; None outside them."""
  parts = key.split("/")
  for i, part in enumerate(parts):
    m = _LAYER.match(part)
    if m is None:
      continue
    prefix, j = m.group(1), int(m.group(2))
    for p, start, stop in groups:
      if p == prefix and start <= j < stop:
        name = [*parts[:i], stacked_key(p, start, stop), *parts[i + 1 :]]
        return "/".join(name), j - start
  return None


def stack(tree, groups: Sequence[Group]):
  """`unstack`'s inverse: the layers of each group `(prefix, start,
  stop)` stacked on a new first axis under one key, wherever a dict of
  the tree holds them (as subtrees `h_3` or as names `h_3/attn/w`).

  Raises:
    ValueError: a dict holds some layers of a group and not others, or
      layers whose trees differ.
  """

  def together(node: dict) -> dict:
    out, runs = {}, {}
    for k, v in node.items():
      hit = _layer_of(k, groups) if isinstance(k, str) else None
      if hit is None:
        out[k] = v
      else:
        runs.setdefault(hit[0], {})[hit[1]] = v
    for key, run in runs.items():
      size = len(layer_names(key))
      if sorted(run) != list(range(size)):
        raise ValueError(
          f"cannot stack {key!r}: the tree holds {len(run)} of its "
          f"{size} layers"
        )
      layers = [run[j] for j in range(size)]
      try:
        out[key] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
      except ValueError as e:
        raise ValueError(
          f"cannot stack {key!r}: its layers' trees differ ({e})"
        ) from None
    return out

  return _map_dicts(tree, together)

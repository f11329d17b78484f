"""Reading telemetry out of (nested) optax states.

Transforms that count things (write-back erasures, reference-trace
predictions) keep their counters in their state as a node with two methods:
`arrays()`, a flat dict of arrays that can be computed inside `jit`, stacked
by `scan` and batched by `vmap`, and `report()`, the same as plain Python
numbers for logging. `telemetry` and `telemetry_arrays` find every such node
anywhere in an optax state: inside `optax.chain`, `inject_hyperparams`,
`MultiSteps`, `masked`, `multi_transform`, Flax NNX optimizer state and
user containers.

Keys are named by where a node sits: under a group of
`optax.multi_transform` (or `optax.partition`), a node's keys take the
group's label as a prefix, `<label>/<key>` (`matrices/erased_fraction`;
nested groups join their labels, outer first). Where two nodes still report
the same key (two write-backs chained outside any group), the later ones
get a positional `#1`, `#2`.

They also read the views of an optimizer state that have lost its types:
`nnx.state(opt)`, `.to_pure_dict()` of it, and a checkpoint restored
without a target (nested dicts and lists of arrays, with `{"value": x}`
where NNX boxed a leaf). A `lowprec.writeback` state, the state of a
compensated write-back (`lowprec.kahan_writeback` and its siblings) and the
counts of a `lowprec.store_state` are recognized there by their fields and
rebuilt. The reference trace, the compensated trace and the decay
counter keep their target and tensor names in the state's static
structure, which such views drop: there they are refused with the fix,
never skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from flax import nnx

from lowprec.grids import rng as rng_lib
from lowprec.optim.compensated import CompensatedState
from lowprec.optim.eco import EcoState
from lowprec.optim.split import SplitState
from lowprec.optim.stored_state import StateCounts
from lowprec.optim.writeback import WritebackState


@runtime_checkable
class Reports(Protocol):
  """A state node that reports telemetry as `{name: value}`."""

  def arrays(self) -> dict[str, Any]: ...

  def report(self) -> dict[str, Any]: ...


def _is_reporter(x) -> bool:
  return isinstance(x, Reports) and not isinstance(x, type)


def _merge(labelled) -> dict[str, Any]:
  """`(prefix, {key: value})` pairs as one dict of `prefix + key`.

  Only keys that still collide get a suffix: a write-back and a reference
  trace in one chain keep their own plain names; a second write-back
  outside `multi_transform` groups gets `#1`.
  """
  out: dict[str, Any] = {}
  for prefix, d in labelled:
    for k, v in d.items():
      name, n = prefix + k, 0
      while name in out:
        n += 1
        name = f"{prefix}{k}#{n}"
      out[name] = v
  return out


# The field of `optax.multi_transform`'s state (`PartitionState`, formerly
# `MultiTransformState`) that maps each group's label to its state; views
# without types keep it as a dict key.
_GROUPS = "inner_states"


def _key_name(key):
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return key


def _prefix(path: tuple) -> str:
  """`"<label>/"` for a node under a `multi_transform` group (outer groups
  first), `""` outside any."""
  names = [str(_key_name(k)) for k in path]
  return "".join(
    f"{label}/"
    for field, label in zip(names, names[1:], strict=False)
    if field == _GROUPS
  )


# States recognized in a plain view by their fields: (fields every view
# keeps, transform). The write-back's and the state storage's telemetry
# is all in their arrays.
_REBUILT = {
  WritebackState: (
    {"count", "proposals", "moved", "saturated", "unreachable", "nonfinite"},
    "lowprec.writeback",
  ),
  StateCounts: (
    {"count", "changed", "erased", "flushed", "saturated", "nonfinite"},
    "lowprec.store_state",
  ),
  CompensatedState: (
    set(CompensatedState._fields) - {"key"},
    "the compensated write-backs",
  ),
  # A view has no `recipe`: a static record, not an array.
  SplitState: (set(SplitState._fields) - {"recipe"}, "lowprec.split_writeback"),
  # `fold` is missing from a view of a state saved before eco kept it.
  EcoState: (set(EcoState._fields) - {"key", "fold"}, "lowprec.eco"),
}
# States of the layers above (lowprec.freeze's traces) that a plain view
# cannot be rebuilt into, recognized by their fields to name the fix:
# class -> (fields every view keeps, transform). Filled by register_layout.
_NAMED_BY_LAYOUT: dict[type, tuple[set[str], str]] = {}


def register_layout(cls: type, fields: set[str], transform: str) -> None:
  """Names `transform` when a state of `cls` is met as plain arrays.

  A reporting state whose target and tensor names live in the optax
  state's structure cannot be read back from a dict view (what
  `nnx.state(...)` or a checkpoint restored without a target gives).
  `telemetry` recognizes such a view by `fields` (the fields every view
  keeps) and raises naming `transform` and the fix, rather than reading
  it as another state. `lowprec.freeze` registers its traces this way,
  so this module does not import the layer above it.
  """
  _NAMED_BY_LAYOUT[cls] = (set(fields), transform)


def _reporters(opt_state, caller: str) -> list[tuple[str, Reports]]:
  """Every reporting node in `opt_state`, in tree order, with the prefix
  of its keys (`_prefix`)."""
  # Flax NNX keeps optimizer state in Variables (`OptArray`): read through
  # them, so `opt.opt_state` of an `nnx.Optimizer` can be passed as it is.
  found: list[tuple[str, Reports]] = []
  _collect(nnx.as_pure(opt_state), (), found)
  if not found:
    raise ValueError(_nothing_found(opt_state, caller))
  return found


def _collect(node, path: tuple, found: list) -> None:
  """Appends `(prefix, node)` for the reporting nodes under `node`."""
  if _is_reporter(node):
    found.append((_prefix(path), node))
    return
  if isinstance(node, Mapping):
    view = _from_view(node, path)
    if view is not None:
      found.append((_prefix(path), view))
      return
  children = jax.tree_util.tree_flatten_with_path(
    node, is_leaf=lambda x: x is not node
  )[0]
  if len(children) == 1 and not children[0][0]:
    return  # an array or other leaf
  if isinstance(node, Mapping):
    # A restored chain's positions are strings: "10" comes after "9".
    children.sort(key=lambda c: _natural(c[0][0]))
  for p, child in children:
    _collect(child, path + p, found)


def _natural(key) -> tuple:
  k = getattr(key, "key", key)
  if isinstance(k, int) or (isinstance(k, str) and k.isdigit()):
    return (0, int(k), "")
  return (1, 0, str(k))


def _unbox(x):
  # An NNX Variable restored without a target is a dict {"value": array}.
  while isinstance(x, Mapping) and set(x) == {"value"}:
    x = x["value"]
  return x


def _from_view(node: Mapping, path: tuple):
  """The reporting state a dict view holds, None if it holds none."""
  keys = {str(k) for k in node}
  for cls, (needed, _) in _REBUILT.items():
    if needed <= keys <= set(cls._fields):
      return _rebuild(cls, node)
  for cls, (needed, transform) in _NAMED_BY_LAYOUT.items():
    if needed <= keys <= set(cls._fields):
      raise ValueError(
        f"the state of {transform} at "
        f"{jax.tree_util.keystr(path, simple=True, separator='/')!r} is "
        "seen here as plain arrays: its target and tensor names live in "
        "the optax state's structure, which nnx.state(...), to_pure_dict() "
        "and a checkpoint restored without a target drop. Pass the "
        "optimizer state itself: the state tx.init returned, opt.opt_state "
        "of an NNX optimizer (after nnx.update(opt, restored)), or a "
        "checkpoint restored with that state as its target"
      )
  return None


def _rebuild(cls, node: Mapping):
  values = {str(k): v for k, v in node.items()}
  fields = {}
  for f in cls._fields:
    v = _unbox(values.get(f))
    if isinstance(v, Mapping):  # counts per parameter path
      v = {str(n): _unbox(c) for n, c in v.items()}
    fields[f] = v
  return cls(**fields)


def _nothing_found(opt_state, caller: str) -> str:
  kind = type(opt_state)
  return (
    f"lowprec.{caller} found no telemetry in the "
    f"{kind.__module__}.{kind.__qualname__} it was given: no state of "
    "lowprec.writeback (or its compensated siblings), lowprec.store_state, "
    "lowprec.freeze.reference_trace, lowprec.freeze.compensated_trace or "
    "lowprec.freeze.decay_erasure is in it. Pass the optimizer state "
    "that holds one: the state tx.init returned (and tx.update returns), "
    "opt.opt_state or nnx.state(opt) of an NNX optimizer, their "
    "to_pure_dict(), or a checkpoint of them restored with or without a "
    "target. A writeback or store_state built with telemetry=False is "
    "found only in the "
    "first two: a plain view keeps no counts to recognize it by"
  )


def telemetry(opt_state) -> dict[str, float | int]:
  """All telemetry in `opt_state` as plain Python numbers, ready to log.

  Keys are those of each reporting node. A node inside a group of
  `optax.multi_transform` gets the group's label as a prefix,
  `<label>/<key>`, nested labels outer first (the label is the group's key
  in the state's `inner_states`, so it holds in every view). When several
  nodes still report the same key (two write-backs chained outside any
  group), later ones get a `#1`, `#2` suffix.
  This reads values to the host: call it outside `jit`. A state batched by
  `vmap` gives a list per key, one entry per ensemble member.

  Args:
    opt_state: an optax state holding `lowprec.writeback` (or reference
      trace, decay counter) states, in any of the views in the module
      docstring.

  Returns:
    `{name: int or float}` (lists of them for a batched state); the one
      name among the values is `lowprec.eco`'s `fold`, "closed" or "jvp".

  Raises:
    ValueError: `opt_state` holds no such state, or holds a reference
      trace or decay counter in a view that has lost their names; the
      message names what was given and what to pass.

  Example:
    ```python
    opt = optax.chain(optax.adam(1e-3), lowprec.writeback("bfloat16"))
    state = opt.init(params)
    ...
    lowprec.telemetry(state)["erased_fraction"]

    mixed = optax.multi_transform(
        {"matrices": lowprec.writeback("bfloat16"),
         "gains": lowprec.writeback("float8_e4m3fn")},
        labels)  # a pytree (or function of params) of "matrices"/"gains"
    ...
    lowprec.telemetry(state)["gains/erased_fraction"]
    ```
  """
  reports = [(p, n.report()) for p, n in _reporters(opt_state, "telemetry")]
  return {k: _plain(v) for k, v in _merge(reports).items()}


def telemetry_arrays(opt_state) -> dict[str, jax.Array]:
  """All telemetry in `opt_state` as arrays: traceable inside jit and scan.

  The same keys as `telemetry`, with int32 counts and float32 fractions
  (NaN at a step without proposals), and eco's `fold` as its int32 code
  (0 "jvp", 1 "closed"). Return it from a `lax.scan` body to
  get per-step curves stacked along a leading axis, or from a `vmap`ped
  step to get one value per ensemble member.

  Example:
    ```python
    def step(carry, grads):
      params, state = carry
      updates, state = opt.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), lowprec.telemetry_arrays(state)
    _, curves = jax.lax.scan(step, (params, state), grads_per_step)
    curves["erased_fraction"]  # float32 [steps]
    ```

  Raises:
    ValueError: as `telemetry`.
  """
  nodes = _reporters(opt_state, "telemetry_arrays")
  return _merge((p, n.arrays()) for p, n in nodes)


def reseed(opt_state, key: jax.Array):
  """Gives every random write-back in `opt_state` a key derived from `key`.

  A transform's key is fixed when it is built, so `jax.vmap(opt.init)` over
  an ensemble gives every member the same random stream. Reseeding the
  state inside the vmap gives each member its own:

    keys = jax.random.split(jax.random.key(0), members)
    states = jax.vmap(lambda p, k: lowprec.reseed(opt.init(p), k))(
        params, keys)

  The i-th random node found in the state gets `fold_in(key, i)`. Nodes
  without a key (nearest rounding) are left alone.

  Args:
    opt_state: an optax state holding `lowprec.writeback` states.
    key: a JAX PRNG key (typed or raw).

  Returns:
    The state with new keys, same structure, shapes and dtypes.
  """
  if not (
    isinstance(key, jax.Array)
    and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  ):
    key = jax.random.wrap_key_data(rng_lib.key_words(key))
  counter = iter(range(1 << 30))

  def one(node):
    if _is_reporter(node) and getattr(node, "key", None) is not None:
      sub = jax.random.fold_in(key, next(counter))
      words = jax.random.key_data(sub).astype(node.key.dtype)
      if words.shape != node.key.shape:
        raise ValueError(
          f"reseed: the key has {words.shape[-1]} words but the state's "
          f"keys have {node.key.shape[-1]}; pass a key of the same PRNG "
          "implementation as the one given to writeback"
        )
      return node._replace(key=words)
    return node

  return jax.tree_util.tree_map(one, opt_state, is_leaf=_is_reporter)


def _plain(v):
  if isinstance(v, str):  # a name, such as eco's `fold`
    return v
  a = np.asarray(jax.device_get(v))
  if a.ndim:
    return a.tolist()
  if np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
    return int(a)
  return float(a)

"""Reading telemetry out of (nested) optax states.

Transforms that count things (write-back erasures, reference-trace
predictions) keep their counters in their state as a node with two methods:
`arrays()`, a flat dict of arrays that can be computed inside `jit`, stacked
by `scan` and batched by `vmap`, and `report()`, the same as plain Python
numbers for logging. `telemetry` and `telemetry_arrays` find every such node
anywhere in an optax state: inside `optax.chain`, `inject_hyperparams`,
`MultiSteps`, `masked`, Flax NNX optimizer state and user containers.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from flax import nnx

from lowprec import rng as rng_lib


@runtime_checkable
class Reports(Protocol):
  """A state node that reports telemetry as `{name: value}`."""

  def arrays(self) -> dict[str, Any]: ...

  def report(self) -> dict[str, Any]: ...


def _is_reporter(x) -> bool:
  return isinstance(x, Reports) and not isinstance(x, type)


def _merge(dicts) -> dict[str, Any]:
  # Only colliding keys get a suffix: a write-back and a reference trace in
  # one chain keep their own plain names; a second write-back gets `#1`.
  out: dict[str, Any] = {}
  for d in dicts:
    for k, v in d.items():
      name, n = k, 0
      while name in out:
        n += 1
        name = f"{k}#{n}"
      out[name] = v
  return out


def _reporters(opt_state) -> list[Reports]:
  # Flax NNX keeps optimizer state in Variables (`OptArray`): read through
  # them, so `opt.opt_state` of an `nnx.Optimizer` can be passed as it is.
  opt_state = nnx.as_pure(opt_state)
  nodes = jax.tree_util.tree_leaves(opt_state, is_leaf=_is_reporter)
  return [n for n in nodes if _is_reporter(n)]


def telemetry(opt_state) -> dict[str, float | int]:
  """All telemetry in `opt_state` as plain Python numbers, ready to log.

  Keys are those of each reporting node; when several nodes report the same
  key (two write-backs in one state), later ones get a `#1`, `#2` suffix.
  This reads values to the host: call it outside `jit`. A state batched by
  `vmap` gives a list per key, one entry per ensemble member.

  Example:
    >>> opt = optax.chain(optax.adam(1e-3), lowprec.writeback("bfloat16"))
    >>> state = opt.init(params)
    >>> ...
    >>> lowprec.telemetry(state)["erased_fraction"]
  """
  reports = [n.report() for n in _reporters(opt_state)]
  return {k: _plain(v) for k, v in _merge(reports).items()}


def telemetry_arrays(opt_state) -> dict[str, jax.Array]:
  """All telemetry in `opt_state` as arrays: traceable inside jit and scan.

  The same keys as `telemetry`, with int32 counts and float32 fractions
  (NaN at a step without proposals). Return it from a `lax.scan` body to
  get per-step curves stacked along a leading axis, or from a `vmap`ped
  step to get one value per ensemble member.

  Example:
    >>> def step(carry, grads):
    ...   params, state = carry
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    ...   return (params, state), lowprec.telemetry_arrays(state)
    >>> _, curves = jax.lax.scan(step, (params, state), grads_per_step)
    >>> curves["erased_fraction"]  # float32 [steps]
  """
  return _merge(n.arrays() for n in _reporters(opt_state))


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
  a = np.asarray(jax.device_get(v))
  if a.ndim:
    return a.tolist()
  if np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
    return int(a)
  return float(a)

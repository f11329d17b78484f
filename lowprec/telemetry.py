"""Reading telemetry out of (nested) optax states.

Transforms that count things (write-back erasures, reference-trace
predictions) keep their counters in their state as a node with a `report()`
method returning a flat dict of plain numbers. `telemetry` finds every such
node anywhere in an optax state: inside `optax.chain`, `inject_hyperparams`,
`MultiSteps`, `masked` and user containers.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np


@runtime_checkable
class Reports(Protocol):
  """A state node that reports telemetry as `{name: number}`."""

  def report(self) -> dict[str, Any]: ...


def _is_reporter(x) -> bool:
  return isinstance(x, Reports) and not isinstance(x, type)


def telemetry(opt_state) -> dict[str, float | int]:
  """All telemetry in `opt_state` as plain Python numbers, ready to log.

  Keys are those of each reporting node; when several nodes report the same
  key (two write-backs in one state), later ones get a `#1`, `#2` suffix.

  Example:
    >>> opt = optax.chain(optax.adam(1e-3), lowprec.writeback("bfloat16"))
    >>> state = opt.init(params)
    >>> ...
    >>> lowprec.telemetry(state)["erased_fraction"]
  """
  nodes = jax.tree_util.tree_leaves(opt_state, is_leaf=_is_reporter)
  out: dict[str, float | int] = {}
  for node in nodes:
    if not _is_reporter(node):
      continue
    for k, v in node.report().items():
      # Only colliding keys get a suffix: a write-back and a reference
      # trace in one chain keep their own plain names.
      name, n = k, 0
      while name in out:
        n += 1
        name = f"{k}#{n}"
      out[name] = _plain(v)
  return out


def _plain(v):
  a = np.asarray(jax.device_get(v))
  if a.ndim:
    return a.tolist()
  if np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
    return int(a)
  return float(a)

"""What a trace of a float32 run sees and reports.

`reference_trace` and `compensated_trace` watch the floating-point leaves
of the params (`float_paths`, `step_leaves`) and keep this step's counts
in their state. Each lays them out once, in a function `collect(state,
xp, ratio, value)`, as `{"pred/<target>/...": value}`, read two ways:
`host` (exact Python ints, float64 fractions, nested lists for a state
with leading ensemble axes) and `traced` (int32 counts, float32
fractions and sums: traceable inside jit, stacked by `scan`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.engine import counting, weights

# collect(state, xp, ratio, value) -> {key: value}: xp is numpy or
# jax.numpy, ratio(num, den) and value(x) convert what goes in the dict.
Collect = Callable[[Any, Any, Callable, Callable], dict[str, Any]]


def host(collect: Collect, state) -> dict[str, Any]:
  """`collect` on a host copy of `state`: counts summed exactly, ints,
  floats and float64 fractions (NaN without a denominator)."""
  return collect(jax.device_get(state), np, _host_ratio, _host_value)


def traced(collect: Collect, state) -> dict[str, jax.Array]:
  """`collect` on the arrays of `state`: int32 counts, float32 fractions
  (NaN without a denominator) and sums."""
  return collect(state, jnp, counting.fraction, lambda x: x)


def counts(xp, a):
  """Counts to add up: int64 on the host (exact), int32 traced."""
  return xp.asarray(a).astype(np.int64 if xp is np else jnp.int32)


def sums(xp, a):
  """float32 sums to add up: in float64 on the host."""
  a = xp.asarray(a)
  return a.astype(np.float64) if xp is np else a


def targets(layout):
  """`(j, "pred/<target j>/", [leaves target j counts])` per target of a
  trace's static layout (a leaf whose format is None is left out)."""
  for j, name in enumerate(layout.targets):
    on = [i for i, f in enumerate(layout.formats[j]) if f is not None]
    yield j, f"pred/{name}/", on


def _host_value(a):
  a = np.asarray(a)
  return a.tolist() if a.ndim else a.item()


def _host_ratio(num, den):
  # Not counting.host_fraction: a numerator may be a float sum.
  num, den = np.asarray(num), np.asarray(den)
  if not num.ndim:
    return float(num) / float(den) if den else float("nan")
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(den > 0, num / np.maximum(den, 1), np.nan).tolist()


def leaf_name(path) -> str:
  """A leaf's name in a report: its "/"-joined path ("params" for a
  bare array)."""
  return weights.path_name(path) or "params"


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def float_leaves(tree) -> list:
  """The floating-point leaves of `tree`, in leaf order: what a trace
  watches (integer leaves, such as step counters, are not weights)."""
  return [x for x in jax.tree_util.tree_leaves(tree) if _is_float(x)]


def float_paths(tree) -> list[tuple[Any, Any]]:
  """`(key path, leaf)` of the leaves `float_leaves` gives."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(p, x) for p, x in flat if _is_float(x)]


def step_leaves(caller: str, params, updates, n: int) -> tuple[list, list]:
  """The float leaves of `params` and `updates` at an update, checked
  against the `n` leaves seen at init."""
  if params is None:
    raise ValueError(
      f"{caller} needs params: call opt.update(updates, state, params)"
    )
  ws, us = float_leaves(params), float_leaves(updates)
  if len(ws) != n or len(us) != n:
    raise ValueError(
      f"params/updates do not match the tree {caller} was initialised with"
    )
  return ws, us

"""Counts of a store step, and the telemetry dicts built from them.

Every store (a weight write-back, a compensated buffer, a stored moment)
counts what its rounding did with one reduction per tensor, inside jit,
and reports it through `lowprec.telemetry` as totals, a fraction and the
same per tensor path. This module is that one reduction and that one
layout; the transforms only say which masks they count and which fields
they report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.engine import stacked


def count(*masks) -> tuple[jax.Array, ...]:
  """int32 counts of the True entries of each mask, in one reduction.

  One variadic reduction over the last axis (which XLA:CPU runs in parallel
  over rows), then a small one over the rest.
  """
  ops = tuple(m.astype(jnp.int32) for m in masks)
  ndim = masks[0].ndim
  axes = (ndim - 1,) if ndim >= 2 else tuple(range(ndim))
  zeros = tuple(jnp.zeros([], jnp.int32) for _ in ops)

  def add(a, b):
    return tuple(x + y for x, y in zip(a, b, strict=True))

  rows = jax.lax.reduce(ops, zeros, add, axes)
  return tuple(jnp.sum(r, dtype=jnp.int32) for r in rows)


def row_counts(masks, totals=None) -> list:
  """int32 counts of the True entries of each mask along its last axis
  (kept, shape (rows, 1)), added to `totals` (an earlier call's, for
  another lane of the same rows) where given: what a kernel writes for
  each row of its tile, summed over the rows after it."""
  rows = [jnp.sum(m.astype(jnp.int32), axis=-1, keepdims=True) for m in masks]
  if totals is not None:
    rows = [a + b for a, b in zip(totals, rows, strict=True)]
  return rows


def mass(x) -> jax.Array:
  """float32 sum of `|x|`."""
  return jnp.sum(jnp.abs(x), dtype=jnp.float32)


def fraction(num, den) -> jax.Array:
  """float32 `num / den`, NaN where `den` is 0 (traceable)."""
  den_f = jnp.maximum(den, 1).astype(jnp.float32)
  return jnp.where(
    den > 0, jnp.asarray(num).astype(jnp.float32) / den_f, jnp.nan
  )


def host_fraction(num, den):
  """`num / den` as a float (a list for batched counts), NaN where 0."""
  num, den = np.asarray(num), np.asarray(den)
  if not num.ndim:
    return int(num) / int(den) if den else float("nan")
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(den > 0, num / np.maximum(den, 1), np.nan).tolist()


def host_int(a):
  """An exact Python int (a nested list for batched counts)."""
  a = np.asarray(a)
  return a.tolist() if a.ndim else int(a)


def host_float(a):
  """A Python float (a nested list for batched values)."""
  a = np.asarray(a, np.float64)
  return a.tolist() if a.ndim else float(a)


def layout(
  steps,
  per: Mapping[str, Mapping[str, Any]],
  counts: Sequence[str],
  ratio: tuple[str, str, str] | None,
  *,
  masses: Sequence[str] = (),
  prefix: str = "",
  host: bool = False,
) -> dict[str, Any]:
  """The telemetry of one store as `{key: value}`.

  Keys, each with `prefix`: `steps` (left out where `steps` is None); the
  total of every count and mass; the ratio `ratio = (name, numerator,
  denominator)` of the totals (if any); then,
  per tensor path `n` of `per` (`{path: {field: value}}`), `<field>/<n>`
  and `<name>/<n>`; a path of stacked layers (`h_0:12/...`, values with
  the layers on their first axis) as each layer's path. With `host`,
  values are read to the host: exact ints, floats, and float64
  fractions; else they stay arrays (int32 counts, float32 masses and
  fractions), traceable.
  """
  p = prefix
  # A leaf of stacked layers reports each layer under its own path.
  per = stacked.expand(per)
  if host:
    per = jax.device_get(per)
    # Counts summed exactly in int64; masses in their own float32, as
    # `arrays()` sums them.
    per = {
      n: {
        f: np.asarray(v, None if f in masses else np.int64)
        for f, v in d.items()
      }
      for n, d in per.items()
    }
    frac, as_int, as_float = host_fraction, host_int, host_float
    zero_int, zero_float = np.int64(0), np.float32(0)
  else:
    frac, as_int, as_float = fraction, (lambda a: a), (lambda a: a)
    zero_int, zero_float = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32)
  out = {} if steps is None else {f"{p}steps": as_int(steps)}
  totals = {f: sum((d[f] for d in per.values()), zero_int) for f in counts}
  totals.update(
    {f: sum((d[f] for d in per.values()), zero_float) for f in masses}
  )
  for f in counts:
    out[f"{p}{f}"] = as_int(totals[f])
  for f in masses:
    out[f"{p}{f}"] = as_float(totals[f])
  if ratio is not None:
    name, num, den = ratio
    out[f"{p}{name}"] = frac(totals[num], totals[den])
  for n, d in per.items():
    for f in counts:
      out[f"{p}{f}/{n}"] = as_int(d[f])
    for f in masses:
      out[f"{p}{f}/{n}"] = as_float(d[f])
    if ratio is not None:
      out[f"{p}{name}/{n}"] = frac(d[num], d[den])
  return out


ERASED = ("erased_fraction", "erased", "proposals")


def of_state(
  st,
  counts: Sequence[str],
  *,
  masses: Sequence[str] = (),
  ratio: tuple[str, str, str] = ERASED,
  prefix: str = "",
  host: bool = False,
) -> dict[str, Any]:
  """`layout` of a store's state: a NamedTuple with a step `count` and,
  per field of `counts` and `masses`, a dict `{path: value}` (None with
  telemetry off: then only `steps`). The paths are those of the ratio's
  denominator field; `erased`, where the state keeps no such field, is
  `proposals - moved`."""
  paths = getattr(st, ratio[2])
  if paths is None:
    return layout(st.count, {}, (), None, prefix=prefix, host=host)
  per = {}
  for n in paths:
    p = {f: getattr(st, f)[n] for f in (*counts, *masses) if f in st._fields}
    if "erased" in counts and "erased" not in p:
      p["erased"] = p["proposals"] - p["moved"]
    per[n] = p
  return layout(
    st.count, per, counts, ratio, masses=masses, prefix=prefix, host=host
  )


def by_field(per_path, fields: Sequence[str], telemetry: bool = True) -> dict:
  """`{field: {path: value}}` from `{path: values in the order of
  fields}` (values past the fields are left out), as a store's state
  keeps its counts; every field None with telemetry off."""
  if not telemetry:
    return dict.fromkeys(fields)
  return {
    f: {n: v[i] for n, v in per_path.items()} for i, f in enumerate(fields)
  }

"""Saved tensors: what the forward keeps and what each backward use reads.

`save` rounds a tensor for the forward (with its `Rounding`) and keeps only
the values the policy's uses will read, narrow where it can; `read`
produces, in the backward, the value one use asks for. Keys for every draw
are derived by name (`key_for`), so draws are independent and reproducible.
"""

from __future__ import annotations

import zlib

import jax

from lowprec.backward.ops.rounding import Rounding, Stored  # noqa: F401


def key_for(key, name: str) -> jax.Array:
  """The key for the draw called `name`: `fold_in(key, crc32(name))`."""
  return jax.random.fold_in(key, zlib.crc32(name.encode()))


def save(r: Rounding, x, key, reads) -> tuple[jax.Array, dict]:
  """Rounds `x` for the forward; keeps what the values in `reads` need.

  Args:
    r: the tensor's rounding.
    x: the tensor before rounding.
    key: the forward draw's key (stochastic rounding only).
    reads: the policy values the backward will read (a set of `VALUES`).

  Returns:
    `(x~, residuals)`: the rounded tensor in `x`'s dtype, and a dict holding
      `"rounded"` / `"nearest"` as `Stored` (narrow) and `"original"` as `x`,
      only those needed. Without rounding everything is `x` itself.
  """
  if r.is_identity:
    return x, {"original": x}
  value, stored = r.round(x, key)
  res = {}
  if "rounded" in reads:
    res["rounded"] = stored
  if "nearest" in reads:
    res["nearest"] = (
      stored if r.mode == "nearest" else r.quantize(x, mode="nearest")
    )
  if "original" in reads or "fresh" in reads:
    res["original"] = x
  return value, res


def read(r: Rounding, res: dict, value: str, key) -> jax.Array:
  """The value a use reads, from what `save` kept (`key`: fresh draws)."""
  if r.is_identity or value == "original":
    return res["original"]
  if value == "fresh":
    return r.round(res["original"], key, mode="stochastic")[0]
  return res[value].value()


def straight_through(r: Rounding, x, key) -> jax.Array:
  """`x~` in the forward, gradient passed through unchanged."""
  if r.is_identity:
    return x
  xr = r.round(x, key)[0]
  # (x - x) is exactly zero, so the value is exactly xr.
  return (x - jax.lax.stop_gradient(x)) + jax.lax.stop_gradient(xr)

"""Which erased proposals were weight decay's: an optax pass-through.

Decoupled weight decay (AdamW) proposes `u = -lr * (a + wd * w)` for the
Adam direction `a`. On a grid, nearest write-back erases `u` where
`Q(w + u) == Q(w)`. Far from zero the decay term `-lr * wd * w` is tiny
next to the gap at `w` (a bf16 gain of 1.0 with lr 6e-4 and wd 0.1
proposes 6e-5 against half-gaps of 2^-9 below and 2^-8 above), so erased
proposals are often the decay's alone. `decay_erasure` counts, per tensor,
the erased proposals and those among them that are *weight decay only*:
the gradient part `g = u - (-lr * (wd * w))` is zero, or is erased alone
(`Q(w + g) == Q(w)`).

Place it right after `optax.adamw` (same `learning_rate` and
`weight_decay`; the schedule is read at its own step count, as optax's
is), before a write-back or a reference trace. It passes the updates
through unchanged. In a float32 run it predicts, at the float32 weights
rounded to `fmt`, what nearest write-back would erase (as
`reference_trace` does); in a nearest write-back run to `fmt` it measures
what the write-back erases.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import weights
from lowprec.freeze import trace as trace_lib
from lowprec.grids.rounding import round_nearest
from lowprec.optim import telemetry as telemetry_lib


@dataclasses.dataclass(frozen=True)
class DecayLayout:
  """Static tensor names (no arrays): "" for a tensor not counted."""

  leaves: tuple[str, ...]


jax.tree_util.register_static(DecayLayout)


class DecayErasureState(NamedTuple):
  """This step's counts per tensor (`layout.leaves` names them)."""

  count: jax.Array  # [] int32: updates seen so far
  erased: jax.Array  # [L] int32: erased nonzero proposals
  decay_only: jax.Array  # [L] int32: those whose gradient part is zero/erased
  layout: DecayLayout

  def report(self) -> dict[str, Any]:
    """`decay/erased`, `decay/decay_only`, `decay/decay_only_share` and
    per tensor `decay/erased/<leaf>`, `decay/decay_only/<leaf>` (exact
    integers; the share is NaN at a step with nothing erased)."""
    out = self._collect(jax.device_get(self), np)
    for k, v in out.items():
      a = np.asarray(v)
      out[k] = a.tolist() if a.ndim else a.item()
    return out

  def arrays(self) -> dict[str, jax.Array]:
    return self._collect(self, jnp)

  @staticmethod
  def _collect(st, xp) -> dict[str, Any]:
    leaves = st.layout.leaves
    counted = [i for i, n in enumerate(leaves) if n]
    erased = xp.asarray(st.erased)[..., counted]
    only = xp.asarray(st.decay_only)[..., counted]
    total, total_only = erased.sum(axis=-1), only.sum(axis=-1)
    out = {"decay/erased": total, "decay/decay_only": total_only}
    # float64 on the host (report), float32 inside jit (arrays).
    real = np.float64 if xp is np else jnp.float32
    den = xp.maximum(total, 1).astype(real)
    out["decay/decay_only_share"] = xp.where(
      total > 0, total_only.astype(real) / den, xp.nan
    )
    for j, i in enumerate(counted):
      out[f"decay/erased/{leaves[i]}"] = erased[..., j]
      out[f"decay/decay_only/{leaves[i]}"] = only[..., j]
    return out


def decay_erasure(
  fmt, learning_rate, weight_decay: float, mask=None
) -> optax.GradientTransformation:
  """Counts erased proposals and those that are weight decay only.

  Args:
    fmt: the grid, as `lowprec.to_grid` takes it (a format name, a
      `Format`, or rules per tensor; None leaves a tensor out).
    learning_rate: the float or schedule given to `optax.adamw`.
    weight_decay: its `weight_decay`.
    mask: its `mask` (a pytree of bools or a callable of params), or None
      (decay on every tensor, optax's default).

  Returns:
    An optax transform whose state reports through `lowprec.telemetry`.
  """
  lookup = weights.format_lookup(fmt)
  lr = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

  def names(params):
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for (path, x), name in zip(flat, trace_lib.leaf_paths(params), strict=True):
      floating = jnp.issubdtype(jnp.result_type(x), jnp.floating)
      out.append(name if floating and lookup(path) is not None else "")
    return DecayLayout(tuple(out))

  def init(params):
    n = len(jax.tree.leaves(params))
    zero = jnp.zeros(n, jnp.int32)
    return DecayErasureState(jnp.int32(0), zero, zero, names(params))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    decays = mask(params) if callable(mask) else mask
    if decays is None:
      decays = jax.tree.map(lambda _: True, params)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    us = jax.tree.leaves(updates)
    ds = jax.tree.leaves(decays)
    rate = jnp.asarray(lr(state.count), jnp.float32)
    erased, only = [], []
    for (path, w), u, decayed, name in zip(
      flat, us, ds, state.layout.leaves, strict=True
    ):
      if not name:
        erased.append(jnp.int32(0))
        only.append(jnp.int32(0))
        continue
      f = lookup(path)
      w32, u32 = w.astype(jnp.float32), u.astype(jnp.float32)
      base = round_nearest(w32, f)
      gone = (u32 != 0) & (round_nearest(w32 + u32, f) == base)
      if decayed:
        # The decay term exactly as optax computes it, so a zero Adam
        # direction leaves a gradient part of exactly zero.
        part = u32 - (-rate * (jnp.float32(weight_decay) * w32))
      else:
        part = u32
      alone = (part == 0) | (round_nearest(w32 + part, f) == base)
      erased.append(gone.sum(dtype=jnp.int32))
      only.append((gone & alone).sum(dtype=jnp.int32))
    new = DecayErasureState(
      state.count + 1, jnp.stack(erased), jnp.stack(only), state.layout
    )
    return updates, new

  return optax.GradientTransformation(init, update)


# telemetry names this transform when its state is met as plain arrays.
telemetry_lib.register_layout(
  DecayErasureState,
  {"count", "erased", "decay_only"},
  "lowprec.freeze.decay_erasure",
)

"""Write-back without master weights, as an optax transform with telemetry.

Without a float32 master copy, every optimizer step writes `w + u` back to the
weights' grid: `w' = Q(w + u)`. A nonzero proposal `u` that `Q` rounds away is
**erased** (`u != 0` and `w' == w`); under nearest rounding that happens
exactly when `|u|` is below half the grid gap at `w` in the direction of `u`,
and a coordinate whose proposals are erased at every step is frozen while its
gradient is not zero. Stochastic rounding keeps `E[w'] = w + u`, so nothing
freezes for good.

`writeback` goes last in an optax chain, rounds there, and returns the float32
deltas `w' - w`, which land exactly through `optax.apply_updates` (or
`lowprec.apply_updates` for float8 storage). Its state keeps a PRNG key and
per-tensor counts of proposals, erasures and saturations, read with
`lowprec.telemetry(opt_state)`; it never holds a copy of the parameters.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec import names, scaled
from lowprec import rng as rng_lib
from lowprec.formats import Format
from lowprec.rounding import OVERFLOW_MODES, ROUNDINGS, round_and_flag
from lowprec.storage import (
  check_on_grid,
  check_shape,
  check_storage,
  format_lookup,
  leaf_format,
  path_name,
)

NONFINITE_MODES = ("keep", "propagate")
SCALE_MODES = ("recompute", "keep")  # block scales of a scaled write-back

_COUNTS = ("proposals", "moved", "saturated", "unreachable", "nonfinite")
_REPORTED = ("proposals", "erased", "moved", "saturated", "unreachable")
_REPORTED += ("nonfinite",)


class WritebackState(NamedTuple):
  """State of `writeback`: a PRNG key and the counts of the last update.

  Counts are dicts from parameter path ("params/Dense_0/kernel") to an int32
  scalar, covering the parameters that have a format; they are None when the
  transform was built with `telemetry=False`. `erased` is `proposals - moved`.
  `arrays()` gives them as a pytree of arrays (usable under jit, scan and
  vmap), `report()` as plain numbers for `lowprec.telemetry`.
  """

  count: jax.Array  # int32 []: updates applied so far.
  key: jax.Array | None  # uint32 [2] key data, split each update; None (RN).
  proposals: dict[str, jax.Array] | None  # int32 [] per path: finite u != 0.
  moved: dict[str, jax.Array] | None  # int32 [] per path: w' != w.
  saturated: dict[str, jax.Array] | None  # int32 [] per path: past max.
  unreachable: dict[str, jax.Array] | None  # int32 [] per path: detoured.
  nonfinite: dict[str, jax.Array] | None  # int32 [] per path: u or w bad.
  # Parameters on a scaled grid only (None without any): int32 [] per path.
  blocks: dict[str, jax.Array] | None = None  # scale blocks of the tensor.
  rescaled: dict[str, jax.Array] | None = None  # blocks whose scale moved.

  def arrays(self) -> dict[str, jax.Array]:
    """The counts as arrays, traceable: `{name: int32 or float32 array}`.

    Keys as in `report()`. Totals are int32 sums over tensors and
    `erased_fraction` is float32 (NaN without proposals). Under `vmap` each
    value has the ensemble's leading axis; `scan` stacks them.
    """
    out = {"steps": self.count}
    if self.proposals is None:
      return out
    per = _per_leaf(self)
    total = {k: sum(p[k] for p in per.values()) for k in _REPORTED}
    out.update(total)
    out["erased_fraction"] = _fraction(total["erased"], total["proposals"])
    for n, p in per.items():
      out.update({f"{k}/{n}": p[k] for k in _REPORTED})
      out[f"erased_fraction/{n}"] = _fraction(p["erased"], p["proposals"])
    out.update(_scale_counts(self, jnp, lambda a: a, _fraction))
    return out

  def report(self) -> dict[str, int | float]:
    """The counts as plain numbers: totals, then `<count>/<path>` per tensor.

    Keys: `steps`, `proposals` (finite nonzero proposals), `erased`,
    `moved`, `saturated`, `unreachable`, `nonfinite` (coordinates whose
    proposal is NaN or infinite, or whose weight is NaN; never counted as
    proposals or moves), `erased_fraction` (erased / proposals; NaN at a
    step without proposals, as in `lowprec.freeze`, whose curve functions
    skip such steps), and the same counts per parameter path. Totals are
    exact integers and fractions float64, computed on the host; a state
    with leading (ensemble) axes gives nested lists.
    Parameters on a scaled (MX) grid add `blocks`, `rescaled` (blocks whose
    scale changed this step) and `rescaled_fraction`, in total and per
    path.
    """
    out = {"steps": _host(self.count)}
    if self.proposals is None:
      return out
    per = _per_leaf(jax.device_get(self._replace(key=None)))
    per = {
      n: {k: np.asarray(v, np.int64) for k, v in p.items()}
      for n, p in per.items()
    }
    for k in _REPORTED:
      out[k] = _host(sum(p[k] for p in per.values()))
    out["erased_fraction"] = _host_fraction(
      sum(p["erased"] for p in per.values()),
      sum(p["proposals"] for p in per.values()),
    )
    for n, p in per.items():
      for k in _REPORTED:
        out[f"{k}/{n}"] = _host(p[k])
      out[f"erased_fraction/{n}"] = _host_fraction(p["erased"], p["proposals"])
    if self.blocks:
      host = jax.device_get(self._replace(key=None))
      wide = lambda a: np.asarray(a, np.int64)  # noqa: E731
      counts = _scale_counts(host, np, wide, _host_fraction)
      out.update(
        {k: v if "fraction" in k else _host(v) for k, v in counts.items()}
      )
    return out


def _scale_counts(state: WritebackState, xp, cast, fraction) -> dict:
  """`blocks`, `rescaled` and `rescaled_fraction` in total and per path,
  for the parameters on scaled grids; empty without any."""
  if not state.blocks:
    return {}
  blocks = {n: cast(v) for n, v in state.blocks.items()}
  moved = {n: cast(state.rescaled[n]) for n in blocks}
  out = {"blocks": sum(blocks.values()), "rescaled": sum(moved.values())}
  out["rescaled_fraction"] = fraction(out["rescaled"], out["blocks"])
  for n in blocks:
    out[f"blocks/{n}"] = blocks[n]
    out[f"rescaled/{n}"] = moved[n]
    out[f"rescaled_fraction/{n}"] = fraction(moved[n], blocks[n])
  return out


def _per_leaf(state: WritebackState) -> dict[str, dict]:
  per = {}
  for n in state.proposals:
    p = {c: getattr(state, c)[n] for c in _COUNTS}
    p["erased"] = p["proposals"] - p["moved"]
    per[n] = p
  return per


def _fraction(num, den):
  return jnp.where(den > 0, num / jnp.maximum(den, 1), jnp.nan).astype(
    jnp.float32
  )


def _host(a):
  a = np.asarray(a)
  return a.tolist() if a.ndim else int(a)


def _host_fraction(num, den):
  num, den = np.asarray(num), np.asarray(den)
  if not num.ndim:
    return int(num) / int(den) if den else float("nan")
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(den > 0, num / np.maximum(den, 1), np.nan).tolist()


def writeback(
  fmt,
  rounding: str = "nearest",
  *,
  key: jax.Array | None = None,
  overflow: str = "saturate",
  nonfinite: str = "keep",
  telemetry: bool = True,
  scales: str = "recompute",
) -> optax.GradientTransformation:
  """Rounds `w + u` onto the weights' grid and emits the exact deltas.

  For each parameter `w` on its format's grid and proposal `u` (the
  incoming update, in float32): `w' = Q(w + u)` and `delta = w' - w`, which
  `optax.apply_updates` lands exactly. `Q` is `nearest` (ties to even),
  `stochastic` (`E[Q(x)] = x`, 32 random bits per element from a
  counter-based hash, so sharded runs draw the same bits) or `deadzone`
  (stochastic only where nearest would erase the proposal). Coordinates
  with `u == 0` keep their bits; non-finite proposals are counted, not
  written (`nonfinite`). The state holds a key and int32 counts of the
  last update, read with `lowprec.telemetry` or `lowprec.telemetry_arrays`:
  `proposals`, `erased` (`u != 0` and `w' == w`), `moved`, `saturated`,
  `unreachable`, `nonfinite`, `erased_fraction`, in total and per path.

  The guide, docs/writeback.md, says the rest: formats per parameter,
  native storage (`lowprec.in_float32` for the optimizer before it), the
  exact-landing rule and its `unreachable` cases, non-finite proposals,
  telemetry and its cost.

  Args:
    fmt: the weights' format: a name (`"float8_e4m3fn"`, `"e8m3"`), a
      `Format` (e.g. `get_format("int3", scale=0.125)`), a pytree of formats
      shaped like (a prefix of) the params, or rules `[(regex, fmt), ...]`
      over "/"-joined parameter paths (`re.fullmatch`, first match wins, no
      match is an error). None leaves a parameter untouched (its update
      passes through). See `lowprec.storage`. An MX scaled format
      (`"mxfp8_e4m3"`, a `lowprec.ScaledFormat`) writes onto the grid of
      block scales chosen by `scales`, and adds `blocks`, `rescaled` and
      `rescaled_fraction` to the telemetry (docs/scaled.md). NVFP4 and
      per-tensor scaled formats are refused (the error says why).
    rounding: "nearest", "stochastic" or "deadzone".
    key: a JAX PRNG key; required by "stochastic" and "deadzone", ignored by
      "nearest". It is kept in the state and split at every update; give
      each member of a `vmap` ensemble its own with `lowprec.reseed`.
    overflow: "saturate" (default) clips to +-max finite; "ieee" overflows to
      inf, or NaN where the format has no inf, as a cast does.
    nonfinite: "keep" (default) or "propagate", for non-finite proposals.
    telemetry: keep the counts in the state (one reduction per tensor and
      step; on XLA:CPU it recomputes the rounding: docs/writeback.md).
    scales: for MX scaled formats only (ignored by the others): the block
      scales of the grid that `w + u` is rounded onto. "recompute"
      (default): from `w + u` itself, `w' = FQ(w + u)`, so a block's grid
      moves when its maximum moves. "keep": those of the current `w`
      (the previous step's, as `w` is on their grid), `w' = FQ(w + u;
      scales(w))`; a value past the block's top `max_E * scale`
      saturates there (counted in `saturated`), so a block's scale never
      grows, and `rescaled` is 0 (the next step takes the scales of `w'`,
      which may be smaller). One case needs more: under the `ocp` rule
      an e4m3 block whose maximum falls to `240 * scale` (the top of the
      binade below; doubled, 480 lies past 448) is off the grid of its
      own, halved, scale and is put there, which saturates it to
      `224 * scale`; so `w'` is always on its grid.

  Returns:
    An `optax.GradientTransformation` whose `update` needs `params`, stored
      as float32 holding grid values or as the format's native dtype.
      Its `init` checks concrete params and raises if any is off the grid.
      Leaves that are not arrays (an Equinox module's functions and Python
      numbers) need no format and are no parameters; a None update passes
      through (as `eqx.filter_grad` gives for them), so `init` and `update`
      take an unfiltered Equinox module as `params`.

  Raises:
    ValueError: unknown rounding, overflow, nonfinite or scales mode or
      format; an NVFP4 or per-tensor scaled format (the message says why
      and what to use instead); a random rounding without `key`; at
      `init`, params off their grid (call
      `lowprec.to_grid` first), stored in a dtype that cannot hold the grid
      (an integer or boolean array given a format among them), or an `intK`
      scale that is not a power of two; at `update`, missing `params`, an
      update shaped unlike its parameter, or proposals narrower than
      float32. Each names the parameter.

  Example:
    ```python
    params = lowprec.to_grid(params, "bfloat16")  # float32 on the grid
    opt = optax.chain(
        optax.adamw(optax.cosine_decay_schedule(1e-3, 1000)),
        lowprec.writeback("bfloat16", "stochastic", key=jax.random.key(0)),
    )
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)  # still on the grid
    lowprec.telemetry(state)["erased_fraction"]
    ```

  Reference: the write-back freezing study ("Direct low-precision
  write-back can erase nonzero optimizer proposals").
  """
  _check_mode("rounding", rounding, ROUNDINGS)
  _check_mode("overflow mode", overflow, OVERFLOW_MODES)
  _check_mode("nonfinite mode", nonfinite, NONFINITE_MODES)
  _check_mode("scales", scales, SCALE_MODES)
  lookup = format_lookup(fmt)
  random = rounding != "nearest"
  key, impl = _key_words(key, rounding) if random else (None, None)
  rule = _LeafRule(rounding, overflow, nonfinite, telemetry, scales)

  def init_fn(params):
    fmts = {
      path_name(path): f
      for path, w in jax.tree_util.tree_flatten_with_path(params)[0]
      if (f := _format_of(lookup, path, w)) is not None
    }
    names = list(fmts)
    on_scaled = [n for n, f in fmts.items() if _is_scaled(f)]
    if _concrete(params):
      # Concrete params may still meet init inside a trace (closed over
      # under jit or vmap): evaluate the check now rather than stage it.
      with jax.ensure_compile_time_eval():
        check_on_grid(params, fmt)

    def zeros():
      return {n: jnp.zeros([], jnp.int32) for n in names} if telemetry else None

    scale_counts = (
      {n: jnp.zeros([], jnp.int32) for n in on_scaled}
      if telemetry and on_scaled
      else None
    )
    return WritebackState(
      count=jnp.zeros([], jnp.int32),
      key=key if random else None,
      **{c: zeros() for c in _COUNTS},
      blocks=scale_counts,
      rescaled=scale_counts,
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "writeback rounds w + u and needs the current params: call "
        "opt.update(updates, state, params)"
      )
    # None updates (Equinox's for leaves it does not differentiate) pass
    # through, whatever the params hold there.
    flat, treedef = jax.tree_util.tree_flatten_with_path(
      updates, is_leaf=lambda x: x is None
    )
    weights = treedef.flatten_up_to(params)
    new_key = step_key = None
    if random:
      pair = jax.random.split(jax.random.wrap_key_data(state.key, impl=impl))
      new_key, step_key = jax.random.key_data(pair[0]), pair[1]
    deltas = []
    counts = {c: {} for c in _COUNTS}
    blocks, rescaled = {}, {}
    for (path, u), w in zip(flat, weights, strict=True):
      f = None if u is None else _format_of(lookup, path, w)
      if f is None:
        deltas.append(u)
        continue
      name = path_name(path)
      check_shape("writeback", name, w, u)
      _check_proposal(name, u)
      bits = None
      if random:
        leaf_key = jax.random.fold_in(step_key, _seed(name))
        bits = rng_lib.random_bits(leaf_key, jnp.shape(w))
      delta, leaf_counts = rule.write(w, u, f, bits)
      deltas.append(delta)
      if leaf_counts is not None and _is_scaled(f):
        *leaf_counts, blocks[name], rescaled[name] = leaf_counts
      for c, v in zip(_COUNTS, leaf_counts or (), strict=telemetry):
        counts[c][name] = v
    if not telemetry:
      counts = dict.fromkeys(_COUNTS)
    new_state = WritebackState(
      count=optax.safe_increment(state.count),
      key=new_key,
      **counts,
      blocks=blocks or None,
      rescaled=rescaled or None,
    )
    return jax.tree_util.tree_unflatten(treedef, deltas), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _check_mode(what: str, value: str, valid: tuple[str, ...]) -> None:
  names.check_choice(what, value, valid)


def _key_words(key, rounding: str):
  """The raw key words kept in the state, and the key's implementation."""
  if key is None:
    raise ValueError(
      f"writeback(rounding={rounding!r}) draws random bits and needs a "
      "PRNG key: pass key=jax.random.key(seed)"
    )
  words = rng_lib.key_words(key)  # raises for what is not a key
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  return words, jax.random.key_impl(key) if typed else None


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


def _format_of(lookup, path, w) -> Format | None:
  """The format of the parameter at `path`, checked against its storage;
  None for a leaf that is not an array or that the spec leaves alone."""
  fmt = leaf_format(lookup, path, w)
  if fmt is None:
    return None
  check_storage(path_name(path), w.dtype, fmt)
  if _is_scaled(fmt):
    if fmt.scale_type != "e8m0":
      raise ValueError(
        f"parameter {path_name(path)!r}: write-back onto {fmt} is not "
        f"supported. {_WHY_NOT[fmt.rule]}"
      )
    return fmt
  if not fmt.is_float and not float(np.log2(fmt.scale)).is_integer():
    # float32(k * s) - float32(j * s) is not float32-exact for such s, so
    # no float32 delta lands on most of the grid.
    pow2 = 2.0 ** round(float(np.log2(fmt.scale)))
    raise ValueError(
      f"parameter {path_name(path)!r}: write-back onto {fmt} needs a "
      f"power-of-two scale to land exactly in float32, got {fmt.scale}; "
      f"use e.g. get_format({fmt.name!r}, scale={pow2})"
    )
  return fmt


# Why a scaled format with float32 (not power-of-two) scales takes no
# write-back, and what to use instead, by scale rule.
_WHY_NOT = {
  "nvfp4": (
    "Its scale s_b * s_t is a float32 product recomputed from the "
    "tensor's amax, and the grid is not a fixed point of its own "
    "rounding: rounding a tensor already on it recomputes s_t from the "
    "rounded amax and moves most values by a float32 rounding, so no "
    "parameter stays on the grid of its own scales (there is no "
    "state-free grid to write back onto), a step that moves the tensor "
    "amax moves every value (w' == w, 'erased', loses its meaning), and "
    "the float32 delta between two products e * s need not land exactly. "
    "Use 'mxfp4_e2m1' (the same E2M1 elements under power-of-two E8M0 "
    "scales), or lowprec.get_scaled_format('mxfp4_e2m1', block=16) for "
    "NVFP4's block size (docs/scaled.md)"
  ),
  "amax": (
    "Its one float32 scale amax / max_E follows the tensor's largest "
    "|w|, so a step that moves that value moves every value of the "
    "tensor by a float32 rounding (w' == w, 'erased', loses its "
    "meaning), and the float32 delta between two products e * s of a "
    "scale that is not a power of two need not land exactly. Use the "
    "element format itself (e.g. 'float8_e4m3fn', scale 1) or an MX "
    "format with power-of-two block scales (e.g. 'mxfp8_e4m3') "
    "(docs/scaled.md)"
  ),
}


def _is_scaled(fmt) -> bool:
  return isinstance(fmt, scaled.ScaledFormat)


def _concrete(tree) -> bool:
  abstract = (jax.core.Tracer, jax.ShapeDtypeStruct)
  return not any(isinstance(x, abstract) for x in jax.tree.leaves(tree))


def _seed(name: str) -> int:
  # Keyed by path, not position: masking or adding a parameter leaves the
  # other parameters' random streams unchanged.
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class _LeafRule:
  """The write-back of one tensor: the rounded value, the delta, the counts."""

  rounding: str
  overflow: str
  nonfinite: str
  telemetry: bool
  scales: str = "recompute"

  def write(self, w, u, fmt: Format, bits):
    """Delta and, with telemetry, the `_COUNTS` of one tensor (then, for a
    scaled format, its block count and the blocks whose scale changed)."""
    w = jnp.asarray(w).astype(jnp.float32)
    u = jnp.asarray(u).astype(jnp.float32)
    on_scaled = _is_scaled(fmt)
    if on_scaled:
      q, over, new_scales = self._round_scaled(w, u, fmt, bits)
    else:
      q, over = self._round(w, u, fmt, bits)
    finite = jnp.isfinite(u) & ~jnp.isnan(w)
    proposed = (u != 0) & finite
    written = proposed if self.nonfinite == "keep" else (u != 0) | ~finite
    if on_scaled:
      # New scales move the grid under every coordinate of a block: those
      # with u == 0 are rounded onto it too.
      written = finite if self.nonfinite == "keep" else jnp.ones_like(finite)
    # Keeping w itself (not an equal value) preserves the sign of zero.
    q = jnp.where(written & (q != w), q, w)
    delta, lands = _land(w, q, fmt)
    if not self.telemetry:
      return delta, None
    # The delta is -0 exactly where the weight stays, nonzero where it moves.
    moved = proposed & (delta != 0)
    counts = _count(proposed, moved, over & proposed, ~lands, ~finite)
    if not on_scaled:
      return delta, counts
    if self.scales == "keep":  # rounded with w's scales, by construction
      return delta, (*counts, jnp.int32(new_scales.block.size), jnp.int32(0))
    old = scaled.compute_scales(w, fmt).block
    code = lambda s: jax.lax.bitcast_convert_type(s, jnp.uint8)  # noqa: E731
    changed = jnp.sum(code(old) != code(new_scales.block), dtype=jnp.int32)
    return delta, (*counts, jnp.int32(old.size), changed)

  def _round_scaled(self, w, u, fmt, bits):
    """`w + u` onto the scaled grid of scales computed from `w + u`
    ("recompute") or from `w` ("keep")."""
    x = w + u
    keep = self.scales == "keep"
    kept = scaled.compute_scales(w, fmt) if keep else None
    mode = "nearest" if self.rounding == "nearest" else "stochastic"
    sr_bits = None if mode == "nearest" else bits
    q, over, sc = scaled.fake_quantize_and_scales(
      x, fmt, mode, overflow=self.overflow, bits=sr_bits, scales=kept
    )
    if self.rounding == "deadzone":
      q_rn, over_rn, _ = scaled.fake_quantize_and_scales(
        x, fmt, overflow=self.overflow, scales=kept
      )
      erased = q_rn == w
      q = jnp.where(erased, q, q_rn)
      over = jnp.where(erased, over, over_rn)
    if keep and fmt.rule == "ocp":
      # Only a block whose maximum fell to the top of the binade below
      # its scale's is off the grid of its own (halved) scale; putting it
      # there saturates that maximum. The identity on every other block.
      q, over_own, _ = scaled.fake_quantize_and_scales(
        q, fmt, overflow=self.overflow
      )
      over = over | over_own
    return q, over, sc

  def _round(self, w, u, fmt: Format, bits):
    x = w + u
    sr_bits = bits if self.rounding == "stochastic" else None
    q, over = round_and_flag(x, fmt, sr_bits, overflow=self.overflow)
    if self.rounding == "deadzone":
      q_sr, over_sr = round_and_flag(x, fmt, bits, overflow=self.overflow)
      erased = q == w
      q = jnp.where(erased, q_sr, q)
      over = jnp.where(erased, over_sr, over)
    return q, over


def _land(w, q, fmt: Format):
  """The float32 delta that takes w to q, or to q's neighbour toward w.

  Rarely q is out of reach of float32 addition to w (see `writeback`): take
  the grid neighbour of q toward w if that lands, else stay. This is
  elementwise, not a `lax.cond`, so that XLA fuses the whole write-back into
  the optimizer's update and `apply_updates`. Returns the delta and where q
  itself landed.
  """
  delta, lands = _delta(w, q)
  q2 = _toward_zero(q, fmt)
  delta2, lands2 = _delta(w, q2)
  toward_w = (q > w) == (q > 0)  # toward zero is toward w, not past it
  detour = ~lands & lands2 & toward_w
  delta = jnp.where(lands, delta, jnp.where(detour, delta2, -0.0))
  return delta, lands


def _toward_zero(q, fmt: Format):
  """The grid value next to q toward zero, where q is normal above the
  smallest normal; elsewhere (and for intK) q itself, which never lands
  where q did not."""
  if _is_scaled(fmt) or not fmt.is_float:
    return q
  b = jax.lax.bitcast_convert_type(q, jnp.uint32)
  # Grid values of a normal binade are float32 patterns whose low 23 - m
  # mantissa bits are zero, so one step down is one unit of 2**(23 - m).
  ok = (b & 0x7FFFFFFF) > np.float32(fmt.min_normal).view(np.uint32)
  ok &= (b & 0x7FFFFFFF) < 0x7F800000
  step = jnp.uint32(1 << (23 - fmt.man_bits))
  return jnp.where(ok, jax.lax.bitcast_convert_type(b - step, jnp.float32), q)


def _count(*masks):
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


def _delta(w, q):
  """A float32 `d` with `w + d == q` in float32, and where that holds.

  `q - w` rounded is the answer unless its rounding error pushes `w + d` off
  `q`; then the float32 neighbour of `d` toward the error is the only other
  candidate: every float that lands lies on one side of `q - w`, and the
  nearest float there is `d` or that neighbour.
  """
  d = q - w
  r = w + d
  # One float32 step of d: +1 on the bit pattern grows |d|, -1 shrinks it.
  grow = (q > r) == (d > 0)
  b = jax.lax.bitcast_convert_type(d, jnp.uint32)
  step = jnp.where(grow, jnp.uint32(1), jnp.uint32(0xFFFFFFFF))
  nudged = jax.lax.bitcast_convert_type(b + step, jnp.float32)
  d = jnp.where(r == q, d, nudged)
  # Adding -0 keeps every w bit for bit (+0 + -0 = +0, -0 + -0 = -0).
  d = jnp.where(q == w, jnp.float32(-0.0), d)
  return d, (w + d == q) | jnp.isnan(q)

"""Predicting compensated write-back from a float32 run.

`reference_trace` predicts which proposals a nearest write-back erases.
`compensated_trace` does the same for the compensated write-backs of
`lowprec.compensated` (Kahan with a buffer on its own grid, and the
two-component float): along the float32 reference it carries a predicted
buffer per coordinate and applies, at each step, the remedy's own rule at
the reference weight projected to the grid. It says which coordinates a
remedy moves late rather than never, and where the buffer itself erases
(a float8 buffer freezes too).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import counting, weights
from lowprec.engine.codec import stored_dtype
from lowprec.freeze import reports
from lowprec.freeze.trace import named_specs
from lowprec.grids.formats import Format, ScaledFormat, get_format
from lowprec.grids.rounding import round_and_flag
from lowprec.optim import compensated
from lowprec.optim import telemetry as telemetry_lib
from lowprec.optim.compensated import as_emitted, buffer_format

KINDS = ("kahan", "two_component")

# Per step and leaf: the counts of the compensated write-back's telemetry,
# then the coordinates counted over the run so far (see `report`).
_STEP = ("proposals", "erased", "moved", "lost")
_RUN = ("nearest_frozen", "late", "drained")
_COUNTS = _STEP + _RUN
_MASSES = ("carried", "lost_mass", "drift")

# Per-coordinate flags (uint8), over the run so far.
_FROZEN = 1  # nearest write-back erased every proposal (cleared on a move)
_MOVED = 2  # the remedy moved the weight at least once
_PROPOSED = 4  # at least one proposal
_HELD = 8  # the buffer held a nonzero value after some step


@dataclasses.dataclass(frozen=True, eq=False)
class Remedy:
  """A compensated write-back to predict.

  Attributes:
    fmt: the weights' grid, a format specification as `lowprec.to_grid`
      takes it (one format, a pytree, or `(regex, format or None)` rules; a
      parameter whose format is None is left out).
    kind: "kahan" (`lowprec.kahan_writeback`) or "two_component"
      (`lowprec.two_component_writeback`: the error on the weight's grid).
    buffer: the Kahan buffer's format (one format, e.g. "bfloat16" or
      "float8_e5m2"); ignored by "two_component".
  """

  fmt: Any
  kind: str = "kahan"
  buffer: Any = "bfloat16"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(
        f"remedy kind {self.kind!r} is not one of {KINDS}; the remainder "
        "write-back is a float32 master (its prediction is the reference "
        "itself)"
      )
    if isinstance(self.fmt, (str, Format)):
      object.__setattr__(self, "fmt", get_format(self.fmt))
    if self.kind == "kahan":
      if self.buffer is None:
        raise ValueError(
          "a 'kahan' remedy needs a buffer format, e.g. ('bfloat16', "
          "'kahan', 'bfloat16') or ('bfloat16', 'kahan', 'float8_e5m2')"
        )
      object.__setattr__(self, "buffer", buffer_format(self.buffer))
    else:
      object.__setattr__(self, "buffer", None)
    object.__setattr__(self, "_lookup", weights.format_lookup(self.fmt))

  @property
  def default_name(self) -> str | None:
    """`<format>_kahan_<buffer>` or `<format>_two_component`; None for
    per-parameter formats (they need a name)."""
    if not isinstance(self.fmt, Format):
      return None
    buf = None if self.buffer is None else self.buffer.name
    return remedy_name(self.fmt.name, self.kind, buf)

  def leaf_format(self, path) -> Format | None:
    """The weight format at key path `path` (None: left out)."""
    return self._lookup(path)

  def buffer_format(self, weight: Format) -> Format:
    """The buffer's grid for a weight on `weight`'s grid."""
    return weight if self.buffer is None else self.buffer


def remedy_name(fmt: str, kind: str, buffer: str | None = None) -> str:
  """The default name of a remedy target: `bfloat16_kahan_float8_e5m2`,
  `bfloat16_two_component`. The report's keys are `pred/<name>/...`."""
  if kind == "kahan":
    return f"{fmt}_kahan_{buffer}"
  return f"{fmt}_{kind}"


def _as_remedy(spec) -> Remedy:
  if isinstance(spec, Remedy):
    return spec
  if isinstance(spec, str):
    raise _string_remedy(spec)
  if _is_spec_tuple(spec):
    fmt, kind, *rest = spec
    if kind != "kahan" and rest and rest[0] is not None:
      raise ValueError(
        f"remedy {tuple(spec)!r}: only 'kahan' takes a buffer format; "
        f"write ({fmt!r}, {kind!r})"
      )
    return Remedy(fmt, kind, *(rest if kind == "kahan" else ()))
  raise ValueError(
    f"remedy {spec!r} is not a Remedy or a tuple (weight format, kind"
    "[, buffer]), e.g. ('bfloat16', 'kahan', 'float8_e5m2') or "
    "('bfloat16', 'two_component')"
  )


def _string_remedy(spec: str) -> ValueError:
  # The study runner's "weights:kind[:buffer]" is a config string; here a
  # remedy is a tuple, so show the tuple the string spells.
  parts = tuple(p.strip() for p in spec.split(":"))
  fix = parts if len(parts) in (2, 3) else ("bfloat16", "kahan", "bfloat16")
  return ValueError(
    f"remedy {spec!r} is a string; give a tuple (weight format, kind"
    f"[, buffer]), a list or a dict of them, e.g. {fix!r}"
  )


def _is_spec_tuple(spec) -> bool:
  return (
    isinstance(spec, (tuple, list))
    and len(spec) in (2, 3)
    and isinstance(spec[1], str)
  )


def _parse(remedies) -> tuple[tuple[str, Remedy], ...]:
  if isinstance(remedies, str):  # not an iterable of remedies
    raise _string_remedy(remedies)
  return named_specs(
    remedies,
    single=lambda r: isinstance(r, Remedy) or _is_spec_tuple(r),
    convert=_as_remedy,
    what="remedy",
    example="{'kahan_mlp': ([('.*mlp.*', 'bfloat16'), ('.*', None)], "
    "'kahan', 'bfloat16')}",
  )


@dataclasses.dataclass(frozen=True)
class RemedyLayout:
  """Static facts of a compensated trace: names, leaves and their grids."""

  targets: tuple[str, ...]
  leaves: tuple[str, ...]
  formats: tuple[tuple[Format | None, ...], ...]  # [target][leaf]: weight
  buffers: tuple[tuple[Format | None, ...], ...]  # [target][leaf]: buffer
  two_sum: tuple[bool, ...]  # [target]
  sizes: tuple[int, ...]


jax.tree_util.register_static(RemedyLayout)


class CompensatedTraceState(NamedTuple):
  """State of `compensated_trace`: predicted buffers, flags and counts.

  Counts and masses are this step's, per target and leaf, except
  `nearest_frozen`, `late` and `drained`, which count coordinates over the
  run so far; buffers and flags are per target and leaf, shaped like the
  leaf, None where the target leaves the leaf out.
  """

  count: jax.Array  # [] int32: updates seen so far.
  counts: jax.Array  # [T, L, 7] int32: _COUNTS per target and leaf.
  masses: jax.Array  # [T, L, 3] float32: _MASSES per target and leaf.
  # Per target and leaf: the predicted buffer, in the buffer format's
  # native dtype (float32 holding grid values where it has none).
  buffer: tuple[tuple[jax.Array | None, ...], ...]
  flags: tuple[tuple[jax.Array | None, ...], ...]  # uint8, like the leaf.
  layout: RemedyLayout  # static

  def report(self) -> dict[str, Any]:
    """This step's prediction as `{"pred/<target>/...": value}`.

    Per target, for this step: `proposals` (finite `u != 0`), `erased`
    (from the weight: `u != 0` and `w' == q`), `erased_fraction`, `moved`
    (`w' != q`), `lost` (a nonzero residual the buffer's rounding dropped
    entirely), `lost_fraction` (`lost / proposals`), `carried` (sum of
    `|c'|`), `lost_mass` (sum of `|r - c'|`) and `drift` (sum of
    `|w - (q + c)|` before the step: how far the predicted weight and
    buffer lag the reference). Over the run so far, counting coordinates:
    `nearest_frozen` (with proposals, each of them erased by nearest
    write-back without a buffer), `late` (of those, moved by the remedy at
    least once: late rather than never), `late_fraction` (`late /
    nearest_frozen`) and `drained` (with proposals, never moved, and the
    buffer never held anything: every residual lost). Per leaf:
    `erased_fraction/<leaf>`, `proposals/<leaf>`, `lost/<leaf>`,
    `late/<leaf>` and `drained/<leaf>`. Counts are exact integers,
    fractions and masses floats (NaN fractions without a denominator).
    """
    return reports.host(self._collect, self._replace(buffer=(), flags=()))

  def arrays(self) -> dict[str, jax.Array]:
    """The values of `report()` as arrays (int32 counts, float32 ratios
    and masses), traceable inside jit, stacked by `scan`."""
    return reports.traced(self._collect, self)

  @staticmethod
  def _collect(st, xp, ratio, value) -> dict[str, Any]:
    lay = st.layout
    counts = reports.counts(xp, st.counts)
    masses = reports.sums(xp, st.masses)
    out: dict[str, Any] = {}
    for j, pre, on in reports.targets(lay):
      c = {f: counts[..., j, on, k].sum(axis=-1) for k, f in enumerate(_COUNTS)}
      m = {f: masses[..., j, on, k].sum(axis=-1) for k, f in enumerate(_MASSES)}
      for f in _STEP:
        out[pre + f] = value(c[f])
      out[pre + "erased_fraction"] = ratio(c["erased"], c["proposals"])
      out[pre + "lost_fraction"] = ratio(c["lost"], c["proposals"])
      for f in _MASSES:
        out[pre + f] = value(m[f])
      for f in _RUN:
        out[pre + f] = value(c[f])
      out[pre + "late_fraction"] = ratio(c["late"], c["nearest_frozen"])
      at = {f: _COUNTS.index(f) for f in _COUNTS}
      for i in on:
        leaf = lay.leaves[i]
        per = counts[..., j, i, :]
        out[f"{pre}erased_fraction/{leaf}"] = ratio(
          per[..., at["erased"]], per[..., at["proposals"]]
        )
        for f in ("proposals", "lost", "late", "drained"):
          out[f"{pre}{f}/{leaf}"] = value(per[..., at[f]])
    return out


def _weight_format(r: Remedy, path) -> Format | None:
  f = r.leaf_format(path)
  if f is None:
    return None
  name = reports.leaf_name(path)
  if isinstance(f, ScaledFormat):
    raise ValueError(
      f"compensated_trace: parameter {name!r} is on the scaled grid {f}, "
      "whose gap moves with its block's maximum; the prediction covers "
      "unscaled grids. Give that parameter an unscaled format or None"
    )
  if r.kind == "two_component" and not f.is_float:
    raise ValueError(
      f"compensated_trace: parameter {name!r} is on the {f} grid; a "
      "two-component float needs a floating-point grid (use kind='kahan')"
    )
  return f


def compensated_trace(remedies) -> optax.GradientTransformation:
  """Predicts, from a float32 run, what compensated write-backs would do.

  Place it last in a float32 chain (beside `reference_trace`). With `w_t`
  the reference weight, `u_t` its proposal and `q_t = Q_RN(w_t)` the
  weight on the remedy's grid `G`, it carries a predicted buffer `c` on
  the buffer's grid `G_c` (zero at the start) and applies the remedy's
  rule at `q_t`, inside the jitted update:

    Kahan:           y = u + c,  w' = Q_RN(q + y),  r = y - (w' - q),
    two-component:   y = u + c,  s, t = TwoSum(q, y),  w' = Q_RN(s),
                     r = (s - w') + t,

  and `c' = Q_RN,c(r)` (`G_c = G` for the two-component error), as
  `lowprec.kahan_writeback` and `lowprec.two_component_writeback` compute
  it. It counts what their telemetry counts (`proposals`, `erased` from
  the weight, `moved`, `lost`: `r != 0` and `c' == 0`; `carried`,
  `lost_mass`), and per coordinate over the run: the coordinates whose
  every proposal nearest write-back without a buffer erases at `q_t`
  (`nearest_frozen`), those of them the remedy moves at least once
  (`late`: late rather than never), and those whose buffer loses
  everything (`drained`). See `CompensatedTraceState.report`.

  The buffer's gap is relative to `|c|`: a bfloat16 buffer rounds away
  about `2^-9 |r|` (a second-order loss), while a float8 buffer flushes
  residuals below its smallest subnormal and, once `|c|` grows, drops
  proposals below half its own gap there (a first-order loss: the
  coordinate freezes with a full buffer).

  The prediction starts from the compensated arm's state: same initial
  weights (on the grid, or `Q_RN(w_0)`), same first proposal, zero
  buffer, so step 1 counts equal the arm's exactly. Later it follows the
  reference, whose weights the arm tracks to within its buffer's losses:
  `drift` (sum `|w - (q + c)|`) says how far the predicted pair lags the
  reference; where it is large (a buffer that lost mass) the arm's
  weights have left the reference and the prediction describes the
  reference's neighbourhood, not the arm. Weight rounding is nearest.

  Memory: per target, one buffer per parameter (in the buffer's native
  dtype) and a uint8 flag per parameter. Updates pass through unchanged.
  Each target costs about what `kahan_writeback` with telemetry costs,
  twice at most (1M parameters on a CPU).

  Args:
    remedies: a `Remedy`, a tuple `(weight format, kind[, buffer])`, a
      list of these, or a dict `{name: spec}` (needed for per-parameter
      formats). Kinds: "kahan" (buffer: one format, "bfloat16" by
      default, float8 allowed) and "two_component". Default names:
      `bfloat16_kahan_bfloat16`, `bfloat16_two_component` (`remedy_name`).

  Returns:
    An `optax.GradientTransformation` whose state is a
      `CompensatedTraceState`; `lowprec.telemetry(state)` reports
      `pred/<name>/...`.

  Raises:
    ValueError: no or duplicate remedies, a remedy given as a string (the
      message shows the tuple), an unknown kind or format, a buffer wider
      than float32, on an integer grid or scaled; at `init`, a scaled
      weight grid or a two-component remedy on an integer grid; at
      `update`, a missing `params` argument.

  Example:
    ```python
    opt = optax.chain(
        optax.adamw(1e-3),
        lowprec.freeze.reference_trace(["bfloat16"]),
        lowprec.freeze.compensated_trace({
            "kahan_bf16": ("bfloat16", "kahan", "bfloat16"),
            "kahan_e5m2": ("bfloat16", "kahan", "float8_e5m2"),
        }),
    )
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    lowprec.telemetry(state)["pred/kahan_e5m2/lost_fraction"]
    ```

  Reference: Kahan, "Further remarks on reducing truncation errors"
  (1965); Yu et al., "Collage" (ICML 2024); the write-back freezing paper
  (see docs/freeze.md) for the prediction from a float32 run.
  """
  parsed = _parse(remedies)

  def make_layout(params) -> RemedyLayout:
    flat = reports.float_paths(params)
    formats = tuple(
      tuple(_weight_format(r, p) for p, _ in flat) for _, r in parsed
    )
    return RemedyLayout(
      targets=tuple(n for n, _ in parsed),
      leaves=tuple(reports.leaf_name(p) for p, _ in flat),
      formats=formats,
      buffers=tuple(
        tuple(None if f is None else r.buffer_format(f) for f in row)
        for (_, r), row in zip(parsed, formats, strict=True)
      ),
      two_sum=tuple(r.kind == "two_component" for _, r in parsed),
      sizes=tuple(int(np.size(x)) for _, x in flat),
    )

  def init_fn(params):
    lay = make_layout(params)
    ws = reports.float_leaves(params)
    n_t, n_l = len(lay.targets), len(lay.leaves)
    buffers, flags = [], []
    for j in range(n_t):
      bs, fs = [], []
      for i, w in enumerate(ws):
        b = lay.buffers[j][i]
        on = b is not None
        bs.append(jnp.zeros_like(w, stored_dtype(b)) if on else None)
        fs.append(jnp.full_like(w, _FROZEN, jnp.uint8) if on else None)
      buffers.append(tuple(bs))
      flags.append(tuple(fs))
    return CompensatedTraceState(
      count=jnp.zeros([], jnp.int32),
      counts=jnp.zeros([n_t, n_l, len(_COUNTS)], jnp.int32),
      masses=jnp.zeros([n_t, n_l, len(_MASSES)], jnp.float32),
      buffer=tuple(buffers),
      flags=tuple(flags),
      layout=lay,
    )

  def update_fn(updates, state, params=None):
    lay = state.layout
    ws, us = reports.step_leaves(
      "compensated_trace", params, updates, len(lay.leaves)
    )
    buffers, flags, counts, masses = [], [], [], []
    for j in range(len(lay.targets)):
      row = _target_step(state, j, ws, us)
      buffers.append(row[0])
      flags.append(row[1])
      counts.append(row[2])
      masses.append(row[3])
    new = CompensatedTraceState(
      count=optax.safe_increment(state.count),
      counts=jnp.stack(counts).reshape(state.counts.shape),
      masses=jnp.stack(masses).reshape(state.masses.shape),
      buffer=tuple(buffers),
      flags=tuple(flags),
      layout=lay,
    )
    return updates, new

  return optax.GradientTransformation(init_fn, update_fn)


def _target_step(state, j: int, ws, us):
  """New buffers, flags, counts [L, 7] and masses [L, 3] of target j."""
  lay = state.layout
  bs, fs, cs, ms = [], [], [], []
  zero_c = jnp.zeros([len(_COUNTS)], jnp.int32)
  zero_m = jnp.zeros([len(_MASSES)], jnp.float32)
  for i, (w, u) in enumerate(zip(ws, us, strict=True)):
    fmt, buf = lay.formats[j][i], lay.buffers[j][i]
    c, flag = state.buffer[j][i], state.flags[j][i]
    if fmt is None:
      bs.append(None)
      fs.append(None)
      cs.append(zero_c)
      ms.append(zero_m)
      continue
    new_c, new_flag, n, m = _predict_leaf(
      w, u, c, flag, fmt, buf, lay.two_sum[j]
    )
    bs.append(new_c.astype(c.dtype))
    fs.append(new_flag)
    cs.append(jnp.stack(n))
    ms.append(jnp.stack(m))
  counts = jnp.stack(cs) if cs else jnp.zeros([0, len(_COUNTS)], jnp.int32)
  masses = jnp.stack(ms) if ms else jnp.zeros([0, len(_MASSES)], jnp.float32)
  return tuple(bs), tuple(fs), counts, masses


def _predict_leaf(w, u, c, flag, fmt: Format, buf: Format, two_sum: bool):
  """The remedy's step at `q = Q_RN(w)`: new buffer, flags, counts, masses.

  The same arithmetic as `lowprec.compensated` (nonfinite="keep",
  saturating), at the reference weight's grid value instead of the arm's
  weight.
  """
  w = jnp.asarray(w).astype(jnp.float32)
  # Rounded as emitted, also for `q + u` below (see compensated.step).
  u = as_emitted(jnp.asarray(u).astype(jnp.float32))
  c = jnp.asarray(c).astype(jnp.float32)
  q = round_and_flag(w, fmt)[0]
  drift = jnp.where(jnp.isfinite(w) & jnp.isfinite(c), w - (q + c), 0.0)
  st = compensated.step(q, u, c, fmt, buf, two_sum=two_sum)
  delta, new_c, r, written = st.delta, st.new_c, st.residual, st.written
  finite = st.finite
  proposed = (u != 0) & finite
  moved = written & (delta != 0)
  erased = proposed & (delta == 0)
  lost = written & (r != 0) & (new_c == 0)
  # Nearest write-back without a buffer, at the same grid value.
  nearest_moves = proposed & (round_and_flag(q + u, fmt)[0] != q)
  flag = flag & ~_bit(nearest_moves, _FROZEN)
  flag = flag | _bit(moved, _MOVED) | _bit(proposed, _PROPOSED)
  flag = flag | _bit(written & (new_c != 0), _HELD)
  seen = (flag & _PROPOSED) != 0
  frozen = seen & ((flag & _FROZEN) != 0)
  went = (flag & _MOVED) != 0
  bits = (proposed, erased, moved, lost, frozen, frozen & went)
  bits += (seen & ~went & ((flag & _HELD) == 0),)  # drained
  masses = (new_c, jnp.where(written, r - new_c, 0.0), drift)
  # As the compensated write-back counts: one variadic reduction of the
  # masks, then a float32 sum per mass.
  return new_c, flag, counting.count(*bits), [counting.mass(m) for m in masses]


def _bit(mask, value: int) -> jax.Array:
  return jnp.where(mask, jnp.uint8(value), jnp.uint8(0))


# telemetry names this transform when its state is met as plain arrays.
telemetry_lib.register_layout(
  CompensatedTraceState,
  {"count", "counts", "masses", "buffer", "flags"},
  "lowprec.freeze.compensated_trace",
)

"""Optimizer state stored in a low-precision format between steps.

An optimizer's state (Adam's moments `mu` and `nu`, a momentum trace,
Adafactor's factored second moments) is as large as the params, or twice.
`store_state` keeps chosen state leaves on a low-precision grid between
steps: before each update it widens them to float32, runs the inner
transform there, and rounds the new state back,

  stored = Q(s / scale) * scale,

with `Q` nearest, stochastic or dead-zone stochastic rounding into the
leaf's format and `scale` a float32 power of two per block of elements, per
tensor, or 1. Where the format has a dtype (`bfloat16`, `float16`,
`float8_*`) the stored arrays are of that dtype, in memory and in
checkpoints.

A small update of a state leaf can be rounded away just as a small
write-back of a weight is. For Adam's second moment `nu' - nu =
(1 - b2)(g^2 - nu)`: with `b2 = 0.999` that is about `1e-3 nu` once
`g^2 ~ nu`, below half a bfloat16 gap (`2^-9` relative), so nearest
rounding stalls the average well below `g^2`; stochastic rounding keeps it
right in the mean. Telemetry counts these *state erasures* per state leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec import names, scaled
from lowprec import rng as rng_lib
from lowprec.float32_views import _widen as float32_view
from lowprec.formats import Format, get_format
from lowprec.rounding import OVERFLOW_MODES, ROUNDINGS, round_and_flag
from lowprec.storage import is_array, path_name
from lowprec.writeback import _count as count_masks  # one reduction

STORAGES = ("native", "float32")

_COUNTS = ("changed", "erased", "flushed", "saturated", "nonfinite")


@dataclasses.dataclass(frozen=True)
class StateFormat:
  """How one state leaf is stored: grid, rounding and scale.

  Written as a string `"<format>[:<rounding>][:<scale>]"`, e.g.
  `"bfloat16"` (nearest, no scale), `"bfloat16:stochastic"`,
  `"float8_e4m3fn:stochastic:block128"`, `"float8_e5m2:nearest:tensor"`.

  Attributes:
    fmt: the format (a name as `lowprec.get_format` takes it, or a
      `Format`).
    rounding: "nearest" (default), "stochastic" or "deadzone" (stochastic
      only where nearest would round the update away).
    scale: None (values stored as they are), "tensor" (one float32 scale
      per tensor) or a block size such as 128 or 256 (one float32 scale
      per block of that many consecutive elements along the last axis).
  """

  fmt: Any
  rounding: str = "nearest"
  scale: str | int | None = None

  def __post_init__(self):
    object.__setattr__(self, "fmt", get_format(self.fmt))
    names.check_choice("rounding", self.rounding, ROUNDINGS)
    s = self.scale
    if isinstance(s, str) and s.startswith("block") and s[5:].isdigit():
      s = int(s[5:])
      object.__setattr__(self, "scale", s)
    if not (s is None or s == "tensor" or (_is_int(s) and s > 0)):
      raise ValueError(
        f"unknown state scale {s!r}; valid: None, 'tensor', or a block "
        "size such as 128 (written 'block128' in a string spec)"
      )

  def __str__(self) -> str:
    parts = [self.fmt.name, self.rounding]
    if self.scale is not None:
      parts.append("tensor" if self.scale == "tensor" else f"block{self.scale}")
    return ":".join(parts)


def _is_int(x) -> bool:
  return isinstance(x, int | np.integer) and not isinstance(x, bool)


def parse_state_format(spec) -> StateFormat | None:
  """A rule's value as a `StateFormat` (None stays None: left as it is).

  Takes a `StateFormat`, a `Format` (nearest, no scale) or a string
  `"<format>[:<rounding>][:<scale>]"` (see `StateFormat`). An `intK`
  format with a scale, e.g. `"int8:stochastic:block128"`, is the unit grid
  `{-(2^(K-1) - 1), ..., 2^(K-1) - 1}` under that scale.

  Raises:
    TypeError: `spec` is none of these.
    ValueError: an unknown format, rounding or scale, with the valid ones.
  """
  if spec is None or isinstance(spec, StateFormat):
    return spec
  if isinstance(spec, Format):
    return StateFormat(spec)
  if not isinstance(spec, str):
    raise TypeError(
      f"a state rule's value is a string such as 'bfloat16:stochastic', a "
      f"StateFormat or None, got {type(spec).__name__} {spec!r}"
    )
  name, *rest = spec.strip().split(":")
  rounding, scale = "nearest", None
  for part in rest:
    if part in ROUNDINGS:
      rounding = part
    elif part == "tensor" or part.startswith("block"):
      scale = part
    else:
      valid = [*ROUNDINGS, "tensor", "block128", "block256"]
      raise ValueError(
        f"unknown part {part!r} in state spec {spec!r}; after the format "
        f"come a rounding and a scale: {', '.join(valid)}."
        f"{names.suggest(part, valid)} E.g. 'bfloat16:stochastic' or "
        "'float8_e4m3fn:stochastic:block128'"
      )
  # An integer grid under a scale is the unit grid {-K'..K'} (int8: the
  # values -127..127), times the block's or tensor's scale.
  unit = 1.0 if scale is not None and name.startswith("int") else None
  return StateFormat(get_format(name, scale=unit), rounding, scale)


class _Rule(NamedTuple):
  pattern: str
  regex: re.Pattern
  value: StateFormat | None


def _parse_rules(rules) -> tuple[_Rule, ...]:
  if isinstance(rules, Mapping):
    rules = list(rules.items())
  ok = isinstance(rules, list | tuple) and all(
    isinstance(r, list | tuple) and len(r) == 2 and isinstance(r[0], str)
    for r in rules
  )
  if not ok or not rules:
    raise ValueError(
      "store_state takes rules over state paths: a dict or a list of "
      "(regex, spec) pairs, e.g. {'mu': 'bfloat16:stochastic', 'nu': "
      f"'float8_e5m2:stochastic:block128'}}; got {rules!r:.80}"
    )
  out = []
  for pattern, value in rules:
    try:
      # Whole '/'-separated components of the path: 'mu' matches
      # '0/mu/dense/kernel' but not '0/mum/dense/kernel'.
      regex = re.compile(f"(?:.*/)?(?:{pattern})(?:/.*)?")
    except re.error as e:
      raise ValueError(f"bad regex {pattern!r} in state rules: {e}") from e
    out.append(_Rule(pattern, regex, parse_state_format(value)))
  return tuple(out)


class StateCounts(NamedTuple):
  """The step count, key and telemetry of `store_state`, for the last update.

  Counts are dicts from state path ("0/nu/dense/kernel") to an int32
  scalar, one entry per stored leaf; None with `telemetry=False`.
  `arrays()` gives them as arrays (under jit, scan and vmap), `report()` as
  plain numbers; `lowprec.telemetry` finds this node in the optimizer state.
  """

  count: jax.Array  # int32 []: updates so far.
  key: jax.Array | None  # uint32 [2] key data, split each update; None (RN).
  changed: dict[str, jax.Array] | None  # int32 []: finite s' != s.
  erased: dict[str, jax.Array] | None  # int32 []: s' != s, stored stays s.
  flushed: dict[str, jax.Array] | None  # int32 []: s' != 0, stored is 0.
  saturated: dict[str, jax.Array] | None  # int32 []: s' / scale past max.
  nonfinite: dict[str, jax.Array] | None  # int32 []: s' NaN or infinite.

  def arrays(self) -> dict[str, jax.Array]:
    """`report()`'s keys as arrays: int32 counts, float32 fractions."""
    return self._collect(self, jnp, _fraction)

  def report(self) -> dict[str, int | float]:
    """The counts as plain numbers, prefixed `state/`.

    Keys: `state/steps`; totals `state/changed` (finite float32 updates
    that changed a value), `state/erased` (those whose stored value did not
    change), `state/flushed` (nonzero float32 values stored as zero),
    `state/saturated` (rounded past the format's largest value),
    `state/nonfinite` (NaN or infinite float32 values, never counted as
    changes), `state/erased_fraction` (erased / changed, NaN without
    changes); and each of them per state path, `state/erased/<path>`.
    Exact integers and float64 fractions, computed on the host.
    """
    host = jax.device_get(self._replace(key=None))
    out = self._collect(host, np, _host_fraction, wide=np.int64)
    return {k: _host(v) for k, v in out.items()}

  @staticmethod
  def _collect(st, xp, fraction, wide=None) -> dict[str, Any]:
    out = {"state/steps": st.count}
    if st.changed is None:
      return out
    cast = (lambda a: xp.asarray(a).astype(wide)) if wide else xp.asarray
    per = {c: {n: cast(v) for n, v in getattr(st, c).items()} for c in _COUNTS}
    leaves = list(per["changed"])
    zero = cast(0)
    for c in _COUNTS:
      out[f"state/{c}"] = sum((per[c][n] for n in leaves), zero)
    out["state/erased_fraction"] = fraction(
      out["state/erased"], out["state/changed"]
    )
    for n in leaves:
      for c in _COUNTS:
        out[f"state/{c}/{n}"] = per[c][n]
      out[f"state/erased_fraction/{n}"] = fraction(
        per["erased"][n], per["changed"][n]
      )
    return out


def _fraction(num, den):
  den_f = jnp.maximum(den, 1).astype(jnp.float32)
  return jnp.where(den > 0, num.astype(jnp.float32) / den_f, jnp.nan)


def _host_fraction(num, den):
  num, den = np.asarray(num), np.asarray(den)
  if not num.ndim:
    return int(num) / int(den) if den else float("nan")
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def _host(a):
  a = np.asarray(a)
  if a.ndim:
    return a.tolist()
  return float(a) if np.issubdtype(a.dtype, np.floating) else int(a)


class StoredState(NamedTuple):
  """State of `store_state`: the inner state, stored, and its scales."""

  # The inner transform's state, same structure; the leaves a rule stores
  # hold grid values, in the format's dtype (native) or float32.
  inner: Any
  # float32 per stored leaf with a scale, by state path: [] per tensor, or
  # the leaf's shape with its last axis cut into blocks (ceil(n / block)).
  scales: dict[str, jax.Array]
  counts: StateCounts  # step count, key and telemetry.


def store_state(
  inner: optax.GradientTransformation,
  rules,
  *,
  key: jax.Array | None = None,
  storage: str = "native",
  overflow: str = "saturate",
  telemetry: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Stores `inner`'s state leaves in low-precision formats between steps.

  Each update widens the stored leaves to float32, `s = stored * scale`,
  runs `inner.update` on that state, and stores the new state `s'` again:

    stored' = Q(s' / scale') * scale',
    scale'  = 2^ceil(log2(amax / max_E))   (or 1 without a scale),

  where `amax` is the largest finite `|s'|` of the tensor or block and
  `max_E` the format's largest value: the smallest power of two that needs
  no clipping, so `s' / scale'` is exact (in float32's normal range) and a
  scaled leaf never saturates. `Q` is the leaf's rounding:

    nearest:     round to nearest, ties to even (the ml_dtypes cast);
    stochastic:  up with probability (x - lo) / (hi - lo), so E[Q(x)] = x;
    deadzone:    stochastic where nearest would give back the old stored
                 value although s' != s, nearest elsewhere.

  Random bits are 32 per element from a counter-based hash of the step's
  key, the state path and the global element index (as in
  `lowprec.writeback`), so sharded and unsharded runs store the same bits;
  the up-probability is exact in the target's normal range (see
  `lowprec.round_stochastic` for the bias bound below it). `init` stores
  the inner state's initial values (zeros, for most optimizers) with
  nearest rounding.

  Float32. `inner` runs on float32 views of the params and updates, as
  `lowprec.in_float32` runs it (floating leaves narrower than float32 are
  widened exactly; no copy is kept): on bfloat16 or float8 params its
  state leaves that no rule stores are float32 (Adam's `mu` where only
  `nu` is stored), computed in float32, and the proposals are float32, as
  `lowprec.writeback` requires. Narrow state comes only from the rules.

  Rules. `rules` is a dict `{regex: spec}` or a list of `(regex, spec)`
  pairs, in order; the first rule whose regex `re.fullmatch`es one or more
  whole "/"-separated components of a leaf's state path decides it. State
  paths are the "/"-joined key paths of the inner state without the
  `.value` of Flax boxes, e.g. `0/mu/dense/kernel` for `optax.adam` or
  `inner_state/0/nu/w` under `optax.inject_hyperparams`: so `"mu"`
  matches all of Adam's first moment, `"nu/.*bias"` the second moment of
  every bias. A spec is `"<format>[:<rounding>][:<scale>]"` (rounding
  nearest by default; scale `tensor` or `block<N>`; an `intK` format under
  a scale is the unit grid, e.g. `"int8:stochastic:block128"`), a
  `StateFormat`, or
  None to keep matching leaves as they are (an exception before a broader
  rule). Leaves that no rule matches are kept as they are: step counts,
  hyperparameters, Muon's `ns_coeffs`.

  Storage. With `storage="native"` (default) a leaf whose format has a
  dtype of its own width (`bfloat16`, `float16`, `float8_*`) is stored in
  that dtype; others (`eXmY`, `intK`, float6 and float4, which XLA cannot
  convert on every backend) as float32 holding grid values. With
  `"float32"` every leaf is float32 holding grid values. A scaled leaf
  stores `Q(s' / scale')` and its float32 scales beside it.

  Non-finite values of `s'` are counted and stored as the rounding gives
  them: NaN stays NaN; infinities saturate under `overflow="saturate"`, or
  stay infinite (NaN without inf) under `"ieee"`. Values below `2^-126`
  are flushed to zero by float32 arithmetic on backends that flush
  subnormals, such as XLA on CPU.

  Telemetry, per state path and in total, for the last update: `changed`
  (finite `s' != s`), `erased` (changed, and the stored value stayed `s`),
  `flushed` (`s' != 0` stored as 0), `saturated`, `nonfinite`, and
  `erased_fraction`; keys `state/...`, read with `lowprec.telemetry` or
  `lowprec.telemetry_arrays` (see `StateCounts.report`).

  Args:
    inner: an optax transform whose state leaves are arrays (or Python
      values that no rule matches); it runs in float32 (see above).
    rules: see above.
    key: a JAX PRNG key, required when a rule rounds stochastically; kept
      in the state and split every update (`lowprec.reseed` gives each
      member of a `vmap` ensemble its own).
    storage: "native" or "float32" (see above).
    overflow: "saturate" (default: clip to +-max) or "ieee" (inf, or NaN
      where the format has no inf, as a cast does).
    telemetry: keep the counts in the state.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
      `StoredState`; extra arguments of `update` are passed to `inner`.

  Raises:
    TypeError: `inner` is not an optax transform (e.g. `optax.adam`, the
      function, rather than `optax.adam(1e-3)`).
    ValueError: bad rules (a bad regex, format, rounding or scale), a
      random rounding without `key`, unknown storage or overflow mode; at
      `init`, a rule that matches no state leaf, or a rule that stores a
      leaf that is not a floating-point array (a step count, a Python
      number). Each names the rule or leaf and the fix.

  Example:
    ```python
    tx = lowprec.store_state(
        optax.adam(1e-3),
        {"mu": "bfloat16:stochastic", "nu": "bfloat16:stochastic"},
        key=jax.random.key(0))
    state = tx.init(params)  # mu and nu are bfloat16 arrays
    updates, state = tx.update(grads, state, params)
    lowprec.telemetry(state)["state/erased_fraction"]
    ```
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    called = "; call the factory first" if callable(inner) else ""
    raise TypeError(
      "store_state wraps an optax transform (an object with init and "
      f"update, such as optax.adam(1e-3)), got {type(inner).__name__} "
      f"{inner!r:.60}{called}: lowprec.store_state(optax.adam(1e-3), rules)"
    )
  parsed = _parse_rules(rules)
  names.check_choice("storage", storage, STORAGES)
  names.check_choice("overflow mode", overflow, OVERFLOW_MODES)
  random = any(
    r.value is not None and r.value.rounding != "nearest" for r in parsed
  )
  if random:
    key, impl = _key_words(key)
  else:
    key, impl = None, None
  inner = optax.with_extra_args_support(inner)
  store = _Store(storage, overflow)

  def init_fn(params):
    state = inner.init(float32_view(params))
    plan = _plan(parsed, state, check=True)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [x for _, x in flat]
    picked = [i for i, (p, _) in enumerate(flat) if path_name(p) in plan]
    sfs = tuple(plan[path_name(flat[i][0])] for i in picked)
    rounded = _store_all([leaves[i] for i in picked], sfs, store)
    scales = {}
    for i, (stored, scale) in zip(picked, rounded, strict=True):
      leaves[i] = stored
      if scale is not None:
        scales[path_name(flat[i][0])] = scale

    def zeros():
      return {n: jnp.zeros([], jnp.int32) for n in plan} if telemetry else None

    counts = StateCounts(
      jnp.zeros([], jnp.int32), key, **{c: zeros() for c in _COUNTS}
    )
    return StoredState(
      jax.tree_util.tree_unflatten(treedef, leaves), scales, counts
    )

  def update_fn(updates, state, params=None, **extra):
    plan = _plan(parsed, state.inner, check=False)
    widened = _widen(state.inner, plan, state.scales)
    updates, new_inner = inner.update(
      float32_view(updates), widened, float32_view(params), **extra
    )
    step_key, new_key = None, None
    if random:
      pair = jax.random.split(
        jax.random.wrap_key_data(state.counts.key, impl=impl)
      )
      new_key, step_key = jax.random.key_data(pair[0]), pair[1]
    leaf_keys = _leaf_keys(step_key, plan) if random else {}
    old = {
      path_name(p): x
      for p, x in jax.tree_util.tree_flatten_with_path(widened)[0]
    }
    flat, treedef = jax.tree_util.tree_flatten_with_path(new_inner)
    leaves, scales = [], {}
    counts = {c: {} for c in _COUNTS}
    for path, x in flat:
      name = path_name(path)
      sf = plan.get(name)
      if sf is None:
        leaves.append(x)
        continue
      bits = None
      if sf.rounding != "nearest":
        bits = rng_lib.random_bits(leaf_keys[name], jnp.shape(x))
      s_old = old[name]
      s_new = jnp.asarray(x, jnp.float32)
      stored, scale, flags = store.round(s_new, sf, bits, s_old)
      leaves.append(stored)
      if scale is not None:
        scales[name] = scale
      if telemetry:
        for c, v in zip(_COUNTS, flags, strict=True):
          counts[c][name] = v
    if not telemetry:
      counts = dict.fromkeys(_COUNTS)
    new_counts = StateCounts(
      optax.safe_increment(state.counts.count), new_key, **counts
    )
    new_state = StoredState(
      jax.tree_util.tree_unflatten(treedef, leaves), scales, new_counts
    )
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# One compiled program for the initial state, not one dispatch per
# operation (init usually runs eagerly).
@functools.partial(jax.jit, static_argnums=(1, 2))
def _store_all(xs, sfs, store):
  return [
    store.round(jnp.asarray(x, jnp.float32), sf, None)[:2]
    for x, sf in zip(xs, sfs, strict=True)
  ]


def _key_words(key):
  if key is None:
    raise ValueError(
      "store_state with a stochastic or deadzone rule draws random bits "
      "and needs a PRNG key: pass key=jax.random.key(seed)"
    )
  words = rng_lib.key_words(key)
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  return words, jax.random.key_impl(key) if typed else None


def _seed(name: str) -> int:
  # Keyed by state path, as writeback keys by parameter path.
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _leaf_keys(step_key, plan) -> dict[str, jax.Array]:
  """`fold_in(step_key, _seed(path))` of every randomly rounded leaf, in
  one vectorized fold (one threefry program rather than one per leaf)."""
  names = [n for n, sf in plan.items() if sf.rounding != "nearest"]
  if not names:
    return {}
  seeds = jnp.asarray([_seed(n) for n in names], jnp.uint32)
  fold = jax.vmap(lambda s: jax.random.fold_in(step_key, s))
  words = jax.random.key_data(fold(seeds))
  return {n: words[i] for i, n in enumerate(names)}


def _plan(rules, state, *, check: bool) -> dict[str, StateFormat]:
  """State path -> format of every stored leaf, in leaf order.

  With `check`, raises for a rule that matches no leaf and for a stored
  leaf that is not a floating-point array.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  plan, used = {}, set()
  for path, x in flat:
    name = path_name(path)
    hits = [r for r in rules if r.regex.fullmatch(name)]
    used.update(r.pattern for r in hits)
    if not hits or hits[0].value is None:
      continue
    if check:
      _check_leaf(name, x, hits[0])
    plan[name] = hits[0].value
  if check:
    unused = [r.pattern for r in rules if r.pattern not in used]
    if unused:
      paths = [path_name(p) for p, _ in flat]
      shown = ", ".join(repr(p) for p in paths[:10])
      more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
      raise ValueError(
        f"store_state rule {unused[0]!r} matches no state leaf of the inner "
        f"transform (its leaves: {shown or 'none'}{more}); a rule's regex "
        "must re.fullmatch one or more whole '/'-separated components of a "
        "state path. Fix the regex or drop the rule"
      )
  return plan


def _check_leaf(name: str, x, rule: _Rule) -> None:
  if is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
    return
  what = (
    f"holds {np.dtype(x.dtype).name} values"
    if is_array(x)
    else f"is a {type(x).__name__}, not an array"
  )
  count = " (a step count)" if name.split("/")[-1] == "count" else ""
  raise ValueError(
    f"store_state rule {rule.pattern!r} matches state leaf {name!r}, which "
    f"{what}{count}: only floating-point state arrays are stored in a "
    f"low-precision format. Narrow the rule, or put ({name!r}, None) "
    "before it to keep that leaf as it is"
  )


def _widen(state, plan, scales):
  """The state with every stored leaf as float32 `stored * scale`.

  The inner transform reads the product through a select (which returns
  every value, NaN as NaN), as it reads a float32 state it was handed.
  XLA:CPU contracts a multiply feeding an add in the same fusion into an
  FMA, and when the scale multiply is fused into Adam's `b2 * nu + (1 -
  b2) g^2` the other product gets contracted instead, 1 ulp apart in a
  few percent of the elements; whether it is fused depends on the shapes,
  so on the sharding (one block per device fuses, several do not). An
  FMA contracts only a multiply that is its operand.
  """

  def one(path, x):
    name = path_name(path)
    if name not in plan:
      return x
    s = jnp.asarray(x).astype(jnp.float32)
    if name in scales:
      s = s * _spread(scales[name], s.shape, plan[name].scale)
      s = jnp.where(jnp.isnan(s), jnp.float32(jnp.nan), s)
    return s

  return jax.tree_util.tree_map_with_path(one, state)


def _spread(scale, shape, how):
  """Per-element scales from per-block or per-tensor ones."""
  if how == "tensor" or not shape:
    return scale
  return jnp.repeat(scale, how, axis=-1)[..., : shape[-1]]


@dataclasses.dataclass(frozen=True)
class _Store:
  """The storage of one leaf: scale, rounding, stored dtype and counts."""

  storage: str
  overflow: str

  def dtype(self, fmt: Format):
    native = fmt.native_dtype
    if (
      self.storage == "native"
      and native is not None
      and fmt.bits == 8 * native.itemsize
    ):
      return native
    return np.dtype(np.float32)

  def round(self, s, sf: StateFormat, bits, s_old=None):
    """`(stored, scale or None, counts or None)` of float32 values `s`;
    counts (`_COUNTS`) need the old widened values `s_old`."""
    fmt = sf.fmt
    scale = None if sf.scale is None else _scale(s, fmt, sf.scale)
    per = 1.0 if scale is None else _spread(scale, s.shape, sf.scale)
    x = s / per if scale is not None else s
    sr = bits if sf.rounding == "stochastic" else None
    q, over = round_and_flag(x, fmt, sr, overflow=self.overflow)
    v = q if scale is None else q * per  # what the next update will see
    if sf.rounding == "deadzone" and s_old is not None:
      q_sr, over_sr = round_and_flag(x, fmt, bits, overflow=self.overflow)
      lost = (v == s_old) & (s != s_old)
      q = jnp.where(lost, q_sr, q)
      over = jnp.where(lost, over_sr, over)
      v = q if scale is None else q * per
    stored = q.astype(self.dtype(fmt))
    if s_old is None:
      return stored, scale, None
    finite = jnp.isfinite(s)
    changed = finite & (s != s_old)
    flags = (
      changed,
      changed & (v == s_old),
      finite & (s != 0) & (v == 0),
      over & finite,
      ~finite,
    )
    return stored, scale, count_masks(*flags)


def _scale(s, fmt: Format, how):
  """float32 powers of two `p`, smallest with `amax / p <= max_E`."""
  a = jnp.where(jnp.isfinite(s), jnp.abs(s), 0.0)
  if how == "tensor" or not s.shape:
    amax = jnp.max(a, initial=0.0)
  else:
    n = s.shape[-1]
    blocks = -(-n // how)
    pad = [(0, 0)] * (s.ndim - 1) + [(0, blocks * how - n)]
    a = jnp.pad(a, pad).reshape(*s.shape[:-1], blocks, how)
    amax = jnp.max(a, axis=-1, initial=0.0)
  # The no-clip rule of lowprec.scaled, within float32's normal range.
  k = scaled.pow2_exponent(amax, fmt.max_finite, "noclip", lo=-126, hi=127)
  return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)

"""Optimizer state stored in a low-precision format between steps.

An optimizer's state (Adam's moments `mu` and `nu`, a momentum trace,
Adafactor's factored second moments) is as large as the params, or twice.
`store_state` keeps chosen state leaves on a low-precision grid between
steps: before each update it widens them to float32, runs the inner
transform there, and rounds the new state back,

  stored = Q(s / scale) * scale,

with `Q` nearest, stochastic or dead-zone stochastic rounding into the
leaf's format and `scale` per block of elements, per tensor, or 1: a
float32 power of two, or `amax / max_E` (`"...:block256:amax"`). Where the
format has a dtype (`bfloat16`, `float16`, `float8_*`) the stored arrays
are of that dtype, in memory and in checkpoints. The 8- and 4-bit states
of PyTorch's optimizers are code maps (`lowprec.codemaps`): a byte per
element (half a byte for 4-bit codes, two to a byte) and one scale per
block, e.g. `"dynamic8:block256"`.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowprec.engine import counting, record, stacked
from lowprec.engine import rules as rules_lib
from lowprec.engine.codec import (
  SCALE_DTYPES,
  SCALE_RULES,
  Codec,
  Encoded,
  decode,
  encode,
  pack,
  tally,
  unpack,
)
from lowprec.engine.weights import path_name
from lowprec.grids import choices, codemaps
from lowprec.grids import rng as rng_lib
from lowprec.grids.formats import Format, get_format
from lowprec.grids.rounding import OVERFLOW_MODES, ROUNDINGS
from lowprec.optim.float32_views import _widen as float32_view

STORAGES = ("native", "float32")

_COUNTS = ("changed", "erased", "flushed", "saturated", "nonfinite")
_RATIO = ("erased_fraction", "erased", "changed")
# Kept per leaf like the counts, reported as a share of `changed` only.
_FIELDS = (*_COUNTS, "stalled")


@dataclasses.dataclass(frozen=True)
class StateFormat:
  """How one state leaf is stored: grid or code map, rounding and scale.

  Written as a string `"<format>[:<rounding>][:<scale>][:<rule>][:<dtype>]"`,
  e.g. `"bfloat16"` (nearest, no scale), `"bfloat16:stochastic"`,
  `"float8_e4m3fn:stochastic:block128"` (power-of-two scales),
  `"float8_e4m3fn:nearest:block256:amax"` (scales `amax / 448`, torchao's
  AdamWFp8), `"dynamic8:block256"` (bitsandbytes' dynamic map),
  `"companded8:block32"` and `"sqrt8:block32"` (FlashOptim's moments),
  `"dynamic4:block128"` and `"uint4nz:block128"` (4-bit moments).

  Attributes:
    fmt: the format (a name as `lowprec.get_format` takes it, or a
      `Format`), or a code map (a name of `lowprec.grids.codemaps.MAPS`, or a
      `CodeMap`).
    rounding: "nearest" (default), "stochastic" or "deadzone" (stochastic
      only where nearest would round the update away).
    scale: None (values stored as they are), "tensor" (one scale per
      tensor) or a block size such as 128 or 256 (one scale per block of
      that many consecutive elements along the last axis). A code map
      needs one.
    scale_rule: "pow2" (a power of two, the default for a format) or
      "amax" (`amax / max_E`; a code map's, and its only one).
    scale_dtype: "float32" or "float16" (amax only); None: float32, or the
      code map's own (float16 for `companded8` and `sqrt8`).
  """

  fmt: Any
  rounding: str = "nearest"
  scale: str | int | None = None
  scale_rule: str | None = None
  scale_dtype: str | None = None

  def __post_init__(self):
    mapped = codemaps.is_map(self.fmt)
    fmt = codemaps.get_map(self.fmt) if mapped else get_format(self.fmt)
    object.__setattr__(self, "fmt", fmt)
    choices.check_choice("rounding", self.rounding, ROUNDINGS)
    s = self.scale
    if isinstance(s, str) and s.startswith("block") and s[5:].isdigit():
      s = int(s[5:])
      object.__setattr__(self, "scale", s)
    if not (s is None or s == "tensor" or (_is_int(s) and s > 0)):
      raise ValueError(
        f"unknown state scale {s!r}; valid: None, 'tensor', or a block "
        "size such as 128 (written 'block128' in a string spec)"
      )
    rule = self.scale_rule or ("amax" if mapped else "pow2")
    choices.check_choice("scale rule", rule, SCALE_RULES)
    dtype = self.scale_dtype or (fmt.scale_dtype if mapped else "float32")
    choices.check_choice("scale dtype", dtype, SCALE_DTYPES)
    object.__setattr__(self, "scale_rule", rule)
    object.__setattr__(self, "scale_dtype", dtype)
    if mapped and (s is None or rule != "amax"):
      where = "tensor" if s == "tensor" else f"block{s}"
      raise ValueError(
        f"code map {fmt.name!r} is normalized by the largest magnitude of "
        f"each block (or tensor): give a scale, e.g. '{fmt.name}:block256' "
        f"or '{fmt.name}:tensor'; its scale rule is amax"
        if s is None
        else f"code map {fmt.name!r} takes amax scales only (the block's "
        f"largest magnitude), not {rule!r}: '{fmt.name}:{where}'"
      )
    if rule == "amax" and s is None:
      raise ValueError(
        f"the amax scale rule needs a scale: e.g. '{fmt.name}:nearest:"
        "block256:amax' or ':tensor:amax'"
      )
    if dtype == "float16" and rule != "amax":
      raise ValueError(
        "float16 scales are rounded-up amax scales: add ':amax' (power-of-"
        "two scales are float32)"
      )

  @property
  def mapped(self) -> bool:
    """Whether the leaf is stored as the codes of a code map."""
    return isinstance(self.fmt, codemaps.CodeMap)

  def codec(self, storage: str = "native", overflow: str = "saturate") -> Codec:
    """The `lowprec.engine.codec.Codec` of a leaf stored this way."""
    return Codec(
      self.fmt,
      self.rounding,
      self.scale,
      overflow,
      storage,
      scale_rule=self.scale_rule,
      scale_dtype=self.scale_dtype,
    )

  def __str__(self) -> str:
    parts = [self.fmt.name, self.rounding]
    if self.scale is not None:
      parts.append("tensor" if self.scale == "tensor" else f"block{self.scale}")
    if self.scale_rule == "amax" and not self.mapped:
      parts.append("amax")
    default = self.fmt.scale_dtype if self.mapped else "float32"
    if self.scale_dtype != default:
      parts.append(self.scale_dtype)
    return ":".join(parts)


def _is_int(x) -> bool:
  return isinstance(x, int | np.integer) and not isinstance(x, bool)


def parse_state_format(spec) -> StateFormat | None:
  """A rule's value as a `StateFormat` (None stays None: left as it is).

  Takes a `StateFormat`, a `Format` (nearest, no scale) or a string
  `"<format>[:<rounding>][:<scale>][:<rule>][:<dtype>]"` (see
  `StateFormat`), the parts after the format in any order, each kind at
  most once. An `intK` format takes a scale, e.g.
  `"int8:stochastic:block128"`: the unit grid `{-(2^(K-1) - 1), ...,
  2^(K-1) - 1}` under that scale (stored as int8 codes under an amax
  scale, `"int4:nearest:block128:amax"`). The format
  may be a code map of `lowprec.codemaps`: `"dynamic8:block256"`,
  `"dynamic4:block128"`, `"companded8:block32"`, `"sqrt8:block32"`,
  `"uint4nz:block128"`.

  Raises:
    TypeError: `spec` is none of these.
    ValueError: an unknown format, code map, rounding, scale, scale rule
      or scale dtype, with the valid ones; a kind of part given twice
      (`"bfloat16:stochastic:nearest"`), naming the two specs it may mean;
      an `intK` format without a scale, naming the specs with one.
  """
  if spec is None or isinstance(spec, StateFormat):
    return spec
  if isinstance(spec, Format | codemaps.CodeMap):
    return StateFormat(spec)
  if not isinstance(spec, str):
    raise TypeError(
      f"a state rule's value is a string such as 'bfloat16:stochastic', a "
      f"StateFormat or None, got {type(spec).__name__} {spec!r}"
    )
  name, *rest = spec.strip().split(":")
  given = {}  # kind -> (index in rest, part)
  for i, part in enumerate(rest):
    kind = _part_kind(part)
    if kind is None:
      valid = [*ROUNDINGS, "tensor", "block128", "block256"]
      valid += [*SCALE_RULES, *SCALE_DTYPES]
      raise ValueError(
        f"unknown part {part!r} in state spec {spec!r}; after the format "
        f"come a rounding, a scale, a scale rule and a scale dtype: "
        f"{', '.join(valid)}.{choices.suggest(part, valid)} E.g. "
        "'bfloat16:stochastic', 'float8_e4m3fn:stochastic:block128' or "
        "'float8_e4m3fn:nearest:block256:amax'"
      )
    if kind in given:
      _refuse_twice(spec, name, rest, kind, given[kind][0], i)
    given[kind] = (i, part)
  rounding = given.get("rounding", (0, "nearest"))[1]
  scale, rule, dtype = (
    given.get(k, (0, None))[1] for k in ("scale", "scale rule", "scale dtype")
  )
  if codemaps.is_map(name):
    return StateFormat(name, rounding, scale, rule, dtype)
  # An integer grid under a scale is the unit grid {-K'..K'} (int8: the
  # values -127..127), times the block's or tensor's scale.
  if scale is None and re.fullmatch(r"int\d+", name):
    shown = ":".join([name, rounding, "block128"])
    raise ValueError(
      f"state spec {spec!r}: an integer grid {name!r} in a state spec is "
      "the unit grid under a scale per block or per tensor; give one, e.g. "
      f"{shown!r} or {shown.replace('block128', 'tensor')!r}"
    )
  unit = 1.0 if scale is not None and name.startswith("int") else None
  fmt = get_format(name, scale=unit, also_valid=codemaps.MAPS)
  return StateFormat(fmt, rounding, scale, rule, dtype)


def _part_kind(part: str) -> str | None:
  """Which part of a state spec `part` is (None: none)."""
  if part in ROUNDINGS:
    return "rounding"
  if part == "tensor" or part.startswith("block"):
    return "scale"
  if part in SCALE_RULES:
    return "scale rule"
  if part in SCALE_DTYPES:
    return "scale dtype"
  return None


def _refuse_twice(spec, name, rest, kind, first, second):
  """Raises for a state spec that gives one kind of part twice."""
  keep = [
    ":".join([name, *(p for j, p in enumerate(rest) if j != drop)])
    for drop in (second, first)
  ]
  fix = f"{keep[0]!r}" if keep[0] == keep[1] else f"{keep[0]!r} or {keep[1]!r}"
  raise ValueError(
    f"state spec {spec!r} gives the {kind} twice ({rest[first]!r} and "
    f"{rest[second]!r}); give one {kind}: {fix}"
  )


# State path components of signed moments, which an unsigned code map
# (sqrt8, uint4nz) would clip at 0: Adam's and Lion's `mu`, a momentum
# `trace`.
_SIGNED_STATES = ("mu", "trace", "momentum")


def check_moments(plan: dict) -> None:
  """Raises for a rule that gives an unsigned code map to a leaf that
  is a signed moment by its name (`mu`, `trace`, `momentum`).

  Raises:
    ValueError: naming the leaf, the map and a signed map for it.
  """
  for name, sf in plan.items():
    if not sf.mapped or sf.fmt.signed:
      continue
    hit = [c for c in name.split("/") if c in _SIGNED_STATES]
    if hit:
      raise ValueError(
        f"state leaf {name!r} is a first moment ({hit[0]!r}), which takes "
        f"negative values, but its rule stores it with {sf.fmt.name!r}, a "
        "map of nonnegative values (second moments such as nu): use a "
        "signed map for it, e.g. 'companded8:block32', 'dynamic8:block256' "
        "or 'dynamic4:block128', and keep "
        f"{sf.fmt.name!r} for nu"
      )


def _check_by_inner(state, plan: dict) -> None:
  """Lets each node of the inner state with a say in how it is stored
  (a method `check_stored(path, plan)`: `lowprec.eco`'s state, whose
  first moment holds its folds) refuse the plan."""

  def says(x) -> bool:
    return hasattr(type(x), "check_stored") and not isinstance(x, type)

  nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=says)[0]
  for path, node in nodes:
    if says(node):
      node.check_stored(path_name(path), plan)


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
  stalled: dict[str, jax.Array] | None  # int32 []: s' != s, code stays.

  def arrays(self) -> dict[str, jax.Array]:
    """`report()`'s keys as arrays: int32 counts, float32 fractions."""
    out = counting.of_state(
      self, _COUNTS, ratio=_RATIO, prefix="state/", host=False
    )
    return {**out, **_stalled_fractions(self, counting.fraction)}

  def report(self) -> dict[str, int | float]:
    """The counts as plain numbers, prefixed `state/`.

    Keys: `state/steps`; totals `state/changed` (finite float32 updates
    that changed a value), `state/erased` (those whose stored value did not
    change), `state/flushed` (nonzero float32 values stored as zero),
    `state/saturated` (rounded past the format's largest value),
    `state/nonfinite` (NaN or infinite float32 values, never counted as
    changes), `state/erased_fraction` (erased / changed, NaN without
    changes), `state/stalled_fraction` (the share of the changed values
    whose stored code stayed: see `store_state`); and each of them per
    state path, `state/erased/<path>`. Exact integers and float64
    fractions, computed on the host.
    """
    host = jax.device_get(self._replace(key=None))
    out = counting.of_state(
      host, _COUNTS, ratio=_RATIO, prefix="state/", host=True
    )
    return {**out, **_stalled_fractions(host, counting.host_fraction)}


def _stalled_fractions(counts: StateCounts, fraction) -> dict:
  """`state/stalled_fraction` (stalled / changed), in total and per path;
  `fraction` is `counting.fraction` (arrays) or `host_fraction`."""
  if counts.stalled is None:
    return {}
  host = fraction is counting.host_fraction
  total = functools.partial(sum, start=np.int64(0) if host else 0)
  wide = (lambda a: np.asarray(a, np.int64)) if host else (lambda a: a)
  stalled = {n: wide(v) for n, v in counts.stalled.items()}
  changed = {n: wide(v) for n, v in counts.changed.items()}
  out = {
    "state/stalled_fraction": fraction(
      total(stalled.values()), total(changed.values())
    )
  }
  for n in stalled:
    out[f"state/stalled_fraction/{n}"] = fraction(stalled[n], changed[n])
  return out


class StoredState(NamedTuple):
  """State of `store_state`: the inner state, stored, its scales, and the
  recipe that stored it (`lowprec.record`)."""

  # The inner transform's state, same structure; the leaves a rule stores
  # hold grid values, in the format's dtype (native) or float32.
  inner: Any
  # float32 per stored leaf with a scale, by state path: [] per tensor, or
  # the leaf's shape with its last axis cut into blocks (ceil(n / block)).
  scales: dict[str, jax.Array]
  counts: StateCounts  # step count, key and telemetry.
  # Static (no arrays): each stored leaf's spec, checked at every update.
  recipe: record.Recipe


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
  scaled leaf never saturates. Under the `amax` rule `scale' = amax /
  max_E` (float32, or rounded up to a float16), torchao's fp8 states. A
  code map (`dynamic8`, `dynamic8u`, `dynamic4`, `companded8`, `sqrt8`,
  `uint4nz`: the 8- and 4-bit states of bitsandbytes, torchao and
  FlashOptim, `lowprec.codemaps`) stores a uint8 or int8 code per element
  and the block's largest magnitude. `Q` is the leaf's rounding:

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
  every bias. A spec is `"<format>[:<rounding>][:<scale>][:<rule>]
  [:<dtype>]"` (rounding nearest by default; scale `tensor` or
  `block<N>`; rule `pow2` or `amax`; scale dtype `float32` or `float16`;
  an `intK` format under a scale is the unit grid, e.g.
  `"int8:stochastic:block128"`; a code map in place of the format, e.g.
  `"dynamic8:block256"`, see `StateFormat`), a `StateFormat`, or
  None to keep matching leaves as they are (an exception before a broader
  rule). Leaves that no rule matches are kept as they are: step counts,
  hyperparameters, Muon's `ns_coeffs`.

  Storage. With `storage="native"` (default) a leaf whose format has a
  dtype of its own width (`bfloat16`, `float16`, `float8_*`) is stored in
  that dtype; others (`eXmY`, `intK`, float6 and float4, which XLA cannot
  convert on every backend) as float32 holding grid values; a code map's
  codes and an `intK` grid under `amax` scales as uint8 or int8. With
  `"float32"` every leaf is float32 holding grid values (or codes). A
  scaled leaf stores `Q(s' / scale')` and its scales beside it.

  Non-finite values of `s'` are counted and stored as the rounding gives
  them: NaN stays NaN; infinities saturate under `overflow="saturate"`, or
  stay infinite (NaN without inf) under `"ieee"`. Values below `2^-126`
  are flushed to zero by float32 arithmetic on backends that flush
  subnormals, such as XLA on CPU.

  Telemetry, per state path and in total, for the last update: `changed`
  (finite `s' != s`), `erased` (changed, and the stored value stayed `s`),
  `flushed` (`s' != 0` stored as 0), `saturated`, `nonfinite`,
  `erased_fraction`, and `stalled_fraction`: the share of the changed
  values whose stored code stayed (the grid value under its scale, or a
  code map's code). Without a scale a stall is an erasure; under a scale
  that follows the block's largest value (`amax`, code maps) the scale,
  and with it every stored value of the block, moves at almost every
  step, so few updates are erased while most codes stall. Keys
  `state/...`, read with `lowprec.telemetry` or
  `lowprec.telemetry_arrays` (see `StateCounts.report`).

  Recipe. The state records each stored leaf's spec (`StoredState.recipe`,
  static: no arrays), and `update` refuses a state recorded under other
  specs: codes read under another recipe stand for other values. A
  checkpoint's arrays do not hold the record (see `lowprec.record`).

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
    ValueError: bad rules (a bad regex, format, code map, rounding,
      scale, scale rule or scale dtype), a random rounding without `key`,
      unknown storage or overflow mode; at `init`, a rule that matches no
      state leaf, a rule that stores a leaf that is not a floating-point
      array (a step count, a Python number), or a map of nonnegative
      values (`sqrt8`, `uint4nz`, `dynamic8u`) on a first moment (`mu`,
      `trace`, `momentum`), or a first moment of a `lowprec.eco` inside
      stored other than stochastically (the store would round eco's fold
      away); at `update`, a state stored under other specs (naming
      both). Each names the rule or leaf and the fix.

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
  parsed = parse_rules(rules)
  choices.check_choice("storage", storage, STORAGES)
  choices.check_choice("overflow mode", overflow, OVERFLOW_MODES)
  key_state = None
  if any(r.value is not None and r.value.rounding != "nearest" for r in parsed):
    key_state = rng_lib.state_key(
      key, "store_state with a stochastic or deadzone rule"
    )
  inner = optax.with_extra_args_support(inner)

  def codecs(state, check, shapes):
    plan = rules_lib.plan(parsed, state, check=check)
    if check:
      stacked.refuse("store_state", plan)
      check_moments(plan)
      _check_by_inner(state, plan)
    by_name = {n: sf.codec(storage, overflow) for n, sf in plan.items()}
    recipe = record.Recipe(
      "store_state",
      tuple((n, str(sf)) for n, sf in plan.items()),
      tuple((n, shapes[n]) for n, c in by_name.items() if c.packed),
    )
    return by_name, recipe

  def init_fn(params):
    state = inner.init(float32_view(params))
    picked = _leaves(state)
    shapes = {n: tuple(jnp.shape(x)) for n, x in picked.items()}
    plan, recipe = codecs(state, True, shapes)
    picked = {n: x for n, x in picked.items() if n in plan}
    codes, scales = _store_all(tuple(plan.items()), picked)
    stored, _, _ = _map_stored(plan, state, lambda n, c, x: (codes[n], None))
    zeros = dict.fromkeys(plan, jnp.zeros([], jnp.int32)) if telemetry else None
    words = None if key_state is None else key_state[0]
    counts = StateCounts(
      jnp.zeros([], jnp.int32), words, **dict.fromkeys(_FIELDS, zeros)
    )
    return StoredState(stored, scales, counts, recipe)

  def update_fn(updates, state, params=None, **extra):
    # The shapes packed codes unpack to are the state's record.
    shapes = dict(getattr(state.recipe, "shapes", ()))
    plan, recipe = codecs(state.inner, False, _Shapes(shapes))
    record.check(
      getattr(state, "recipe", None),
      recipe,
      "Continue the state with store_state built with the recorded specs, "
      "or start a new state with init",
    )
    # Each stored leaf's codes, one to an element (4-bit ones unpacked
    # once): what is widened, and what the counts compare with.
    old_codes = {
      n: unpack(plan[n], c, shapes.get(n))
      for n, c in _leaves(state.inner).items()
      if n in plan
    }
    widened = _widen(state.inner, plan, state.scales, old_codes)
    updates, new_inner = inner.update(
      float32_view(updates), widened, float32_view(params), **extra
    )
    new_key, keys = None, {}
    if key_state is not None:
      new_key, step_key = rng_lib.next_step(state.counts.key, key_state[1])
      keys = rng_lib.leaf_keys(
        step_key, [n for n, c in plan.items() if c.random]
      )
    old = _leaves(widened)

    def store(name, codec, x):
      bits = None
      if codec.random:
        bits = rng_lib.random_bits(keys[name], jnp.shape(x))
      enc = encode(codec, x, old[name], bits)
      if not telemetry:
        return enc, None
      return enc, _state_counts(x, old[name], enc, old_codes[name])

    new_inner, scales, per = _map_stored(plan, new_inner, store)
    counts = counting.by_field(per, _FIELDS, telemetry)
    new_counts = StateCounts(
      optax.safe_increment(state.counts.count), new_key, **counts
    )
    return updates, StoredState(new_inner, scales, new_counts, recipe)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def parse_rules(rules) -> tuple[rules_lib.StateRule, ...]:
  """`store_state`'s rules, compiled (state dialect of `lowprec.rules`)."""
  return rules_lib.state_rules(rules, parse_state_format)


def _leaves(tree) -> dict[str, jax.Array]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_name(p): x for p, x in flat}


def _map_stored(plan, state, store):
  """`state` with every planned leaf replaced by `store(name, codec,
  float32 value)`'s code; the scales and the second results by name."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  leaves, scales, second = [], {}, {}
  for path, x in flat:
    name = path_name(path)
    if name not in plan:
      leaves.append(x)
      continue
    enc, second[name] = store(name, plan[name], jnp.asarray(x, jnp.float32))
    if not isinstance(enc, Encoded):  # a code stored already
      leaves.append(enc)
      continue
    leaves.append(pack(plan[name], enc.code))
    if enc.scales is not None:
      scales[name] = enc.scales
  return jax.tree_util.tree_unflatten(treedef, leaves), scales, second


def _state_counts(s, s_old, enc, code_old):
  """`_FIELDS` of one stored leaf: new float32 values `s`, old `s_old`,
  the old stored code `code_old`."""
  return tally(*_state_masks(s, s_old, enc.value, enc.over, enc.code, code_old))


def _state_masks(s, s_old, v, over, code, code_old) -> tuple:
  """The entries each of `_FIELDS` counts: new float32 values `s`, old
  `s_old`, the new stored value `v`, its overflow flag `over`, the new
  and the old stored codes."""
  finite = jnp.isfinite(s)
  changed = finite & (s != s_old)
  # Codes as numbers (the grid value under the scale, or a map's code):
  # +0 and -0 are one code, as they are one value.
  same_code = code.astype(jnp.float32) == code_old.astype(jnp.float32)
  return (
    changed,
    changed & (v == s_old),
    finite & (s != 0) & (v == 0),
    over & finite,
    ~finite,
    changed & same_code,
  )


# One compiled program for the initial state, not one dispatch per
# operation (init usually runs eagerly).
@functools.partial(jax.jit, static_argnums=0)
def _store_all(plan, xs):
  """`({name: code}, {name: scales})` of the leaves `xs` by `plan`, a
  tuple of `(name, codec)` pairs."""
  codes, scales = {}, {}
  for name, codec in plan:
    enc = encode(codec, jnp.asarray(xs[name], jnp.float32))
    codes[name] = pack(codec, enc.code)
    if enc.scales is not None:
      scales[name] = enc.scales
  return codes, scales


def unpacked(state):
  """`state` with the codes of every `store_state` state in it one to an
  element: the 4-bit codes kept two to a byte (`Codec.packed`) unpacked
  to the shapes its record holds, every other leaf as it is. For reading
  codes (the golden records compare these); not a state to update."""

  def one(node):
    if not isinstance(node, StoredState) or not node.recipe.shapes:
      return node
    shapes, specs = dict(node.recipe.shapes), dict(node.recipe.entries)
    flat, treedef = jax.tree_util.tree_flatten_with_path(node.inner)
    leaves = []
    for path, x in flat:
      name = path_name(path)
      if name in shapes:  # only native storage packs
        codec = parse_state_format(specs[name]).codec("native", "saturate")
        x = unpack(codec, x, shapes[name])
      leaves.append(x)
    return node._replace(inner=jax.tree_util.tree_unflatten(treedef, leaves))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, StoredState))


class _Shapes(dict):
  """The recorded shapes of packed leaves; a missing one names the fix."""

  def __missing__(self, name):
    raise ValueError(
      f"store_state: state leaf {name!r} holds 4-bit codes two to a byte, "
      "and the state's recipe record has no shape to unpack them to (a "
      "state made before codes were packed, or restored without its "
      "record): restore it into a template made by this transform's init"
    )


def _widen(state, plan, scales, codes):
  """The state with every stored leaf as float32 `stored * scale`, read
  from `codes` (`{name: codes one to an element}`)
  (`lowprec.engine.codec.decode`, which reads the product through a select: an
  FMA in the inner transform then contracts the same product of its own
  on one device and on eight)."""

  def one(path, x):
    name = path_name(path)
    if name not in plan:
      return x
    return decode(plan[name], codes[name], scales.get(name))

  return jax.tree_util.tree_map_with_path(one, state)

"""The optax chain of a run, built from the config's `opt` and `lowprec`."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowprec
from lowprec.engine.weights import path_name
from lowprec.grids import choices as names
from lowprec.optim.stored_state import parse_state_format


def _constant(opt, warmup: int, steps: int) -> optax.Schedule:
  del steps
  if warmup == 0:
    return optax.constant_schedule(opt.lr)
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, opt.lr, warmup),
      optax.constant_schedule(opt.lr),
    ],
    [warmup],
  )


def _cosine(opt, warmup: int, steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0 if warmup else opt.lr,
    peak_value=opt.lr,
    warmup_steps=warmup,
    decay_steps=max(steps, warmup + 1),
    end_value=opt.lr * opt.min_lr_ratio,
  )


# opt.schedule -> (opt, warmup steps, run steps) -> schedule
SCHEDULES = {"cosine": _cosine, "constant": _constant}


def schedule(opt, steps: int) -> optax.Schedule:
  """Linear warmup, then cosine decay to `min_lr_ratio * lr` (or constant).

  `opt.schedule` must be a key of `SCHEDULES` (`study.validate` checks it).
  """
  warmup = min(opt.warmup_steps, max(steps - 1, 0))
  return SCHEDULES[opt.schedule](opt, warmup, steps)


def _adamw(opt, lr) -> optax.GradientTransformation:
  return optax.adamw(
    lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay
  )


def _sgd(opt, lr) -> optax.GradientTransformation:
  return optax.sgd(lr, momentum=opt.momentum or None)


# opt.name -> (opt, learning-rate schedule) -> the optimizer
OPTIMIZERS = {"adamw": _adamw, "sgd": _sgd}


def writeback_format(lp):
  """The write-back target of the config (a Format, or a ScaledFormat for
  an MX name such as "mxfp8_e4m3"), or None for float32."""
  if not lp.writeback:
    return None
  if lowprec.scaled.is_scaled(lp.writeback):
    return lowprec.get_scaled_format(lp.writeback)
  scale = lp.int_scale if lp.writeback.startswith("int") else None
  return lowprec.get_format(lp.writeback, scale=scale)


def split_target(spec: str) -> tuple[str, str]:
  """`(format name, rounding)` of a trace target spec: `"bfloat16"`,
  `"bfloat16:stochastic"`; the colon of a per-tensor scaled name
  (`"float8_e4m3fn:tensor"`) is part of the name."""
  name, sep, rounding = spec.rpartition(":")
  if not sep or lowprec.scaled.is_scaled(spec):
    return spec, "nearest"
  return name, rounding


def trace_target(spec: str, keep_float32: str = ""):
  """`"bfloat16"` or `"bfloat16:stochastic"` as a reference-trace target
  (MX scaled names too: `"mxfp8_e4m3:stochastic"`).

  Paths matching `keep_float32` are left out of the prediction, as the
  write-back leaves them out of the grid.
  """
  name, rounding = split_target(spec)
  if not keep_float32:
    return lowprec.freeze.Target(name, rounding or "nearest")
  rules = [(keep_float32, None), (".*", name)]
  return lowprec.freeze.Target(rules, rounding or "nearest")


def trace_remedy(spec: str, keep_float32: str = ""):
  """`"bfloat16:kahan:float8_e5m2"` or `"bfloat16:two_component"` as
  `(name, lowprec.freeze.Remedy)`, named as `compensated_trace` names it
  (`lowprec.freeze.remedy_name`).

  The spec is `weights:kind[:buffer]`: the weights' grid, the kind of
  compensation (`lowprec.freeze.KINDS`) and, for "kahan", the buffer's
  format ("bfloat16" where it is left out). Paths matching `keep_float32`
  are left out, as the write-back leaves them out.

  Raises:
    ValueError: a spec that is not of that form, or an unknown kind or
      format; the message gives the form and an example.
  """
  parts = spec.split(":")
  example = (
    "e.g. 'bfloat16:kahan:bfloat16', 'bfloat16:kahan:float8_e5m2' or "
    "'bfloat16:two_component'"
  )
  if not 2 <= len(parts) <= 3 or not all(parts):
    raise ValueError(
      f"lowprec.trace_remedies entry {spec!r} is not "
      f"'weights:kind[:buffer]'; {example}"
    )
  fmt, kind = parts[:2]
  names.check_choice("lowprec.trace_remedies kind", kind, lowprec.freeze.KINDS)
  if kind != "kahan" and len(parts) == 3:
    raise ValueError(
      f"lowprec.trace_remedies entry {spec!r}: only 'kahan' takes a buffer "
      f"format (a {kind} error lives on the weights' grid); write "
      f"'{fmt}:{kind}'"
    )
  buffer = parts[2] if len(parts) == 3 else "bfloat16"
  name = lowprec.freeze.remedy_name(
    fmt, kind, buffer if kind == "kahan" else None
  )
  grid = [(keep_float32, None), (".*", fmt)] if keep_float32 else fmt
  try:
    return name, lowprec.freeze.Remedy(grid, kind, buffer)
  except ValueError as e:
    raise ValueError(f"lowprec.trace_remedies entry {spec!r}: {e}") from None


def trace_remedies(lp) -> dict:
  """`lowprec.trace_remedies` as `compensated_trace`'s argument, over the
  parameters the write-back rounds."""
  out = {}
  for spec in lp.get("trace_remedies", ()):
    name, remedy = trace_remedy(spec, lp.keep_float32)
    if name in out:
      raise ValueError(
        f"lowprec.trace_remedies names {name!r} twice; list each remedy once"
      )
    out[name] = remedy
  return out


INT_SCOPES = ("tensor", "model")  # lowprec.int_scale_scope


def _int_amax(lp, params):
  """max |w| of every tensor put on the grid; None where `keep_float32`."""

  def leaf(path, x):
    name = path_name(path)
    if lp.keep_float32 and re.fullmatch(lp.keep_float32, name):
      return None
    return float(np.max(np.abs(np.asarray(jax.device_get(x)))))

  return jax.tree_util.tree_map_with_path(leaf, params)


def int_formats(lp, params):
  """`intK` formats scaled to the values of `params`, one per tensor.

  The scale is the smallest power of two `s` with `s * (2**(K-1) - 1) >=
  max |w|` (so rounding onto the grid clips nothing; a power of two, so that
  float32 deltas land exactly), with `max |w|` taken per tensor
  (`lp.int_scale_scope = "tensor"`) or over every tensor on the grid
  (`"model"`: one step for the whole model, which zeroes the weights below
  half of it). Paths matching `lp.keep_float32` get None (left in float32).

  Raises:
    ValueError: a tensor on the grid that is all zeros under per-tensor
      scales, or a model whose grid tensors are all zeros.
  """
  bits = int(lp.writeback[3:])
  top = 2 ** (bits - 1) - 1
  amax = _int_amax(lp, params)
  scope = lp.get("int_scale_scope", "tensor")

  def fmt(a, name="the model"):
    if not (a > 0 and math.isfinite(a)):
      raise ValueError(
        f"{name} has max |w| = {a}: no {lp.writeback} scale from its "
        "values fits it; set lowprec.int_scale, or leave it in float32 "
        "with lowprec.keep_float32"
      )
    return lowprec.int_format(bits, 2.0 ** math.ceil(math.log2(a / top)))

  if scope == "model":
    one = fmt(max(jax.tree.leaves(amax), default=0.0))
    return jax.tree.map(lambda a: one, amax)
  return jax.tree_util.tree_map_with_path(
    lambda path, a: fmt(a, f"parameter {path_name(path)!r}"), amax
  )


def needs_params(lp) -> bool:
  """Whether the write-back target depends on the initial parameters."""
  return lp.writeback.startswith("int") and not lp.int_scale


# lowprec keys a per-group recipe sets for its group; a config with
# lowprec.group_recipes leaves them at their defaults.
GROUP_EXCLUSIVE = {
  "writeback": "",
  "compensation": "none",
  "state": (),
  "weight_format": "float32",
  "keep_float32": "",
}


def group_recipes(lp) -> list[tuple[str, str, str]]:
  """`lowprec.group_recipes` as `[(group, regex, recipe name), ...]` in the
  order of `lowprec.groups` (`lowprec.groups.DEFAULT_GROUPS` where empty);
  empty when the config has none.

  Raises:
    ValueError: an entry that is not "group=recipe", an unknown group or
      recipe, a group without a recipe, or a key that a group recipe sets
      (`GROUP_EXCLUSIVE`) set as well.
  """
  entries = lp.get("group_recipes", ())
  if not entries:
    return []
  groups = lowprec.groups.as_groups(lp.get("groups", ()) or None)
  known = [g for g, _ in groups]
  chosen = {}
  for entry in entries:
    group, sep, name = entry.partition("=")
    group = group.strip()
    if not sep or group not in known:
      raise ValueError(
        f"lowprec.group_recipes entry {entry!r} is not 'group=recipe' with "
        f"a group of lowprec.groups ({', '.join(known)}), e.g. "
        "'mlp=bf16_kahan+q8'"
      )
    try:
      lowprec.recipes.get(name)
    except ValueError as e:
      raise ValueError(f"lowprec.group_recipes entry {entry!r}: {e}") from None
    chosen[group] = name.strip()
  missing = [g for g in known if g not in chosen]
  if missing:
    raise ValueError(
      f"lowprec.group_recipes has no recipe for group(s) {missing}: give "
      "each group of lowprec.groups one (e.g. 'other=float32'), or leave "
      "those groups out of lowprec.groups"
    )
  for key, default in GROUP_EXCLUSIVE.items():
    value = lp.get(key, default)
    if (tuple(value) if isinstance(value, (list, tuple)) else value) != default:
      raise ValueError(
        f"lowprec.group_recipes sets each group's recipe; lowprec.{key} "
        f"= {value!r} would set it again: leave lowprec.{key} unset"
      )
  return [(g, r.pattern, chosen[g]) for g, r in groups]


def _group_target(lp):
  """The grid rules of a per-group config: each group's regex with its
  recipe's format (None: float32)."""
  return [
    (regex, lowprec.recipes.get(name)[0].fmt)
    for _, regex, name in group_recipes(lp)
  ]


def has_telemetry(lp) -> bool:
  """Whether `build`'s chain holds a state that `lowprec.telemetry` reads
  (a write-back, a reference or compensated trace, a decay counter or
  stored state)."""
  return bool(
    lp.writeback
    or lp.get("group_recipes", ())
    or lp.trace_targets
    or lp.get("trace_remedies", ())
    or lp.get("decay_erasure", False)
    or lp.get("state", ())
    or lp.get("state_targets", ())
  )


def state_rules(lp, entries=None, key="lowprec.state"):
  """`lowprec.state` ("regex=spec" strings) as `store_state` rules.

  Raises:
    ValueError: an entry without "=", or a bad format, rounding or scale.
  """
  rules = []
  for entry in lp.get("state", ()) if entries is None else entries:
    regex, sep, spec = entry.rpartition("=")
    if not sep or not regex:
      raise ValueError(
        f"{key} entry {entry!r} is not 'regex=spec'; e.g. "
        "'mu=bfloat16:stochastic' or 'nu=float8_e5m2:nearest:block128'"
      )
    try:
      rules.append((regex.strip(), parse_state_format(spec.strip())))
    except ValueError as e:
      raise ValueError(f"{key} entry {entry!r}: {e}") from None
  return rules


def state_targets(lp) -> dict[str, list]:
  """`lowprec.state_targets` ("name: regex=spec; regex=spec") as the
  targets of `lowprec.freeze.state_trace`.

  Raises:
    ValueError: an entry without a name or rules, a repeated name, or a
      rule as `state_rules` refuses it.
  """
  out = {}
  for entry in lp.get("state_targets", ()):
    name, sep, rules = entry.partition(":")
    name = name.strip()
    if not sep or not name.isidentifier() or not rules.strip():
      raise ValueError(
        f"lowprec.state_targets entry {entry!r} is not "
        "'name: regex=spec; regex=spec'; e.g. "
        "'sr_bf16: mu=bfloat16:stochastic; nu=bfloat16:stochastic'"
      )
    if name in out:
      raise ValueError(
        f"lowprec.state_targets names {name!r} twice: give each its own name"
      )
    parts = [r for r in rules.split(";") if r.strip()]
    out[name] = state_rules(lp, parts, f"lowprec.state_targets {name!r}")
  return out


def writeback_target(lp, params=None):
  """The write-back's `fmt` argument: a Format, or rules keeping some paths
  in float32, or a pytree of formats scaled to `params` (`needs_params`,
  `int_formats`); None when the run trains in float32."""
  if lp.get("group_recipes", ()):
    return _group_target(lp)
  if needs_params(lp):
    if params is None:
      raise ValueError(
        f"{lp.writeback} write-back with scales from the params "
        "(lowprec.int_scale=0) needs the initial params"
      )
    return int_formats(lp, params)
  fmt = writeback_format(lp)
  if fmt is None or not lp.keep_float32:
    return fmt
  return [(lp.keep_float32, None), (".*", fmt)]


def trace_targets(lp):
  """The reference trace's targets, named as `reference_trace` names them
  (`bfloat16`, `bfloat16_sr`), over the parameters the write-back rounds."""
  if not lp.keep_float32:
    return [trace_target(t) for t in lp.trace_targets]
  return {
    trace_target(t).default_name: trace_target(t, lp.keep_float32)
    for t in lp.trace_targets
  }


def _pairwise_sum(v: jax.Array) -> jax.Array:
  """Sum of a 1-D array in a fixed tree: halves added until one is left."""
  n = 1 << max(0, (v.size - 1).bit_length())
  v = jnp.pad(v, (0, n - v.size))
  while v.size > 1:
    v = v[: v.size // 2] + v[v.size // 2 :]
  return v[0]


def global_norm(tree) -> jax.Array:
  """`optax.tree.norm`, summed in a fixed order.

  XLA's reductions sum in an order that depends on the program around them
  (fusion, the number of devices), so the same gradient can have norms a
  rounding apart on 1 and 8 devices, and clipping by them gives different
  parameters. Adding halves of zero-padded vectors (each leaf, then the
  leaves' sums) fixes the order: the same bits on any device count.
  """
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)]
  if not leaves:
    return jnp.float32(0)
  sums = [_pairwise_sum(jnp.ravel(jnp.square(x))) for x in leaves]
  return jnp.sqrt(_pairwise_sum(jnp.stack(sums)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` with the fixed-order `global_norm`."""

  def update(updates, state, params=None):
    del params
    g_norm = global_norm(updates)
    trigger = g_norm < max_norm

    # One scalar factor, then a product: XLA may turn a division by a
    # broadcast scalar into a multiplication by its reciprocal in one
    # program and not in another.
    scale = (max_norm / g_norm).astype(jnp.float32)

    def clip(t):
      return jax.lax.select(trigger, t, (t * scale).astype(t.dtype))

    return jax.tree.map(clip, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _plain(lp, target, key):
  # A config.json written before the key existed reads "recompute".
  scales = lp.get("writeback_scales", "recompute")
  return lowprec.writeback(
    target, lp.rounding, key=key, overflow=lp.overflow, scales=scales
  )


DEFAULT_BUFFER = "bfloat16"  # lowprec.buffer where a config leaves it out


def _kahan(lp, target, key):
  return lowprec.kahan_writeback(
    target,
    lp.rounding,
    buffer=lp.get("buffer", DEFAULT_BUFFER),
    key=key,
    overflow=lp.overflow,
  )


def _two_component(lp, target, key):
  return lowprec.two_component_writeback(
    target, lp.rounding, key=key, overflow=lp.overflow
  )


def _remainder(lp, target, key):
  del key
  if lp.rounding != "nearest":
    raise ValueError(
      "lowprec.compensation='remainder' rebuilds an exact float32 master "
      f"and rounds nothing: set lowprec.rounding='nearest' (got "
      f"{lp.rounding!r})"
    )
  return lowprec.remainder_writeback(target)


DEFAULT_CORRECTION_BITS = 8  # lowprec.correction_bits where left out
CORRECTION_BITS = (8, 16)  # lowprec.correction_bits: int8 or int16 codes

# The lowprec keys a weight recipe (`lowprec.recipes.Weights.config`) sets,
# at the values a config that leaves them out reads.
RECIPE_DEFAULTS = {
  "writeback": "",
  "rounding": "nearest",
  "compensation": "none",
  "buffer": DEFAULT_BUFFER,
  "correction_bits": DEFAULT_CORRECTION_BITS,
}


def _split(lp, target, key):
  del key
  if lp.rounding != "nearest":
    raise ValueError(
      "lowprec.compensation='split' keeps the value a bfloat16 weight and "
      "its correction stand for, and rounds it to nearest: set "
      f"lowprec.rounding='nearest' (got {lp.rounding!r})"
    )
  bits = lp.get("correction_bits", DEFAULT_CORRECTION_BITS)
  return lowprec.split_writeback(target, correction_bits=bits)


# lowprec.compensation -> (lowprec section, grid target, key) -> the
# write-back, placed after the optimizer. A config.json written before the
# key existed reads "none".
WRITEBACKS = {
  "none": _plain,
  "kahan": _kahan,
  "two_component": _two_component,
  "remainder": _remainder,
  "split": _split,
}


def _eco(lp, target, key, optimizer):
  return lowprec.eco(
    optimizer, target, lp.rounding, key=key, overflow=lp.overflow
  )


# lowprec.compensation -> (lowprec section, grid target, key, optimizer) ->
# the optimizer and its write-back in one transform: the compensations
# that fold the rounding error into the optimizer's own state.
WRAPPERS = {"eco": _eco}

# Every lowprec.compensation.
COMPENSATIONS = {**WRITEBACKS, **WRAPPERS}


def compensation(lp) -> str:
  """The config's `lowprec.compensation`, "none" where it is not set."""
  return lp.get("compensation", "none")


def build(config, key: jax.Array, params=None) -> optax.GradientTransformation:
  """clip -> AdamW/SGD -> write-back (low precision) or traces (float32).

  With `lowprec.state` the optimizer's state is stored in low precision
  (`lowprec.store_state` around AdamW/SGD; state paths such as `0/mu/...`).
  The write-back is `lowprec.writeback`, or a compensated one picked by
  `lowprec.compensation` ("kahan" with `lowprec.buffer`, "two_component",
  "remainder", "split" with `lowprec.correction_bits`; see `WRITEBACKS`).
  "eco" (`WRAPPERS`) takes the optimizer inside instead:

    clip -> [store_state] eco(AdamW/SGD, grid) -> traces

  `lowprec.eco` runs the optimizer (its schedule, bias correction and
  decoupled weight decay included) in float32, writes the update onto the
  grid and folds the rounding error into the first moment. Clipping acts
  on the gradients before the optimizer, so the update stays elementwise
  in the moment, as the fold assumes. A stored state wraps eco, so the
  moment is stored after the fold (state paths `inner/0/mu/...`): the
  store rounds the fold with the moment, which stochastic rounding keeps
  in expectation and nearest rounding drops where it is below half the
  moment's gap, so a rule that stores a first moment under eco must round
  stochastically (`lowprec.store_state` refuses it otherwise, at `init`).

  A float32 run predicts nearest write-back with `lowprec.trace_targets`
  (`reference_trace`) and the compensated ones with
  `lowprec.trace_remedies` (`compensated_trace`).

  `params` (the initial parameters) are needed only for per-tensor `intK`
  scales (`needs_params`). The config's names (`opt.name`, `opt.schedule`,
  `lowprec.rounding`, ...) are checked by `study.validate`, and the chain is
  built on the model's abstract parameters (`config_checks.check_build`),
  before a run directory is touched.
  """
  return optax.chain(*(tx for _, tx in parts(config, key, params)))


def parts(config, key: jax.Array, params=None) -> list:
  """`build`'s chain as `[(config key, transform), ...]`, in order: the
  key each transform comes from, for the errors of a dry build."""
  opt, lp = config.opt, config.lowprec
  lr = schedule(opt, config.train.steps)
  out = []
  if opt.clip_norm > 0:
    out.append(("opt.clip_norm", clip_by_global_norm(opt.clip_norm)))
  if lp.get("group_recipes", ()):
    out.append(("lowprec.group_recipes", _per_group(config, lr, key)))
    return out + _traces(lp, jax.random.split(key)[1])
  target = writeback_target(lp, params)
  wb_key, trace_key = jax.random.split(key)
  write_key = wb_key if lp.rounding != "nearest" else None
  wrapped = target is not None and compensation(lp) in WRAPPERS
  out.append(_optimizer(config, lr, target, write_key, key))
  if lp.get("decay_erasure", False) and not wrapped:
    out.append(("lowprec.decay_erasure", _decay_erasure(config, lr, target)))
  if target is not None and not wrapped:
    write = WRITEBACKS[compensation(lp)]
    where = "lowprec.writeback"
    if compensation(lp) != "none":
      where = "lowprec.compensation"
    out.append((where, write(lp, target, write_key)))
  return out + _traces(lp, trace_key)


def _per_group(config, lr, key) -> optax.GradientTransformation:
  """`optax.multi_transform` over `lowprec.groups`: each group's recipe
  (`lowprec.recipes.chain`) around its own AdamW/SGD, the write-back's key
  `fold_in(write-back key, group index)`, as `scripts.advise` writes it
  for users' code."""
  wb_key = jax.random.split(key)[0]
  chosen = group_recipes(config.lowprec)
  txs = {}
  for i, (group, _, name) in enumerate(chosen):
    optimizer = OPTIMIZERS[config.opt.name](config.opt, lr)
    txs[group] = lowprec.recipes.chain(
      optimizer, name, jax.random.fold_in(wb_key, i)
    )
  groups = [(g, regex) for g, regex, _ in chosen]
  return optax.multi_transform(txs, lowprec.groups.labels(groups))


def _traces(lp, trace_key) -> list:
  """The reference and compensated traces a (float32) run carries."""
  out = []
  if lp.trace_targets:
    trace = lowprec.freeze.reference_trace(
      trace_targets(lp),
      sample=lp.trace_sample,
      key=trace_key,
      at_init=lp.get("trace_at_init", False),
    )
    out.append(("lowprec.trace_targets", trace))
  if lp.get("trace_remedies", ()):
    remedies = lowprec.freeze.compensated_trace(trace_remedies(lp))
    out.append(("lowprec.trace_remedies", remedies))
  return out


def _optimizer(config, lr, target, write_key, key) -> tuple:
  """`(config key, transform)`: AdamW/SGD, inside an eco write-back where
  the config has one, inside its state store or state trace."""
  opt, lp = config.opt, config.lowprec
  where, optimizer = "opt.name", OPTIMIZERS[opt.name](opt, lr)
  wrap = WRAPPERS.get(compensation(lp)) if target is not None else None
  if wrap is not None:
    if lp.get("decay_erasure", False):
      # It would count inside eco, whose own telemetry hides it.
      raise ValueError(
        "lowprec.decay_erasure counts the proposals inside eco, where its "
        "telemetry is not read: set it in an arm with "
        "lowprec.compensation='none'"
      )
    optimizer = wrap(lp, target, write_key, optimizer)
    where = "lowprec.compensation"
  if lp.get("state", ()):
    # A key of its own, so that the write-back's and the trace's keys stay
    # those of runs without stored state.
    state_key = jax.random.fold_in(key, 3)
    rules = state_rules(lp)
    optimizer = lowprec.store_state(optimizer, rules, key=state_key)
    where = "lowprec.state"
  if lp.get("state_targets", ()):
    optimizer = lowprec.freeze.state_trace(optimizer, state_targets(lp))
    where = "lowprec.state_targets"
  return where, optimizer


# Key prefixes of the float32 run's predictions and of a stored state,
# whose counts are not the write-back's proposals.
_NOT_WRITEBACK = ("pred", "pred_state", "state")


def nonfinite_step(record: dict) -> int:
  """The write-backs' non-finite proposals in a step's record (its
  telemetry) when every proposal of the step was non-finite, else 0.

  Totals are the keys `proposals` and `nonfinite` of each write-back
  (`<group>/nonfinite` under `lowprec.group_recipes`, `nonfinite#1` for a
  second one); per-tensor keys (`nonfinite/<path>`), predictions and a
  stored state's counts are left out.
  """
  totals = {"proposals": 0, "nonfinite": 0}
  for key, value in record.items():
    parts = key.split("#")[0].split("/")
    if parts[-1] in totals and parts[0] not in _NOT_WRITEBACK:
      totals[parts[-1]] += value
  if totals["proposals"] or not totals["nonfinite"]:
    return 0
  return totals["nonfinite"]


def _decay_erasure(config, lr, target):
  """`lowprec.freeze.decay_erasure` on the write-back grid, or on the first
  reference-trace target of a float32 run."""
  opt, lp = config.opt, config.lowprec
  if opt.name != "adamw":
    raise ValueError(
      "lowprec.decay_erasure splits AdamW's proposals; set opt.name='adamw' "
      "or lowprec.decay_erasure=False"
    )
  if target is None:
    if not lp.trace_targets:
      raise ValueError(
        "lowprec.decay_erasure needs a grid: set lowprec.writeback or "
        "lowprec.trace_targets"
      )
    target = trace_target(lp.trace_targets[0], lp.keep_float32).fmt
  return lowprec.freeze.decay_erasure(target, lr, opt.weight_decay)

"""The config's `lowprec` section read as lowprec's arguments.

The defaults a config that leaves a key out reads, and each key parsed
into what `optim.build` hands the library: the write-back's grid
(`writeback_target`, per-tensor `intK` scales in `int_formats`), the
per-group recipes (`group_recipes`), the reference and compensated traces'
targets (`trace_targets`, `trace_remedies`) and the stored state's rules
(`state_rules`, `state_targets`). A malformed entry raises `ValueError`
naming the key, the entry and its form with an example; `study.validate`
calls these before a run directory is touched.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np

import lowprec
from lowprec.engine.weights import path_name
from lowprec.grids import choices as names
from lowprec.optim.stored_state import parse_state_format

DEFAULT_BUFFER = "bfloat16"  # lowprec.buffer where a config leaves it out
DEFAULT_CORRECTION_BITS = 8  # lowprec.correction_bits where left out
CORRECTION_BITS = (8, 16)  # lowprec.correction_bits: int8 or int16 codes
INT_SCOPES = ("tensor", "model")  # lowprec.int_scale_scope

# The lowprec keys a weight recipe (`lowprec.recipes.Weights.config`) sets,
# at the values a config that leaves them out reads.
RECIPE_DEFAULTS = {
  "writeback": "",
  "rounding": "nearest",
  "compensation": "none",
  "buffer": DEFAULT_BUFFER,
  "correction_bits": DEFAULT_CORRECTION_BITS,
}

# lowprec keys that make a run predict other recipes (traces of other
# grids, compensations, moment stores and of the progress nearest rounding
# erases), at their off values: a run's own recipe without its predictions.
NO_PREDICTIONS = {
  "trace_targets": (),
  "trace_remedies": (),
  "state_targets": (),
  "decay_erasure": False,
  "trace_progress": False,
}

# lowprec keys a per-group recipe sets for its group; a config with
# lowprec.group_recipes leaves them at their defaults.
GROUP_EXCLUSIVE = {
  "writeback": "",
  "compensation": "none",
  "state": (),
  "weight_format": "float32",
  "keep_float32": "",
}


def compensation(lp) -> str:
  """The config's `lowprec.compensation`, "none" where it is not set."""
  return lp.get("compensation", "none")


def writeback_format(lp):
  """The write-back target of the config (a Format, or a ScaledFormat for
  an MX name such as "mxfp8_e4m3"), or None for float32."""
  if not lp.writeback:
    return None
  if lowprec.scaled.is_scaled(lp.writeback):
    rule = lp.get("writeback_rule", "") or None
    return lowprec.get_scaled_format(lp.writeback, rule=rule)
  if lp.get("writeback_rule", ""):
    raise ValueError(
      f"lowprec.writeback_rule={lp.writeback_rule!r} picks an MX scale "
      f"rule, and {lp.writeback!r} has no block scales: give an MX "
      "writeback (e.g. 'mxfp8_e4m3') or leave the rule empty"
    )
  scale = lp.int_scale if lp.writeback.startswith("int") else None
  return lowprec.get_format(lp.writeback, scale=scale)


def needs_params(lp) -> bool:
  """Whether the write-back target depends on the initial parameters."""
  return lp.writeback.startswith("int") and not lp.int_scale


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


def trace_targets(lp):
  """The reference trace's targets, named as `reference_trace` names them
  (`bfloat16`, `bfloat16_sr`), over the parameters the write-back rounds."""
  if not lp.keep_float32:
    return [trace_target(t) for t in lp.trace_targets]
  return {
    trace_target(t).default_name: trace_target(t, lp.keep_float32)
    for t in lp.trace_targets
  }


def progress_targets(lp) -> dict:
  """The grids of the nearest `lowprec.trace_targets`, as
  `lowprec.freeze.progress_trace` takes them (`{name: format spec}`, named
  like the reference trace's nearest targets).

  Raises:
    ValueError: `lowprec.trace_progress` without nearest trace targets.
  """
  out = {}
  for spec in lp.trace_targets:
    name, rounding = split_target(spec)
    if (rounding or "nearest") != "nearest":
      continue
    keep = lp.keep_float32
    out[name] = [(keep, None), (".*", name)] if keep else name
  if not out:
    raise ValueError(
      "lowprec.trace_progress adds up the proposals that nearest "
      "write-back onto each grid would erase: give the grids as nearest "
      "lowprec.trace_targets, e.g. ('bfloat16', 'float8_e4m3fn')"
    )
  return out


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


# model.layer_storage: how a GPT's blocks' leaves are stored. "apart",
# one leaf per layer; "stacked", one array per kind of leaf with the layers
# on its first axis (lowprec.engine.stacked), so the optimizer compiles
# one program per kind of leaf at any depth; "auto", stacked where every
# transform of the arm takes it. The bits are the same either way.
LAYER_STORAGES = ("apart", "stacked", "auto")

# lowprec keys whose transforms keep one value per leaf, and so do not
# take a leaf of stacked layers: set, they keep the layers apart.
_STACKED_REFUSED = (
  "trace_at_init",
  "trace_remedies",
  "state",
  "state_targets",
  "group_recipes",
  "decay_erasure",
  "trace_progress",
)


def _unstackable(c) -> str | None:
  """What in the config does not take stacked layers; None if nothing."""
  lp = c.lowprec
  if c.model.kind != "gpt":
    return f"model.kind={c.model.kind!r} (it stacks a GPT's blocks)"
  if set_keys := [k for k in _STACKED_REFUSED if lp.get(k)]:
    return f"lowprec.{set_keys[0]} (its state keeps one value per leaf)"
  if compensation(lp) != "none":
    return f"lowprec.compensation={compensation(lp)!r}"
  if lp.writeback and needs_params(lp):
    return "per-tensor scales (lowprec.int_scale=0), one per layer"
  if lp.get("writeback_kernel", "xla") != "xla":
    # A stacked leaf is stepped by XLA's ops, never by the kernel.
    return f"lowprec.writeback_kernel={lp.writeback_kernel!r}"
  return None


def stacked_layers(c) -> bool:
  """Whether the run stores its blocks' leaves stacked
  (`model.layer_storage`).

  Raises:
    ValueError: `model.layer_storage="stacked"` where a transform of the
      arm does not take stacked layers, naming it and the fix.
  """
  storage = c.model.get("layer_storage", "apart")
  if storage == "apart":
    return False
  why = _unstackable(c)
  if why is not None and storage == "stacked":
    raise ValueError(
      f"model.layer_storage='stacked' stores the blocks' leaves stacked, "
      f"which {why} does not take: set model.layer_storage='apart' (or "
      "'auto', which keeps them apart where they must be)"
    )
  return why is None

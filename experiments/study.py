"""Running a study: every arm x seed in turn, or one of them.

A study config names its arms in `study.arms` (arm name -> nested overrides
of the config) and its seeds in `study.seeds`. `study.arm` / `study.seed`
select one (for job arrays). Every selected run is resolved and checked
before the first one starts. Each run's directory is a ledger
(`experiments/ledger.py`): finished runs with the same config are skipped,
unfinished ones resume from their latest checkpoint, and a changed config is
refused.
"""

from __future__ import annotations

import copy

import ml_collections

import lowprec
from experiments import (
  config_checks,
  ledger,
  lowprec_config,
  models,
  operator_checks,
  optim,
  tasks,
  train,
)
from experiments import data as data_lib
from lowprec.backward.ops import rounding as op_rounding
from lowprec.grids import choices as names
from lowprec.grids.formats import check_writeback_format
from lowprec.grids.rounding import OVERFLOW_MODES, ROUNDINGS
from lowprec.optim.writeback import SCALE_MODES

# study.kind -> what runs one arm x seed: (config, overrides, options) ->
# summary, written under results.run_dir(config) (a ledger.open_run entry)
RUNNERS = {
  "train": train.train_and_evaluate,
  "operator_checks": operator_checks.run,
}


class ConfigError(ValueError):
  """A config (file, argument or override) that cannot run; names the fix."""


def _suggest(name, valid) -> str:
  return names.suggest(name, valid)


def choices() -> dict:
  """Each config key naming one of a set of choices -> that set: the
  registries the runner builds from, so validation and construction share
  one source."""
  return {
    "study.kind": RUNNERS,
    "model.kind": tasks.TASKS,
    "model.norm": models.NORMS,
    "model.positions": models.POSITIONS,
    "model.activation": lowprec.ops.ACTIVATIONS,
    "data.name": data_lib.DATASETS,
    "opt.name": optim.OPTIMIZERS,
    "opt.schedule": optim.SCHEDULES,
    "lowprec.rounding": ROUNDINGS,
    "lowprec.compensation": optim.COMPENSATIONS,
    "lowprec.overflow": OVERFLOW_MODES,
    "lowprec.writeback_scales": SCALE_MODES,
    "lowprec.fwd_rounding": op_rounding.MODES,
    "lowprec.bwd_rounding": op_rounding.MODES,
    "lowprec.attn_fresh_out": lowprec.ops.FRESH_OUT,
    "lowprec.int_scale_scope": lowprec_config.INT_SCOPES,
    "lowprec.state_kernel": optim.STATE_KERNELS,
    "lowprec.writeback_kernel": optim.WRITEBACK_KERNELS,
    "model.layer_storage": lowprec_config.LAYER_STORAGES,
  }


def check_choices(c) -> None:
  """Every key of `choices()` names one of its choices."""
  for key, valid in choices().items():
    section, name = key.split(".")
    names.check_choice(key, c[section][name], valid)


def arms_of(config) -> list[str]:
  arms = list(config.study.arms.keys()) or [""]
  if config.study.arm:
    if config.study.arm not in arms:
      raise ValueError(
        f"arm {config.study.arm!r} is not in study {config.study.name!r}."
        f"{_suggest(config.study.arm, arms)} Arms: {', '.join(arms)}"
      )
    return [config.study.arm]
  # Arms that others start from (train.init_from_arm) run first; ml_collections
  # keeps arm names sorted, not in the order a study file wrote them.
  sources = set()
  for name in arms:
    overrides = config.study.arms[name] if name else {}
    sources.add(overrides.get("train", {}).get("init_from_arm", ""))
  return sorted(arms, key=lambda a: a not in sources)


def seeds_of(config, arm: str = "") -> list[int]:
  """The selected seed, else the arm's own `study.seeds`, else the study's."""
  arm_study = config.study.arms[arm].get("study", {}) if arm else {}
  seeds = list(arm_study.get("seeds", config.study.seeds))
  if config.study.seed >= 0:
    if config.study.seed not in seeds:
      where = f"arm {arm!r} of study" if "seeds" in arm_study else "study"
      raise ValueError(
        f"seed {config.study.seed} is not one of the seeds {seeds} of "
        f"{where} {config.study.name!r} (study.seeds); pick one of them, or "
        "add it, e.g. --config.study.seeds="
        f"'{tuple(sorted({*seeds, config.study.seed}))}'"
      )
    return [config.study.seed]
  return seeds


def _drop(overrides: dict, keys: set[str], prefix: str = "") -> dict:
  """The overrides without the dotted keys given on the command line."""
  out = {}
  for k, v in overrides.items():
    path = prefix + k
    if path in keys:
      continue
    if isinstance(v, (dict, ml_collections.ConfigDict)):
      out[k] = _drop(dict(v), keys, path + ".")
    else:
      out[k] = v
  return out


def resolve(
  config, arm: str, seed: int, cli_keys=()
) -> ml_collections.ConfigDict:
  """The config of one run: base, then the arm's overrides, then the seed.

  Command-line overrides (`cli_keys`, dotted) win over the arm's.
  """
  c = copy.deepcopy(config)
  c.unlock()
  c.study.arm = arm
  c.study.seed = seed
  c.train.seed = seed
  c.lock()
  if arm:
    overrides = config.study.arms[arm]
    try:
      c.update(_drop(overrides.to_dict(), set(cli_keys)))
    except (KeyError, AttributeError, TypeError) as e:
      raise ValueError(
        f"arm {arm!r} of study {config.study.name!r} overrides a key the "
        f"config does not have: {e}"
      ) from None
  validate(c)
  return c


# Keys that take a scaled (MX) format name as well as a grid's.
_SCALED_FIELDS = ("lowprec.writeback", "lowprec.trace_targets")


def validate(c) -> None:
  """Clear errors (naming the fix) for values the code would reject later."""
  check_choices(c)
  lp = c.lowprec
  # Saved tensors and gradients also take scaled formats (ops.Rounding).
  formats = [
    (field, name)
    for field, name in (
      ("lowprec.fwd_format", lp.fwd_format),
      ("lowprec.bwd_format", lp.bwd_format),
    )
    if not lowprec.scaled.is_scaled(name)
  ]
  for t in lp.trace_targets:
    name, rounding = lowprec_config.split_target(t)
    formats.append(("lowprec.trace_targets", name))
    names.check_choice("lowprec.trace_targets rounding", rounding, ROUNDINGS)
  if lp.writeback:
    formats.append(("lowprec.writeback", lp.writeback))
  lowprec_config.state_rules(lp)  # raises for a bad lowprec.state entry
  if lp.get("state_kernel", "none") != "none" and not lp.state:
    raise ValueError(
      f"lowprec.state_kernel={lp.state_kernel!r} stores AdamW's moments "
      "by lowprec.state's rules, and lowprec.state is empty: give it one "
      "'mu=<spec>' and one 'nu=<spec>' entry, or set "
      "lowprec.state_kernel='none'"
    )
  lowprec_config.group_recipes(
    lp
  )  # raises for a bad lowprec.group_recipes entry
  _check_float32_predictions(lp)
  _check_compensation(lp)
  _check_eco(c)
  lowprec_config.stacked_layers(c)  # raises where it cannot be
  if lowprec_config.compensation(lp) == "kahan":
    formats.append(("lowprec.buffer", lp.buffer))
  for field, name in formats:
    if field in _SCALED_FIELDS and lowprec.scaled.is_scaled(name):
      # Write-back and its prediction take MX formats only.
      check_writeback_format(name, field)
      continue
    try:
      scale = lp.int_scale if name.startswith("int") else None
      if scale == 0 and field == "lowprec.writeback":
        scale = 1.0  # per-tensor scales, chosen when the run starts
      lowprec.get_format(name, scale=scale)
    except ValueError as e:
      hint = ""
      if field in _SCALED_FIELDS:
        hint = names.suggest(name, lowprec.scaled.SCALED)
        hint = hint and f" (or a scaled format:{hint})"
      raise ValueError(f"{field}: {e}{hint}") from None
  if bool(c.train.init_from_arm) != (c.train.init_from_step > 0):
    raise ValueError(
      "train.init_from_arm and train.init_from_step go together: name the "
      "arm whose checkpoint starts this run and a step it saved, e.g. "
      "--config.train.init_from_arm=fp32_reference "
      "--config.train.init_from_step=100"
    )
  if c.train.init_from_arm == c.study.arm and c.study.arm:
    raise ValueError(
      f"arm {c.study.arm!r} cannot start from its own checkpoint "
      "(train.init_from_arm); resuming is automatic"
    )
  if lp.policy:
    try:
      models.check_policy(lp)
    except ValueError as e:
      raise ValueError(f"lowprec.policy: {e}") from None
  if c.train.probe_every_steps and c.model.kind not in tasks.PROBED:
    raise ValueError(
      "train.probe_every_steps needs a task with a gradient probe "
      f"(model.kind={' or '.join(tasks.PROBED)}), not {c.model.kind!r}; set "
      "it to 0"
    )
  config_checks.check(c)


def _check_compensation(lp) -> None:
  """`lowprec.compensation` with the write-back it compensates, its
  rounding, and the keys only one kind reads."""
  kind = lowprec_config.compensation(lp)
  _check_kind_keys(lp, kind)
  on_kernel = lp.get("writeback_kernel", "xla") != "xla"
  if on_kernel and not lp.writeback:
    raise ValueError(
      f"lowprec.writeback_kernel={lp.writeback_kernel!r} runs the "
      "write-back, and lowprec.writeback is empty (a float32 run): set "
      "lowprec.writeback to the weights' grid, or "
      "--config.lowprec.writeback_kernel=xla"
    )
  if kind == "none":
    return
  if on_kernel:
    raise ValueError(
      f"lowprec.writeback_kernel={lp.writeback_kernel!r} runs the plain "
      f"write-back, and lowprec.compensation={kind!r} is its own: set "
      "--config.lowprec.writeback_kernel=xla, or "
      "--config.lowprec.compensation=none"
    )
  if not lp.writeback:
    raise ValueError(
      f"lowprec.compensation={kind!r} compensates a write-back: set "
      "lowprec.writeback to the weights' grid (e.g. 'bfloat16'), or "
      "lowprec.compensation='none'"
    )
  if kind == "eco" and lp.get("writeback_scales", "recompute") != "recompute":
    raise ValueError(
      "lowprec.compensation='eco' rounds onto block scales recomputed from "
      "the new weights: set --config.lowprec.writeback_scales=recompute, "
      "or --config.lowprec.compensation=none for a write-back that keeps "
      "the old scales"
    )
  if kind != "eco" and lowprec.scaled.is_scaled(lp.writeback):
    raise ValueError(
      f"lowprec.compensation={kind!r} takes weights on a grid, and "
      f"lowprec.writeback={lp.writeback!r} is a scaled (MX) format: set "
      "--config.lowprec.compensation=none for its plain write-back, or a "
      "grid, e.g. --config.lowprec.writeback=float8_e4m3fn"
    )
  if kind == "split":
    _check_split(lp)
  if lp.rounding == "deadzone":
    raise ValueError(
      f"lowprec.compensation={kind!r} does not take lowprec.rounding="
      "'deadzone' (the compensation already keeps what nearest rounding "
      "drops): set --config.lowprec.rounding=nearest (or stochastic), or "
      "--config.lowprec.compensation=none for dead-zone rounding alone"
    )
  if kind == "remainder":
    _check_remainder(lp)


def _check_kind_keys(lp, kind: str) -> None:
  """`lowprec.buffer` (Kahan's) and `lowprec.correction_bits` (split's):
  left at their defaults unless their compensation reads them."""
  default_buffer = lowprec_config.DEFAULT_BUFFER
  default_bits = lowprec_config.DEFAULT_CORRECTION_BITS
  buffer = lp.get("buffer", default_buffer)
  if kind != "kahan" and buffer != default_buffer:
    raise ValueError(
      f"lowprec.buffer={buffer!r} is the Kahan buffer's format and only "
      f"applies with lowprec.compensation='kahan' (this run has {kind!r}): "
      "set --config.lowprec.compensation=kahan to use it, or leave "
      f"lowprec.buffer at {default_buffer!r}"
    )
  bits = lp.get("correction_bits", default_bits)
  if bits not in lowprec_config.CORRECTION_BITS:
    raise ValueError(
      f"lowprec.correction_bits={bits!r} is not a correction's width: set "
      "--config.lowprec.correction_bits=8 (an int8 code, 3 bytes per "
      "parameter with the bfloat16 weight) or 16 (int16, 4 bytes)"
    )
  if kind != "split" and bits != default_bits:
    raise ValueError(
      f"lowprec.correction_bits={bits!r} is the split weights' correction "
      f"and only applies with lowprec.compensation='split' (this run has "
      f"{kind!r}): set --config.lowprec.compensation=split to use it, or "
      f"leave lowprec.correction_bits at {default_bits}"
    )


def _check_remainder(lp) -> None:
  """`remainder` rebuilds a float32 master from a bfloat16 weight."""
  if lp.rounding != "nearest":
    raise ValueError(
      "lowprec.compensation='remainder' rebuilds an exact float32 master "
      f"and rounds nothing: set --config.lowprec.rounding=nearest (got "
      f"{lp.rounding!r})"
    )
  if not _on_bfloat16_grid(lp.writeback):
    raise ValueError(
      "lowprec.compensation='remainder' splits a float32 master into a "
      "bfloat16 weight and its low 16 bits, so it needs lowprec.writeback="
      f"'bfloat16' (got {lp.writeback!r}): for another grid use "
      "--config.lowprec.compensation=kahan (its buffer: lowprec.buffer)"
    )


def _check_split(lp) -> None:
  """`split` rebuilds a bfloat16 weight and its correction, rounds to
  nearest and saturates."""
  if not _on_bfloat16_grid(lp.writeback):
    raise ValueError(
      "lowprec.compensation='split' keeps a bfloat16 weight and a "
      "correction in units of its ulp, so it needs lowprec.writeback="
      f"'bfloat16' (got {lp.writeback!r}): set "
      "--config.lowprec.writeback=bfloat16, or for another grid use "
      "--config.lowprec.compensation=kahan (its buffer: lowprec.buffer)"
    )
  if lp.rounding != "nearest":
    raise ValueError(
      "lowprec.compensation='split' keeps the value the weight and its "
      "correction stand for and rounds it to nearest: set "
      f"--config.lowprec.rounding=nearest (got {lp.rounding!r})"
    )
  if lp.overflow != "saturate":
    raise ValueError(
      "lowprec.compensation='split' saturates at the largest bfloat16 (and "
      "keeps non-finite proposals out): set "
      f"--config.lowprec.overflow=saturate (got {lp.overflow!r})"
    )


def _check_eco(c) -> None:
  """`eco` folds into a first moment (SGD needs momentum) and wraps the
  optimizer, hiding the telemetry of what runs inside it or wraps it."""
  lp = c.lowprec
  if lowprec_config.compensation(lp) != "eco" or not lp.writeback:
    return
  for key, what in (
    ("decay_erasure", "counts the proposals inside eco"),
    ("state_targets", "wraps eco"),
  ):
    if lp.get(key, ()):
      raise ValueError(
        f"lowprec.{key} {what}, and the telemetry of one transform wrapped "
        "in another is not read (eco's own, or the wrapped one's): set it "
        "in an arm with --config.lowprec.compensation=none, or leave "
        f"lowprec.{key} out of this one"
      )
  if c.opt.name == "sgd" and not c.opt.momentum:
    raise ValueError(
      "lowprec.compensation='eco' folds the rounding error into the "
      "optimizer's first moment, and opt.name='sgd' with opt.momentum=0 "
      "keeps none: set --config.opt.momentum=0.9 (or "
      "--config.opt.name=adamw), or --config.lowprec.compensation=none"
    )


def _on_bfloat16_grid(name: str) -> bool:
  """Whether the format `name` has bfloat16's grid (True for a name the
  format check reports as unknown)."""
  if name.startswith("int"):
    return False
  try:
    f = lowprec.get_format(name)
  except ValueError:
    return True
  return (f.kind, f.exp_bits, f.man_bits) == ("float", 8, 7)


def _check_float32_predictions(lp) -> None:
  """`lowprec.trace_remedies` and `lowprec.state_targets`: well formed,
  and in a run whose weights, or state, they predict from float32."""
  lowprec_config.trace_remedies(lp)  # raises for a bad entry, naming the form
  lowprec_config.state_targets(lp)
  if lp.state and lp.state_targets:
    raise ValueError(
      "lowprec.state_targets predicts stored-state erasures from a run "
      "whose state is float32: set it in an arm without lowprec.state"
    )
  if lp.get("trace_remedies", ()) and lp.writeback:
    raise ValueError(
      "lowprec.trace_remedies predicts compensated write-back from a "
      f"float32 run, but this run writes back onto {lp.writeback!r}: set "
      "it on the float32 reference arm (lowprec.writeback=''), or "
      "lowprec.trace_remedies=() here"
    )


def resolve_all(config, cli_keys=()) -> list:
  """The resolved config of every selected arm x seed, all checked, and
  each one's optimizer built on the model's abstract parameters
  (`config_checks.check_builds`: nothing computed or compiled).

  Raises:
    ConfigError: any of them is invalid (nothing has run).
  """
  try:
    names.check_choice("study.kind", config.study.kind, RUNNERS)
    runs = [
      resolve(config, arm, seed, cli_keys)
      for arm in arms_of(config)
      for seed in seeds_of(config, arm)
    ]
    config_checks.check_builds(runs)
    return runs
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from None


def run_study(
  config, cli_keys=(), overrides: dict | None = None, options=None
) -> list:
  """Runs (or resumes, or skips) every selected arm x seed in turn.

  `options` (`ledger.Options`) says how existing run directories are
  treated; by default a changed config is refused (`ledger.ConfigChanged`).
  """
  runs = resolve_all(config, cli_keys)
  options = options or ledger.Options()
  return [RUNNERS[c.study.kind](c, overrides, options) for c in runs]

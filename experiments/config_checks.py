"""Checks of a resolved config's durations, cadences, sizes and sharding,
its optimizer's learning rate and decay rates, and a dry build of its
optimizer.

Each check raises `ValueError` naming the config key, the value and a fix,
before anything is written. `study.validate` calls `check(c)`;
`study.resolve_all` calls `check_builds(runs)` for every selected run.
"""

from __future__ import annotations

import json
import math

# key -> smallest allowed value (every duration and cadence is a step count)
MINIMUM = {
  "train.steps": 1,
  "train.eval_every_steps": 1,
  "train.probe_every_steps": 0,  # 0: off
  "train.init_from_step": 0,
  "train.virtual_shards": 0,  # 0: plain mean
  "train.fsdp": 1,
  "log.progress_every_steps": 1,
  "ckpt.every_steps": 0,  # 0: only at the end
  "ckpt.keep": 1,
  "opt.warmup_steps": 0,
  "data.batch_size": 1,
  "data.eval_batches": 1,
  "model.seq_len": 1,
}


def _get(c, key: str):
  section, name = key.split(".")
  return c[section][name]


def check_minimums(c) -> None:
  for key, low in MINIMUM.items():
    value = _get(c, key)
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{key}={value!r} must be an integer >= {low}")
    if value < low:
      what = {0: "must not be negative", 1: "must be positive"}[low]
      raise ValueError(
        f"{key}={value} {what} (at least {low}); e.g. "
        f"--config.{key}={max(low, 1)}"
      )
  if not str(c.log.results_dir).strip():
    raise ValueError(
      "log.results_dir is empty; name a directory, e.g. "
      "--config.log.results_dir=results"
    )


# key -> the value an error suggests: decay rates in [0, 1)
RATES = {"opt.b1": 0.9, "opt.b2": 0.95, "opt.momentum": 0.9}


def check_rates(c) -> None:
  """AdamW's `b1`, `b2` and SGD's `momentum` are decay rates: 0 <= b < 1."""
  for key, example in RATES.items():
    value = _get(c, key)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and 0 <= value < 1):
      raise ValueError(
        f"{key}={value!r} must be in 0 <= {key} < 1 (a decay rate: the "
        f"weight of the running average's past); e.g. --config.{key}="
        f"{example}"
      )


def check_lr(c) -> None:
  """`opt.lr`, the peak learning rate, is a positive finite number: with
  NaN or inf every proposal is non-finite, so no weight moves (a
  write-back keeps them) while the loss stays finite; a negative rate
  ascends the loss."""
  value = c.opt.lr
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not (number and math.isfinite(value) and value > 0):
    raise ValueError(
      f"opt.lr={value!r} must be a positive, finite number (the peak "
      "learning rate; a NaN or infinite one moves no weight, a negative "
      "one ascends the loss); e.g. --config.opt.lr=3e-4"
    )


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def check_batch(c, n_devices: int) -> None:
  """The global batch splits evenly in the run's sharding mode."""
  batch, parts, fsdp = c.data.batch_size, c.train.virtual_shards, c.train.fsdp
  if n_devices % fsdp:
    raise ValueError(
      f"train.fsdp={fsdp} must divide the device count {n_devices}"
    )
  if parts:  # with train.fsdp > 1 too: same bits as replicated
    if not (_is_pow2(parts) and parts % n_devices == 0):
      raise ValueError(
        f"train.virtual_shards={parts} must be a power of two and a "
        f"multiple of the device count {n_devices} (e.g. "
        f"{max(16, n_devices)}); or 0 to turn off the deterministic reduction"
      )
    if batch % parts:
      raise ValueError(
        f"data.batch_size={batch} is not divisible by "
        f"train.virtual_shards={parts}: use a multiple of {parts} (e.g. "
        f"{-(-batch // parts) * parts}), or another train.virtual_shards"
      )
  elif batch % n_devices:
    raise ValueError(
      f"data.batch_size={batch} is not divisible by the device count "
      f"{n_devices} (train.virtual_shards=0 shards the batch over every "
      f"device): use a multiple of {n_devices} (e.g. "
      f"{-(-batch // n_devices) * n_devices})"
    )


def check(c, n_devices: int | None = None) -> None:
  """Every check above; `n_devices` defaults to `jax.device_count()`."""
  check_minimums(c)
  check_lr(c)
  check_rates(c)
  if c.log.get("tensorboard", False):
    from experiments import tensorboard

    tensorboard.require()
  if c.study.kind == "train":
    if n_devices is None:
      import jax

      n_devices = jax.device_count()
    check_batch(c, n_devices)


def _one_line(e: Exception) -> str:
  return " ".join(str(e).split())


def abstract_params(c):
  """The model's parameters as `jax.ShapeDtypeStruct`s, or None where the
  task's data cannot be opened (the run reports that when it starts).

  Nothing is computed: `jax.eval_shape` of the task's init.
  """
  import jax

  from experiments import tasks

  try:
    task = tasks.build(c)
  except (OSError, ValueError, RuntimeError):
    return None
  return jax.eval_shape(task.init, jax.random.key(0))


def check_build(c, params) -> None:
  """Builds the run's optimizer chain and its state on abstract `params`
  (`jax.eval_shape`: nothing is computed or compiled), as the run will.

  Raises:
    ValueError: a transform refuses the config, when built or initialized
      (a `lowprec.state` rule that matches no moment, a compensated
      write-back on a grid it cannot take, ...); one line, led by the run
      and the config key the transform comes from.
  """
  import jax

  import lowprec
  from experiments import ledger, lowprec_config, optim

  lp = c.lowprec
  # Scales from the values: any scale will do.
  if lowprec_config.needs_params(lp):
    c = c.copy_and_resolve_references()
    c.unlock()
    c.lowprec.int_scale = 1.0
    c.lock()
    lp = c.lowprec
  where = "opt, lowprec"  # until the chain is built
  try:
    parts = optim.parts(c, jax.random.key(0))
    target = lowprec_config.writeback_target(lp)
    if target is not None:  # the run's weights start on the grid
      where = "lowprec.writeback"
      params = jax.eval_shape(lambda p: lowprec.to_grid(p, target), params)
    for key, tx in parts:
      where = key  # the part that refuses, for the message
      jax.eval_shape(tx.init, params)
  except ValueError as e:
    raise ValueError(
      f"{ledger.tag(c)} {where}: the optimizer refuses this config: "
      f"{_one_line(e)}"
    ) from None


def check_builds(runs) -> None:
  """`check_build` for every run, the abstract params built once per model
  and data (the optimizer's settings do not change them)."""
  params = {}
  for c in runs:
    if c.study.kind != "train":
      continue
    key = json.dumps([c.model.to_dict(), c.data.to_dict()], sort_keys=True)
    if key not in params:
      params[key] = abstract_params(c)
    if params[key] is not None:
      check_build(c, params[key])

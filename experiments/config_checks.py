"""Checks of a resolved config's durations, cadences, sizes and sharding.

Each check raises `ValueError` naming the config key, the value and a fix,
before anything is built or written. `study.validate` calls `check(c)`.
"""

from __future__ import annotations

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
  if c.log.get("tensorboard", False):
    from experiments import tensorboard

    tensorboard.require()
  if c.study.kind == "train":
    if n_devices is None:
      import jax

      n_devices = jax.device_count()
    check_batch(c, n_devices)

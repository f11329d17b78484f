"""The optax chain of a run, built from the config's `opt` and `lowprec`."""

from __future__ import annotations

import jax
import optax

import lowprec

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "constant")


def schedule(opt, steps: int) -> optax.Schedule:
  """Linear warmup, then cosine decay to `min_lr_ratio * lr` (or constant)."""
  if opt.schedule not in SCHEDULES:
    raise ValueError(
      f"unknown opt.schedule {opt.schedule!r}; valid: {', '.join(SCHEDULES)}"
    )
  warmup = min(opt.warmup_steps, max(steps - 1, 0))
  if opt.schedule == "constant":
    if warmup == 0:
      return optax.constant_schedule(opt.lr)
    return optax.join_schedules(
      [
        optax.linear_schedule(0.0, opt.lr, warmup),
        optax.constant_schedule(opt.lr),
      ],
      [warmup],
    )
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0 if warmup else opt.lr,
    peak_value=opt.lr,
    warmup_steps=warmup,
    decay_steps=max(steps, warmup + 1),
    end_value=opt.lr * opt.min_lr_ratio,
  )


def writeback_format(lp):
  """The write-back target of the config (a Format), or None for float32."""
  if not lp.writeback:
    return None
  scale = lp.int_scale if lp.writeback.startswith("int") else None
  return lowprec.get_format(lp.writeback, scale=scale)


def trace_target(spec: str):
  """`"bfloat16"` or `"bfloat16:stochastic"` as a reference-trace target."""
  name, _, rounding = spec.partition(":")
  return lowprec.freeze.Target(name, rounding or "nearest")


def writeback_target(lp):
  """The write-back's `fmt` argument: a Format, or rules keeping some paths
  in float32; None when the run trains in float32."""
  fmt = writeback_format(lp)
  if fmt is None or not lp.keep_float32:
    return fmt
  return [(lp.keep_float32, None), (".*", fmt)]


def build(config, key: jax.Array) -> optax.GradientTransformation:
  """clip -> AdamW/SGD -> write-back (low precision) or trace (float32)."""
  opt, lp = config.opt, config.lowprec
  if opt.name not in OPTIMIZERS:
    raise ValueError(
      f"unknown opt.name {opt.name!r}; valid: {', '.join(OPTIMIZERS)}"
    )
  lr = schedule(opt, config.train.steps)
  parts = []
  if opt.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(opt.clip_norm))
  if opt.name == "adamw":
    parts.append(
      optax.adamw(
        lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay
      )
    )
  else:
    parts.append(optax.sgd(lr, momentum=opt.momentum or None))
  target = writeback_target(lp)
  wb_key, trace_key = jax.random.split(key)
  if target is not None:
    needs_key = lp.rounding != "nearest"
    parts.append(
      lowprec.writeback(
        target,
        lp.rounding,
        key=wb_key if needs_key else None,
        overflow=lp.overflow,
      )
    )
  if lp.trace_targets:
    parts.append(
      lowprec.freeze.reference_trace(
        [trace_target(t) for t in lp.trace_targets],
        sample=lp.trace_sample,
        key=trace_key,
      )
    )
  return optax.chain(*parts)

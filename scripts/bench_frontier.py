"""Whole training steps of the frontier study's model, every arm's recipe.

Each arm of `configs/frontier.py` (its CPU-scale model, batch and
optimizer; the float32 arm without its traces, as a user would train)
builds its jitted step; the steps run interleaved, round by round, and
the ratios are to nearest bf16 write-back and to float32 AdamW.
"""

from __future__ import annotations

import statistics

import jax

from experiments import lowprec_config, study, train
from scripts.bench_train import _steps
from scripts.benchlib import Result, interleave

NEAREST = "bf16_rn"
FLOAT32 = "fp32"


def _configs(quick: bool) -> dict:
  from configs import frontier

  c = frontier.get_config("scale=smoke" if quick else None)
  arms = list(c.study.arms)
  if quick:  # the smoke arms and nearest write-back
    c.unlock()
    c.study.arms = {
      **c.study.arms.to_dict(),
      NEAREST: {"lowprec": frontier.BF16},
    }
    c.lock()
    arms = list(c.study.arms)
  out = {}
  for arm in arms:
    r = study.resolve(c, arm, 0)
    if arm == FLOAT32:  # the float32 recipe, not its predictions
      r.unlock()
      r.lowprec.update(lowprec_config.NO_PREDICTIONS)
      r.lock()
    out[arm] = r
  return out


def run(quick: bool = False) -> Result:
  steps = 5 if quick else 20
  rounds = 2 if quick else 5
  calls = {}
  for name, c in _configs(quick).items():
    r = train.build_run(c)
    batches = [r.put(r.task.data.batch(i)) for i in range(steps)]
    calls[name] = (_steps(r, batches), ())
  times = {
    name: [t / steps for t in ts]
    for name, ts in interleave(calls, rounds=rounds).items()
  }
  base = statistics.median(times[FLOAT32])
  return Result(
    f"frontier: whole train steps of its model ({jax.device_count()} "
    f"{jax.default_backend()} device(s))",
    times,
    (NEAREST, FLOAT32),
    notes=(f"float32 AdamW: {1 / base:,.1f} steps/s.",),
  )

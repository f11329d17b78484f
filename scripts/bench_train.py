"""Training-step throughput of a small GPT: float32 vs lowprec."""

from __future__ import annotations

import statistics

import jax

from configs import common
from experiments import train
from scripts.benchlib import Result, interleave

ARMS = {
  "float32 AdamW": {},
  "float32 AdamW (again)": {},
  "+ reference_trace (bf16, e4m3fn, e5m2)": {
    "trace_targets": ("bfloat16", "float8_e4m3fn", "float8_e5m2")
  },
  "bf16 write-back, nearest": {"writeback": "bfloat16"},
  "bf16 write-back, stochastic": {
    "writeback": "bfloat16",
    "rounding": "stochastic",
  },
}


def _config(quick: bool, lp: dict):
  c = common.get_config()
  c.model.update(dict(n_layer=2, d_model=128, n_head=4, seq_len=128))
  c.data.batch_size = 16
  c.train.steps = 1000
  c.lowprec.update(lp)
  if quick:
    c.model.update(dict(n_layer=1, d_model=64, seq_len=64))
  return c


def run(quick: bool = False) -> Result:
  steps = 5 if quick else 10
  rounds = 2 if quick else 7
  calls = {}
  for name, lp in ARMS.items():
    c = _config(quick, lp)
    r = train.build_run(c)
    batches = [r.put(r.task.data.batch(i)) for i in range(steps)]
    calls[name] = (_steps(r, batches), ())
  # Seconds per call are per `steps` steps; per step below.
  times = {
    name: [t / steps for t in ts]
    for name, ts in interleave(calls, rounds=rounds).items()
  }
  tokens = c.data.batch_size * c.model.seq_len
  base = statistics.median(times["float32 AdamW"])
  return Result(
    f"train: small GPT step ({tokens} tokens/step, "
    f"{jax.device_count()} {jax.default_backend()} device(s))",
    times,
    ("float32 AdamW",),
    notes=(f"float32 AdamW: {tokens / base:,.0f} tokens/s.",),
    extra={"tokens_per_step": tokens},
  )


def _steps(r, batches):
  """Runs the arm's steps from where its last call stopped."""
  box = [r.state]

  def run_steps():
    state = box[0]
    for b in batches:
      state, m = r.step_fn(state, b)
    box[0] = state
    return state, m

  return run_steps

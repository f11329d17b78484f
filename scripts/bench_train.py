"""Training-step throughput of a small GPT on CPU: float32 vs lowprec."""

from __future__ import annotations

import time

import jax

from configs import common
from experiments import train

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


def run(quick: bool = False) -> str:
  steps = 5 if quick else 10
  rounds = 2 if quick else 5
  runs = {}
  for name, lp in ARMS.items():
    c = _config(quick, lp)
    r = train.build_run(c)
    batches = [r.put(r.task.data.batch(i)) for i in range(steps)]
    state = r.state
    for b in batches[:2]:  # compile and warm up
      state, m = r.step_fn(state, b)
    jax.block_until_ready(m)
    runs[name] = [r, state, batches]
  # Interleave the arms round by round and keep each arm's best round, so
  # that load from other processes hits every arm alike.
  best = dict.fromkeys(runs, float("inf"))
  for _ in range(rounds):
    for name, entry in runs.items():
      r, state, batches = entry
      t0 = time.perf_counter()
      for b in batches:
        state, m = r.step_fn(state, b)
      jax.block_until_ready((state, m))
      best[name] = min(best[name], (time.perf_counter() - t0) / steps)
      entry[1] = state
  rows = list(best.items())
  tokens = c.data.batch_size * c.model.seq_len
  base = rows[0][1]
  lines = [
    f"### train: small GPT step ({tokens} tokens/step, "
    f"{jax.device_count()} CPU device(s))",
    "",
    "| arm | ms/step | tokens/s | ratio to float32 |",
    "|---|---:|---:|---:|",
  ]
  for name, dt in rows:
    lines.append(
      f"| {name} | {dt * 1e3:.1f} | {tokens / dt:,.0f} | {dt / base:.2f}x |"
    )
  return "\n".join(lines)

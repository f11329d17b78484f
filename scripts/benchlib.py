"""Timing helpers shared by the benchmark sections of `scripts/bench.py`."""

from __future__ import annotations

import statistics
import time

import jax


def median_time(fn, *args, repeats: int = 7, warmup: int = 2) -> float:
  """Median wall time in seconds of `fn(*args)`, results blocked on."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def table(
  title: str, rows: list[tuple[str, float]], baseline: str, *more: str
) -> str:
  """A Markdown table of times and ratios to the rows named as baselines."""
  bases = [baseline, *more]
  times = dict(rows)
  head = " | ".join(f"ratio to {b}" for b in bases)
  lines = [
    f"### {title}",
    "",
    f"| case | median ms | {head} |",
    "|---|---:|" + "---:|" * len(bases),
  ]
  for name, t in rows:
    ratios = " | ".join(f"{t / times[b]:.2f}x" for b in bases)
    lines.append(f"| {name} | {t * 1e3:.2f} | {ratios} |")
  return "\n".join(lines)

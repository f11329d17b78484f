"""Timing helpers shared by the benchmark sections of `scripts/bench.py`.

Every comparison runs its cases interleaved, round by round (the order
reversed every other round), so that a change in the machine's load hits
every case alike; a ratio is taken between two cases of the same round, and
its median and range over the rounds are reported together.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

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


def interleave(
  calls: dict[str, tuple[Callable, tuple]],
  rounds: int,
  repeats: int = 1,
  warmup: int = 2,
) -> dict[str, list[float]]:
  """Per case, one time per round: the median of `repeats` calls.

  `calls` maps a case name to `(fn, args)`. Each case is compiled and warmed
  up first; then every round times every case, in reversed order every
  other round.
  """
  for fn, args in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
  times: dict[str, list[float]] = {name: [] for name in calls}
  order = list(calls)
  for r in range(rounds):
    for name in order if r % 2 == 0 else order[::-1]:
      fn, args = calls[name]
      times[name].append(median_time(fn, *args, repeats=repeats, warmup=0))
  return times


@dataclasses.dataclass(frozen=True)
class Result:
  """The times of one comparison, and its ratios to baseline cases.

  Attributes:
    title: what was measured (sizes, device).
    times: case -> seconds per call, one entry per round (rounds paired).
    baselines: the cases ratios are taken to.
    notes: lines printed under the table.
    extra: numbers for the JSON output only (tokens per step, errors).
    columns: numbers shown beside the ratios, `{label: {case: value}}`
      (the label names the unit; a case without a value shows none).
  """

  title: str
  times: dict[str, list[float]]
  baselines: tuple[str, ...]
  notes: tuple[str, ...] = ()
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)
  columns: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

  def ratios(self, case: str, baseline: str) -> list[float]:
    """Per-round ratios of `case` to `baseline`."""
    return [
      t / b for t, b in zip(self.times[case], self.times[baseline], strict=True)
    ]

  def as_dict(self) -> dict[str, Any]:
    cases = {}
    for name, ts in self.times.items():
      ratio = {}
      for b in self.baselines:
        r = self.ratios(name, b)
        ratio[b] = {
          "median": statistics.median(r),
          "min": min(r),
          "max": max(r),
        }
      cases[name] = {
        "median_ms": statistics.median(ts) * 1e3,
        "min_ms": min(ts) * 1e3,
        "max_ms": max(ts) * 1e3,
        "ratio_to": ratio,
      }
    rounds = len(next(iter(self.times.values()), []))
    out = {
      "title": self.title,
      "rounds": rounds,
      "cases": cases,
      "notes": list(self.notes),
      **self.extra,
    }
    if self.columns:
      out["columns"] = self.columns
    return out

  def markdown(self) -> str:
    data = self.as_dict()
    head = " | ".join(
      [f"ratio to {b} (range)" for b in self.baselines] + list(self.columns)
    )
    lines = [
      f"### {self.title}",
      "",
      f"{data['rounds']} interleaved rounds; ratios are medians over the "
      "rounds of same-round ratios, with their range.",
      "",
      f"| case | median ms | {head} |",
      "|---|---:|" + "---:|" * (len(self.baselines) + len(self.columns)),
    ]
    for name, c in data["cases"].items():
      cells = " | ".join(
        [
          f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"
          for r in c["ratio_to"].values()
        ]
        + [_cell(col.get(name)) for col in self.columns.values()]
      )
      lines.append(f"| {name} | {c['median_ms']:.2f} | {cells} |")
    if self.notes:
      lines += ["", *self.notes]
    return "\n".join(lines)


def _cell(value: float | None) -> str:
  return "" if value is None else f"{value:.1f}"


def across_runs(results: list[Result]) -> dict[str, Any]:
  """Per case and baseline: the median ratio of each run, and their median
  and range over the runs (a run's ratio is its median over rounds)."""
  first = results[0]
  out: dict[str, Any] = {"title": first.title, "runs": len(results)}
  cases = {}
  for name in first.times:
    per = {}
    for b in first.baselines:
      meds = [statistics.median(r.ratios(name, b)) for r in results]
      per[b] = {
        "runs": meds,
        "median": statistics.median(meds),
        "min": min(meds),
        "max": max(meds),
      }
    cases[name] = per
  out["cases"] = cases
  return out


def across_runs_markdown(results: list[Result]) -> str:
  """`across_runs` as a Markdown table."""
  data = across_runs(results)
  baselines = results[0].baselines
  head = " | ".join(f"ratio to {b}" for b in baselines)
  lines = [
    f"### {data['title']}: {data['runs']} runs",
    "",
    "Median over the runs of each run's median ratio, with the range of the "
    "runs' ratios.",
    "",
    f"| case | {head} |",
    "|---|" + "---:|" * len(baselines),
  ]
  for name, per in data["cases"].items():
    cells = " | ".join(
      f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"
      for r in per.values()
    )
    lines.append(f"| {name} | {cells} |")
  return "\n".join(lines)

"""The time plan of `scripts/device_check.sh`: its parts, their order, the
seconds each is expected to take on one H200 and the limit it runs under.

The parts run in the order of their value: the environment, the golden
bits, the 124M step, the 390M step with its probe, the write-back families,
two benchmark sections, the frontier smoke. The limits add up to the
budget less `REPORT_S`, kept for writing the report, so every part gets a
result within the budget; a part that finishes early does not lend its
time to the next (the check then ends early).

Expected seconds are for a cold compilation cache, compile included, and
rest on the run of 2026-12-04 on one H200 (`device_runs/2026-12-04/`:
environment 5 s; golden bits 33-34 s per process, about 28 s of it
compiling 38 small programs; the 124M step 81 s with 52 s of compile for
unrolled layers, 16 s of building and 0.49 s a step; 25-29 s of compile
per further recipe) with the layers now compiled once as a scan
(`model.scan_layers`: 10-20 s for the 124M step, 15-30 s for the 390M).
`basis` says, per part, which. Left out of the check: the `ops`, `trace`,
`train`, `user_ops` and `frontier` benchmark sections (small CPU-scale
models: at `--quick` sizes a GPU times launch overhead; the families
measure the write-back recipes on the 124M width instead).
"""

from __future__ import annotations

import dataclasses

BUDGET_S = 480  # the whole check on the accelerator
REPORT_S = 10  # kept at the end for the report (written after every part)
DRY_LIMIT_S = 900  # per part in the CPU dry run (tiny shapes, a slow CPU)


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of the check.

  Attributes:
    name: the part's name in the report (`parts.tsv`, its output files).
    expected_s: seconds on one H200, compile included, cold cache.
    limit_s: the time limit it runs under.
    basis: where `expected_s` comes from.
  """

  name: str
  expected_s: int
  limit_s: int
  basis: str


PLAN = (
  Part("wheels", 2, 10, "measured 0 s: pure-Python wheels unpacked"),
  Part("env", 5, 15, "measured 5 s: Python, jax and the device"),
  Part(
    "golden_bits",
    62,
    80,
    "measured 33-34 s per setting, each in a process of its own; one "
    "process for both saves a start and the recipes' eager ops",
  ),
  Part(
    "step_freeze_gpt2_fp8",
    38,
    55,
    "measured 81 s less unrolled compile (52 s) plus a scanned one (15 s), "
    "10 steps of 0.49 s instead of 20",
  ),
  Part(
    "step_attention_reuse",
    95,
    115,
    "estimated: build 20 s, compile 25 s, 10 steps of about 0.8 s, the "
    "lean probe's three programs about 35 s",
  ),
  Part(
    "families",
    75,
    90,
    "estimated: 7 recipes of 2 scanned layers at the 124M width, about "
    "10 s each (build, compile, 4 steps)",
  ),
  Part(
    "bench_rounding",
    12,
    18,
    "estimated: 8 small programs of about 0.7 s (the golden bits' rate)",
  ),
  Part(
    "bench_writeback",
    48,
    50,
    "estimated: 19 optimizer steps compiled on 4 leaves of 64M parameters "
    "in all, about 2 s each (20 leaves and 17 steps did not finish in 55 "
    "s; a leaf's size does not lengthen its compile), and 2 s more for "
    "each of the five kernel rows, whose two distinct Triton kernels (a "
    "matrix's, a bias's) Triton compiles (unmeasured)",
  ),
  Part(
    "frontier",
    32,
    37,
    "estimated: the smoke's float32 arm (4 steps, every trace) and the advisor",
  ),
)


def names() -> tuple[str, ...]:
  return tuple(p.name for p in PLAN)


def part(name: str) -> Part:
  """The part `name`; an error lists the valid names."""
  for p in PLAN:
    if p.name == name:
      return p
  raise KeyError(f"no part {name!r} in the plan; valid: {', '.join(names())}")


def budget(dry_run: bool = False) -> int:
  """Seconds for the whole check (on the CPU: every part at its dry
  limit, and the report's)."""
  return len(PLAN) * DRY_LIMIT_S + REPORT_S if dry_run else BUDGET_S


def limit(name: str, dry_run: bool = False) -> int:
  """The time limit of part `name`."""
  return DRY_LIMIT_S if dry_run else part(name).limit_s


def markdown() -> str:
  """The plan as a Markdown table, with its sums."""
  lines = [
    "| part | expected s (H200) | limit s |",
    "|---|---:|---:|",
  ]
  lines += [f"| {p.name} | {p.expected_s} | {p.limit_s} |" for p in PLAN]
  lines.append(
    f"| sum | {sum(p.expected_s for p in PLAN)} | "
    f"{sum(p.limit_s for p in PLAN)} |"
  )
  lines.append(
    f"\nbudget {BUDGET_S} s: the parts' limits and {REPORT_S} s for the report"
  )
  return "\n".join(lines) + "\n"

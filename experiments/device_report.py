"""The report of `scripts/device_check.sh`: one JSON file, one Markdown table.

`device_check.sh` runs each part of its plan (`experiments/device_plan.py`:
wheels, environment, golden bits, a few steps of each full-scale config,
the write-back families, two benchmark sections, the frontier smoke) under
its own time limit, keeps its output in a parts folder and appends `name,
exit status, seconds, limit` to `parts.tsv` there; after each part it
writes the report again, so a check stopped midway keeps what finished.
`collect` reads that folder; a part that failed or timed out is reported
as such, one not reached yet as not run, and the rest still are.
"""

from __future__ import annotations

import dataclasses
import json
import os

from experiments import device_plan

# The distributions of the accelerator machine's image (with their own
# dependencies); what else the check imports travels as wheels
# (scripts/device_wheels.txt).
DEVICE_IMAGE = (
  "jax",
  "jaxlib",
  "flax",
  "optax",
  "orbax-checkpoint",
  "chex",
  "absl-py",
  "ml-dtypes",
  "matplotlib",
)
CONFIGS = ("freeze_gpt2_fp8", "attention_reuse")
# The benchmark sections the plan runs (`bench_<section>` parts).
BENCH_SECTIONS = tuple(
  name.removeprefix("bench_")
  for name in device_plan.names()
  if name.startswith("bench_")
)
# What each full-scale result reports, with its Markdown column.
_COLUMNS = (
  ("params", "params"),
  ("tokens_per_step", "tokens/step"),
  ("tokens_per_s", "tokens/s"),
  ("mfu", "MFU"),
  ("peak_device_bytes", "peak device memory"),
  ("compile_s", "compile s"),
  # XLA:GPU compiles identical fusions once (experiments.costs.fusions).
  ("fusions", "fusions"),
  ("distinct_fusions", "distinct fusions"),
  ("step_s", "step s"),
)


def environment() -> dict:
  """Versions and devices of this process (imports jax), and the
  persistent compilation cache the parts share: its folder and how many
  programs it held when the check started (with some, the parts' compile
  times are partly cache reads)."""
  import platform

  import jax
  import jaxlib

  devices = jax.devices()
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "backend": jax.default_backend(),
    "devices": len(devices),
    "device_kind": devices[0].device_kind,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "compilation_cache": cache or None,
    "cached_programs": _cached_programs(cache),
  }


def _cached_programs(cache: str) -> int:
  """The programs in a JAX compilation cache folder (`<key>-cache` files)."""
  if not cache or not os.path.isdir(cache):
    return 0
  return sum(n.endswith("-cache") for n in os.listdir(cache))


def _status(rc: int) -> str:
  if rc == 0:
    return "ok"
  if rc in (124, 137):
    return "timed out"
  return f"failed (exit {rc})"


def parts(parts_dir: str) -> list[dict]:
  """The rows of `parts.tsv`: name, status, exit status, seconds, limit."""
  rows = []
  path = os.path.join(parts_dir, "parts.tsv")
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f:
      name, rc, seconds, limit = line.rstrip("\n").split("\t")
      status = "skipped" if rc == "skipped" else _status(int(rc))
      rows.append(
        dict(
          name=name,
          status=status,
          rc=None if rc == "skipped" else int(rc),
          seconds=float(seconds),
          limit_s=float(limit),
        )
      )
  return rows


def _last_json_line(path: str):
  """The last line of a file that parses as a JSON object, or None."""
  lines = _json_lines(path)
  return lines[-1] if lines else None


def _bench(parts_dir: str) -> dict:
  """Per section: case -> ratio to each baseline (median, min, max), the
  section's columns (`{label: {case: value}}`; the write-back section's
  bytes a parameter and GB/s) and its notes (the write-back section's
  bits of a kernel against the XLA path)."""
  out = {}
  for section in BENCH_SECTIONS:
    path = os.path.join(parts_dir, f"bench_{section}.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      data = json.load(f).get(section, {})
    out[section] = {
      "title": data.get("title", section),
      "ratios": {
        case: c["ratio_to"] for case, c in data.get("cases", {}).items()
      },
      "columns": data.get("columns", {}),
      "notes": data.get("notes", []),
    }
  return out


def _json_lines(path: str) -> list[dict]:
  """Every line of a file that parses as a JSON object."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f.read().splitlines():
      if line.startswith("{"):
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          continue
  return out


def _advice(parts_dir: str) -> list[str]:
  """The advisor's recommendation lines from the frontier part."""
  path = os.path.join(parts_dir, "frontier.out")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().splitlines()
  if "Recommended" not in "\n".join(lines):
    return []
  start = next(i for i, x in enumerate(lines) if x.startswith("Recommended"))
  return [x for x in lines[start:] if x.startswith(("Recommended", "- "))]


def collect(parts_dir: str, dry_run: bool = False) -> dict:
  """Everything the parts left in `parts_dir`, as one dict."""
  configs = {}
  for name in CONFIGS:
    result = _last_json_line(os.path.join(parts_dir, f"step_{name}.out"))
    if result is not None:
      configs[name] = result
  return {
    "dry_run": dry_run,
    "env": _last_json_line(os.path.join(parts_dir, "env.out")) or {},
    "plan": [dataclasses.asdict(p) for p in device_plan.PLAN],
    "parts": parts(parts_dir),
    "configs": configs,
    "families": _json_lines(os.path.join(parts_dir, "families.out")),
    "bench": _bench(parts_dir),
    "golden_bits": _golden_bits(parts_dir),
    "advice": _advice(parts_dir),
  }


# The settings of the golden-bits part (experiments/golden_bits.SETTINGS),
# with their column titles.
GOLDEN_RUNS = {
  "default": "default flags",
  "no_excess_precision": "--xla_allow_excess_precision=false",
}


def _golden_bits(parts_dir: str) -> dict:
  """`{setting: {recipe: "equal" or the first difference}}` of the
  golden-bits part (each setting written as it finishes)."""
  path = os.path.join(parts_dir, "golden_bits.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError:  # stopped while writing
      return {}


def _cell(key: str, value) -> str:
  if value is None:
    return "n/a"
  if key == "mfu":
    return f"{value:.1%}"
  if key == "peak_device_bytes":
    return f"{value / 1e9:.1f} GB"
  if key in ("compile_s", "step_s"):
    return f"{value:.2f}"
  return f"{value:,.0f}"


def markdown(report: dict) -> str:
  """The report as Markdown: environment, parts, configs, benchmarks."""
  env = report["env"]
  lines = ["# Device check" + (" (dry run)" if report["dry_run"] else ""), ""]
  if env:
    lines += [
      f"{env.get('devices')} devices: {env.get('device_kind')}; jax "
      f"{env.get('jax')}, jaxlib {env.get('jaxlib')}, Python "
      f"{env.get('python')}",
      "",
    ]
    if env.get("cached_programs"):
      lines += [
        f"The compilation cache ({env['compilation_cache']}) held "
        f"{env['cached_programs']} programs at the start: compile times "
        "below are partly cache reads.",
        "",
      ]
  lines += _part_lines(report)
  lines += ["", "| config | " + " | ".join(c for _, c in _COLUMNS) + " |"]
  lines.append("|---|" + "---:|" * len(_COLUMNS))
  for name in CONFIGS:
    r = report["configs"].get(name)
    if r is None:
      lines.append(f"| {name} | " + " | ".join("-" for _ in _COLUMNS) + " |")
      continue
    r = dict(r)
    if r.get("peak_device_bytes") is None:  # a CPU: the process's peak
      r["peak_device_bytes"] = r.get("peak_rss_bytes")
    cells = " | ".join(_cell(k, r.get(k)) for k, _ in _COLUMNS)
    lines.append(f"| {name} | {cells} |")
  lines += _family_lines(report.get("families", []))
  lines += _golden_lines(report.get("golden_bits", {}))
  lines += ["", "| benchmark | case | ratio to | median (range) |"]
  lines.append("|---|---|---|---:|")
  for section, data in report["bench"].items():
    for case, ratios in data["ratios"].items():
      for base, r in ratios.items():
        if case == base:
          continue
        lines.append(
          f"| {section} | {case} | {base} | {r['median']:.2f}x "
          f"({r['min']:.2f}-{r['max']:.2f}) |"
        )
  lines += _column_lines(report["bench"])
  for section, data in report["bench"].items():
    notes = data.get("notes", [])
    lines += [""] + [f"{section}: {n}" for n in notes] if notes else []
  advice = report.get("advice", [])
  lines += [
    "",
    "Frontier smoke, the advisor's recommendation:"
    if advice
    else "Frontier smoke: no recommendation (see the parts above).",
  ]
  lines += advice
  return "\n".join(lines) + "\n"


# A write-back row moving XLA's bytes at this fraction of AdamW's rate or
# more is at memory speed: bound by its bytes (docs/benchmarks.md says
# what that decides).
AT_MEMORY_SPEED = 0.7


def _column_lines(bench: dict) -> list[str]:
  """A table per benchmark section with columns beside its ratios; where
  the section has a `GB/s` column and an `adamw` row, each row's rate as
  a fraction of AdamW's, and whether that is memory speed."""
  lines = []
  for section, data in bench.items():
    columns = data.get("columns") or {}
    if not columns:
      continue
    rate = columns.get("GB/s", {})
    base = rate.get("adamw")
    extra = ["GB/s / adamw's", "bound by"] if base else []
    lines += ["", f"| {section} | " + " | ".join([*columns, *extra]) + " |"]
    lines.append("|---|" + "---:|" * len(columns) + "---|" * len(extra))
    for case in data["ratios"]:
      cells = [
        "-" if c.get(case) is None else f"{c[case]:.1f}"
        for c in columns.values()
      ]
      if base:
        if rate.get(case) is None:
          cells += ["-", "-"]
        else:
          share = rate[case] / base
          bound = (
            "bytes" if share >= AT_MEMORY_SPEED else "arithmetic or launches"
          )
          cells += [f"{share:.2f}", bound]
      lines.append(f"| {case} | {' | '.join(cells)} |")
  return lines


def _family_lines(families: list[dict]) -> list[str]:
  """Per write-back family on one model: tokens/s, step time relative to
  float32 AdamW's, peak memory."""
  if not families:
    return ["", "Write-back families: not run (see the parts above)."]
  base = next((f for f in families if f.get("recipe") == "float32"), None)
  first = families[0]
  model = first["config"]
  if first.get("params"):  # the families run fewer layers than the config
    model += f", {first['params']:,} params"
  lines = [
    "",
    f"| {model}: recipe | tokens/s | step / float32's | peak memory |",
    "|---|---:|---:|---:|",
  ]
  for f in families:
    ratio = base and f["step_s"] / base["step_s"]
    mem = f.get("peak_device_bytes") or f.get("peak_rss_bytes")
    lines.append(
      f"| {f.get('recipe')} | {f['tokens_per_s']:,.0f} | "
      f"{'n/a' if not ratio else f'{ratio:.2f}x'} | "
      f"{_cell('peak_device_bytes', mem)} |"
    )
  return lines


def _part_lines(report: dict) -> list[str]:
  """Per part of the plan, in its order: status, seconds, the plan's
  expected seconds on an H200 and limit, and the peak memory where the part
  measures it; parts not reached yet read `not run`."""
  ran = {p["name"]: p for p in report["parts"]}
  plan = {p["name"]: p for p in report.get("plan", [])}
  lines = [
    "| part | status | seconds | expected s (H200) | limit s | peak memory |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for name in [*plan, *(n for n in ran if n not in plan)]:
    p = ran.get(name, {"status": "not run", "seconds": 0.0})
    expected = plan[name]["expected_s"] if name in plan else "-"
    limit = p.get("limit_s", plan.get(name, {}).get("limit_s"))
    peak = _part_peak(report, name)
    lines.append(
      f"| {name} | {p['status']} | {p['seconds']:.0f} | {expected} | "
      f"{'-' if limit is None else f'{limit:.0f}'} | "
      f"{'-' if peak is None else _cell('peak_device_bytes', peak)} |"
    )
  return lines


def _part_peak(report: dict, name: str):
  """The peak device memory (a CPU: the process's resident peak) a part
  measured, in bytes, or None: the steps, and the families' largest."""
  results = []
  if name.startswith("step_"):
    results = [report["configs"].get(name.removeprefix("step_"))]
  elif name == "families":
    results = report.get("families", [])
  peaks = [
    r.get("peak_device_bytes") or r.get("peak_rss_bytes")
    for r in results
    if r is not None
  ]
  peaks = [x for x in peaks if x]
  return max(peaks) if peaks else None


def _golden_lines(golden: dict) -> list[str]:
  """Golden bits per recipe under each setting: `equal`, or the first
  differing element with both values; AdamW records are marked as
  information."""
  if not golden:
    return ["", "Golden bits: not run (see the parts above)."]
  runs = [r for r in golden if r in GOLDEN_RUNS]
  lines = [
    "",
    "| golden bits: recipe | "
    + " | ".join(GOLDEN_RUNS[r] for r in runs)
    + " |",
  ]
  lines.append("|---|" + "---|" * len(runs))
  recipes = sorted({n for r in runs for n in golden[r]})
  for n in recipes:
    cells = []
    for r in runs:
      v = golden[r].get(n, "not run")
      if v != "equal" and n.startswith("adamw/"):
        v = f"information: {v}"
      cells.append(v.replace("|", "\\|"))
    lines.append(f"| {n} | " + " | ".join(cells) + " |")
  return lines


def write(parts_dir: str, out_dir: str, dry_run: bool = False) -> dict:
  """Writes `device_check.json` and `device_check.md` into `out_dir`."""
  report = collect(parts_dir, dry_run)
  os.makedirs(out_dir, exist_ok=True)
  for name, text in (
    ("device_check.json", json.dumps(report, indent=1) + "\n"),
    ("device_check.md", markdown(report)),
  ):
    tmp = os.path.join(out_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, os.path.join(out_dir, name))
  return report

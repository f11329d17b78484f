"""The report of `scripts/device_check.sh`: one JSON file, one Markdown table.

`device_check.sh` runs each part (environment, wheels, a few steps of each
full-scale config, each benchmark section) under its own time limit, keeps
its output in a parts folder and appends `name, exit status, seconds,
limit` to `parts.tsv` there. `collect` reads that folder; a part that
failed or timed out is reported as such and the rest still are.
"""

from __future__ import annotations

import json
import os

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
BENCH_SECTIONS = (
  "rounding",
  "writeback",
  "trace",
  "ops",
  "train",
  "user_ops",
  "frontier",
)
# What each full-scale result reports, with its Markdown column.
_COLUMNS = (
  ("params", "params"),
  ("tokens_per_step", "tokens/step"),
  ("tokens_per_s", "tokens/s"),
  ("mfu", "MFU"),
  ("peak_device_bytes", "peak device memory"),
  ("compile_s", "compile s"),
  ("step_s", "step s"),
)


def environment() -> dict:
  """Versions and devices of this process (imports jax)."""
  import platform

  import jax
  import jaxlib

  devices = jax.devices()
  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "backend": jax.default_backend(),
    "devices": len(devices),
    "device_kind": devices[0].device_kind,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


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
  """Per section: case -> ratio to each baseline (median, min, max)."""
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
    "parts": parts(parts_dir),
    "configs": configs,
    "families": _json_lines(os.path.join(parts_dir, "families.out")),
    "bench": _bench(parts_dir),
    "golden_bits": _golden_bits(parts_dir),
    "advice": _advice(parts_dir),
  }


GOLDEN_RUNS = {
  "golden_bits": "default flags",
  "golden_bits_no_excess": "--xla_allow_excess_precision=false",
}


def _golden_bits(parts_dir: str) -> dict:
  """`{run: {recipe: "equal" or the first difference}}` of the golden-bits
  parts that left their comparison."""
  out = {}
  for name in GOLDEN_RUNS:
    path = os.path.join(parts_dir, f"{name}.json")
    if os.path.exists(path):
      with open(path) as f:
        out[name] = json.load(f)
  return out


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
  lines += ["| part | status | seconds | limit s |", "|---|---|---:|---:|"]
  for p in report["parts"]:
    lines.append(
      f"| {p['name']} | {p['status']} | {p['seconds']:.0f} | "
      f"{p['limit_s']:.0f} |"
    )
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
  advice = report.get("advice", [])
  lines += [
    "",
    "Frontier smoke, the advisor's recommendation:"
    if advice
    else "Frontier smoke: no recommendation (see the parts above).",
  ]
  lines += advice
  return "\n".join(lines) + "\n"


def _family_lines(families: list[dict]) -> list[str]:
  """Per write-back family on one model: tokens/s, step time relative to
  float32 AdamW's, peak memory."""
  if not families:
    return ["", "Write-back families: not run (see the parts above)."]
  base = next((f for f in families if f.get("recipe") == "float32"), None)
  lines = [
    "",
    f"| {families[0]['config']}: recipe | tokens/s | step / float32's | "
    "peak memory |",
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


def _golden_lines(golden: dict) -> list[str]:
  """Golden bits per recipe under each flag setting: `equal`, or the
  first differing element with both values; AdamW records are marked as
  information."""
  if not golden:
    return ["", "Golden bits: not run (see the parts above)."]
  runs = [r for r in GOLDEN_RUNS if r in golden]
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

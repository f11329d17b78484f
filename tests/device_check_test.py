"""scripts/device_check.sh: its plan, its CPU dry run, its report, its
environment.

The plan (experiments/device_plan.py) fits the budget: its limits add up
to it less the report's reserve, in the order of value, each above the
part's expected time. The dry run is the script as an accelerator machine
runs it (`python3`, every part, the report), on the CPU with tiny shapes,
inside a Python that hides every installed package the machine's image
lacks and the wheel list does not bring: an import the list misses fails
here, not there. A check stopped after a part keeps that part's report.
Also: the report's reading of failed, timed-out and unreached parts, the
XLA flags (no CPU flag on an accelerator), the wheel list, and that
DeprecationWarnings from our own modules fail the test run.
"""

import importlib.metadata
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import warnings

import pytest
from packaging.requirements import Requirement

from experiments import device_plan, device_report, golden_bits, xla_flags
from scripts import bench_writeback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = ("lowprec", "experiments", "configs", "scripts")


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def wheel_list() -> dict[str, str]:
  """scripts/device_wheels.txt as {name: version}."""
  out = {}
  with open(os.path.join(ROOT, "scripts", "device_wheels.txt")) as f:
    for line in f:
      line = line.split("#")[0].strip()
      if line:
        name, _, version = line.partition("==")
        out[_norm(name)] = version
  return out


def _closure(names) -> set[str]:
  """The distributions `names` need, themselves included (no extras)."""
  todo, seen = [_norm(n) for n in names], set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    try:
      reqs = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue
    for text in reqs:
      req = Requirement(text)
      if req.marker is None or req.marker.evaluate({"extra": ""}):
        todo.append(_norm(req.name))
  return seen


def hidden_modules() -> list[str]:
  """Top-level modules of installed packages the device would not have."""
  allowed = _closure([*device_report.DEVICE_IMAGE, *wheel_list()])
  allowed |= {"pip", "setuptools", "wheel"}
  hidden = []
  for module, dists in importlib.metadata.packages_distributions().items():
    if module in OURS or module.startswith("_"):
      continue
    if not any(_norm(d) in allowed for d in dists):
      hidden.append(module)
  return sorted(hidden)


GUARD = """\
import importlib.abc
import sys

HIDDEN = frozenset({hidden!r})


class _NotOnTheDevice(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] in HIDDEN:
      raise ModuleNotFoundError(
        f"No module named {{name!r}} (not on the device image, not in "
        "scripts/device_wheels.txt)", name=name)
    return None


sys.meta_path.insert(0, _NotOnTheDevice())
"""


def _device_like_env(tmp_path):
  """PATH with `python3` = this interpreter; PYTHONPATH with the guard."""
  guard = tmp_path / "guard"
  guard.mkdir()
  hidden = hidden_modules()
  (guard / "sitecustomize.py").write_text(GUARD.format(hidden=hidden))
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  wrapper = bin_dir / "python3"
  wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
  wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
  env["PATH"] = f"{bin_dir}:{env['PATH']}"
  env["PYTHONPATH"] = str(guard)
  env["OUT"] = str(tmp_path / "out")
  env["DEVICE_CHECK_SITE"] = str(tmp_path / "site")
  env["DEVICE_CHECK_DRY"] = "1"
  return env, hidden


def test_the_guard_hides_what_the_device_lacks(tmp_path):
  env, hidden = _device_like_env(tmp_path)
  # Packages the test venv has and the device image does not.
  assert {"sklearn", "tensorboardX", "pytest"} <= set(hidden)
  assert not {"jax", "flax", "orbax", "ml_collections", "gfloat"} & set(hidden)
  run = subprocess.run(
    ["python3", "-c", "import sklearn"], env=env, capture_output=True
  )
  assert run.returncode != 0 and b"not on the device image" in run.stderr


# The parts in the order of their value (the wheels, when there are any,
# come first: the rest imports them).
ORDER = (
  "wheels",
  "env",
  "golden_bits",
  "step_freeze_gpt2_fp8",
  "step_attention_reuse",
  "families",
  "bench_rounding",
  "bench_writeback",
  "frontier",
)


def test_plan_fits_the_budget_in_the_order_of_value():
  plan = device_plan.PLAN
  assert device_plan.names() == ORDER
  assert device_plan.BUDGET_S == 480  # 8 minutes on the accelerator
  limits = sum(p.limit_s for p in plan)
  assert limits + device_plan.REPORT_S == device_plan.BUDGET_S
  for p in plan:
    assert 0 < p.expected_s < p.limit_s, p
    assert p.basis, p
  # Every benchmark section the plan names exists.
  from scripts import bench

  assert set(device_report.BENCH_SECTIONS) <= set(bench.SECTIONS)
  assert device_report.BENCH_SECTIONS == ("rounding", "writeback")


def test_docs_show_the_plan_as_it_is():
  with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
    docs = f.read()
  table = device_plan.markdown().split("\n\n")[0]
  assert table in docs


def test_plan_table_and_limits_from_the_command_line():
  def cli(*args):
    return subprocess.run(
      [sys.executable, "-m", "scripts.device_report", *args],
      cwd=ROOT,
      capture_output=True,
      text=True,
    )

  table = cli("--plan").stdout
  for p in device_plan.PLAN:
    assert f"| {p.name} | {p.expected_s} | {p.limit_s} |" in table
  expected = sum(p.expected_s for p in device_plan.PLAN)
  limits = device_plan.BUDGET_S - device_plan.REPORT_S
  assert f"| sum | {expected} | {limits} |" in table
  families = device_plan.part("families").limit_s
  assert cli("--limit", "families").stdout == f"{families}\n"
  dry = str(device_plan.DRY_LIMIT_S) + "\n"
  assert cli("--limit", "families", "--dry_run").stdout == dry
  assert cli("--budget").stdout == "480\n"
  assert cli("--reserve").stdout == f"{device_plan.REPORT_S}\n"
  bad = cli("--limit", "step_gpt3")
  assert bad.returncode == 2 and "valid: wheels, env," in bad.stderr


def test_a_check_stopped_after_a_part_keeps_its_report(tmp_path):
  """The report is rewritten after every part: killed while the golden
  bits run, the check leaves the environment's row and the plan's other
  parts as not run."""
  env, _ = _device_like_env(tmp_path)
  out = tmp_path / "out"
  proc = subprocess.Popen(
    ["bash", "scripts/device_check.sh"],
    cwd=ROOT,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
  )
  try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
      started = (out / "device_check" / "golden_bits.err").exists()
      if started and (out / "device_check.json").exists():
        break
      time.sleep(0.2)
    else:
      pytest.fail("the golden bits never started")
  finally:
    _kill_session(proc.pid)
    proc.wait()
  report = json.loads((out / "device_check.json").read_text())
  assert [p["name"] for p in report["parts"]] == ["env"]
  assert report["env"]["backend"] == "cpu"
  md = (out / "device_check.md").read_text()
  assert "| env | ok |" in md
  for name in ORDER[2:]:
    assert f"| {name} | {_row(name, 'not run', 0)} | - |" in md


def _kill_session(sid: int) -> None:
  """Kills the processes of session `sid` (the check and its parts:
  `timeout` puts each part in a process group of its own), by their ids."""
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        # The fields after the command's closing parenthesis: state, ppid,
        # pgrp, session.
        session = int(f.read().rpartition(")")[2].split()[3])
    except (OSError, ValueError, IndexError):
      continue
    if session == sid:
      try:
        os.kill(int(entry), signal.SIGKILL)
      except ProcessLookupError:
        pass


def test_a_check_out_of_time_skips_every_part_in_the_plans_order(tmp_path):
  env, _ = _device_like_env(tmp_path)
  env["DEVICE_CHECK_BUDGET_S"] = str(device_plan.REPORT_S)  # no time left
  run = subprocess.run(
    ["bash", "scripts/device_check.sh"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 1
  assert run.stdout.startswith(device_plan.markdown())  # the plan first
  report = json.loads((tmp_path / "out" / "device_check.json").read_text())
  assert [p["name"] for p in report["parts"]] == list(ORDER[1:])  # dry
  assert {p["status"] for p in report["parts"]} == {"skipped"}


@pytest.mark.slow
def test_dry_run_of_device_check_on_the_cpu(tmp_path):
  env, _ = _device_like_env(tmp_path)
  run = subprocess.run(
    ["bash", "scripts/device_check.sh"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=3600,
  )
  out = tmp_path / "out"
  logs = ""
  for p in sorted((out / "device_check").glob("*.err")):
    logs += f"--- {p.name}\n{p.read_text()[-2000:]}\n"
  assert run.returncode == 0, run.stdout + run.stderr + logs
  # The plan it expects on the accelerator, before the parts.
  plan = device_plan.markdown()
  assert run.stdout.startswith(plan), run.stdout[:2000]
  assert f"under {device_plan.DRY_LIMIT_S} s" in run.stdout
  report = json.loads((out / "device_check.json").read_text())
  assert report["dry_run"] is True
  names = [p["name"] for p in report["parts"]]
  assert names == list(ORDER[1:])  # no wheels to install on the CPU
  assert all(p["status"] == "ok" for p in report["parts"]), report["parts"]
  assert all(p["limit_s"] == device_plan.DRY_LIMIT_S for p in report["parts"])
  assert [p["name"] for p in report["plan"]] == list(ORDER)
  assert report["env"]["backend"] == "cpu"
  for name in device_report.CONFIGS:
    r = report["configs"][name]
    assert r["tokens_per_s"] > 0 and r["compile_s"] > 0, r
    assert len(r["losses"]) == 2 and all(0 < x < 10 for x in r["losses"])
  assert report["configs"]["attention_reuse"]["probe"]  # the probe ran
  families = [f["recipe"] for f in report["families"]]
  assert families == [
    "float32", "bf16_rn", "bf16_sr", "bf16_kahan", "bf16_split8",
    "bf16_eco", "bf16_sr+q8",
  ]  # fmt: skip
  assert all(f["tokens_per_s"] > 0 for f in report["families"])
  # Two layers: more parameters than the one-layer step of the same width.
  step_params = report["configs"]["freeze_gpt2_fp8"]["params"]
  assert all(f["params"] > step_params for f in report["families"])
  assert report["advice"][0].startswith("Recommended (")
  assert len(report["advice"]) >= 6  # a line per group
  for section in ("rounding", "writeback"):
    ratios = report["bench"][section]["ratios"]
    assert ratios and all(
      r["median"] > 0 for case in ratios.values() for r in case.values()
    )
  # Beside the write-back ratios, every row's bytes and the rate.
  columns = report["bench"]["writeback"]["columns"]
  assert set(columns["GB/s"]) == set(report["bench"]["writeback"]["ratios"])
  # Each kernel row against the XLA path's, bit for bit (on this CPU
  # both run the XLA path).
  notes = report["bench"]["writeback"]["notes"]
  quick = [r for r in bench_writeback.SAME_BITS if r in bench_writeback.QUICK]
  assert len(notes) == len(quick) == 5
  for note in notes:
    assert ": params after 2 steps equal to" in note
  assert sum("scale_by_stored_adam: params" in n for n in notes) == 4
  md = (out / "device_check.md").read_text()
  assert md.startswith("# Device check (dry run)")
  assert "| freeze_gpt2_fp8 | 21,984 |" in md
  assert f"| wheels | {_row('wheels', 'not run', 0)} | - |" in md
  bench = device_plan.part("bench_rounding").expected_s
  dry = device_plan.DRY_LIMIT_S
  assert re.search(
    rf"\| bench_rounding \| ok \| \d+ \| {bench} \| {dry} \|", md
  )
  # The steps and the families report their peak memory.
  for name in ("step_freeze_gpt2_fp8", "step_attention_reuse", "families"):
    assert re.search(rf"\| {name} \| ok \| .* \| \d+\.\d GB \|", md), name
  assert re.search(r"\| freeze_gpt2_fp8, [\d,]+ params: recipe \|", md)
  assert "| float32 |" in md and "| 1.00x |" in md
  assert "Frontier smoke, the advisor's recommendation:" in md
  # The golden bits, on the CPU, equal the file under both settings.
  assert list(report["golden_bits"]) == list(golden_bits.SETTINGS)
  for verdicts in report["golden_bits"].values():
    assert set(verdicts) == set(golden_bits.transforms())
    assert all(v == "equal" for v in verdicts.values()), verdicts
  assert "| writeback/bfloat16/stochastic | equal | equal |" in md


def test_golden_bits_table_shows_the_first_difference_and_information(
  tmp_path,
):
  d = _parts_dir(tmp_path, [("env", "0", "3", "60")])
  diff = "params['w'][1, 3]: expected 0.5, got 0.625 (1 of 256 elements differ)"
  verdicts = {"kahan/bfloat16/bfloat16/nearest": diff, "adamw/x": diff}
  (d / "golden_bits.json").write_text(
    json.dumps({"default": verdicts, "no_excess_precision": {"adamw/x": diff}})
  )
  report = device_report.write(str(d), str(tmp_path / "out"))
  assert set(report["golden_bits"]) == set(golden_bits.SETTINGS)
  md = (tmp_path / "out" / "device_check.md").read_text()
  head = "| golden bits: recipe | default flags | "
  assert head + "--xla_allow_excess_precision=false |" in md
  assert f"| kahan/bfloat16/bfloat16/nearest | {diff} | not run |" in md
  assert f"| adamw/x | information: {diff} | information: {diff} |" in md


def test_golden_bits_of_a_part_stopped_while_writing_read_as_not_run(
  tmp_path,
):
  d = _parts_dir(tmp_path, [("golden_bits", "124", "80", "80")])
  (d / "golden_bits.json").write_text('{"default": {"writeback/x": "eq')
  report = device_report.write(str(d), str(tmp_path / "out"))
  assert report["golden_bits"] == {}
  md = (tmp_path / "out" / "device_check.md").read_text()
  assert "Golden bits: not run (see the parts above)." in md


def _row(name: str, status: str, seconds: int) -> str:
  """The cells of a part's row from its status to its limit (the plan's)."""
  p = device_plan.part(name)
  return f"{status} | {seconds} | {p.expected_s} | {p.limit_s}"


def _limit(name: str) -> str:
  return str(device_plan.part(name).limit_s)


def _parts_dir(tmp_path, rows):
  d = tmp_path / "parts"
  d.mkdir()
  (d / "parts.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
  return d


def test_report_names_failed_timed_out_skipped_and_unreached_parts(tmp_path):
  d = _parts_dir(
    tmp_path,
    [
      ("env", "0", "3", _limit("env")),
      ("step_freeze_gpt2_fp8", "124", "55", _limit("step_freeze_gpt2_fp8")),
      ("step_attention_reuse", "1", "12", _limit("step_attention_reuse")),
      ("bench_rounding", "skipped", "0", "0"),
    ],
  )
  (d / "env.out").write_text('{"jax": "0.11.2", "devices": 1}\n')
  (d / "step_attention_reuse.out").write_text("not json\n")
  report = device_report.write(str(d), str(tmp_path / "out"))
  status = {p["name"]: p["status"] for p in report["parts"]}
  assert status == {
    "env": "ok",
    "step_freeze_gpt2_fp8": "timed out",
    "step_attention_reuse": "failed (exit 1)",
    "bench_rounding": "skipped",
  }
  assert report["configs"] == {} and report["bench"] == {}
  md = (tmp_path / "out" / "device_check.md").read_text()
  row = _row("step_freeze_gpt2_fp8", "timed out", 55)
  assert f"| step_freeze_gpt2_fp8 | {row} | - |" in md
  bench = device_plan.part("bench_rounding").expected_s
  assert f"| bench_rounding | skipped | 0 | {bench} | 0 | - |" in md
  assert f"| families | {_row('families', 'not run', 0)} | - |" in md
  assert "| attention_reuse | - | - |" in md
  # The parts table follows the plan's order, whatever order they ran in.
  rows = [x.split(" | ")[0][2:] for x in md.splitlines() if " | " in x]
  assert rows[1 : 1 + len(ORDER)] == list(ORDER)


def test_report_says_when_the_compilation_cache_held_programs(tmp_path):
  d = _parts_dir(tmp_path, [("env", "0", "3", "15")])
  env = {"devices": 1, "compilation_cache": "/tmp/c", "cached_programs": 12}
  (d / "env.out").write_text(json.dumps(env) + "\n")
  md = device_report.markdown(device_report.collect(str(d)))
  assert "The compilation cache (/tmp/c) held 12 programs at the start" in md
  (d / "env.out").write_text(json.dumps(dict(env, cached_programs=0)) + "\n")
  md = device_report.markdown(device_report.collect(str(d)))
  assert "compilation cache" not in md


def test_environment_counts_the_programs_of_the_cache(tmp_path, monkeypatch):
  for name in ("jit_a-1-cache", "jit_a-1-atime", "jit_b-2-cache"):
    (tmp_path / name).write_text("")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
  env = device_report.environment()
  assert env["compilation_cache"] == str(tmp_path)
  assert env["cached_programs"] == 2
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "none"))
  assert device_report.environment()["cached_programs"] == 0


def test_report_tables_write_back_families_and_the_advice(tmp_path):
  d = _parts_dir(tmp_path, [("families", "0", "50", _limit("families"))])
  rows = [
    dict(config="freeze_gpt2_fp8", recipe="float32", tokens_per_s=1000.0,
         step_s=0.5, peak_device_bytes=2e9, params=53_000_000),
    dict(config="freeze_gpt2_fp8", recipe="bf16_sr+q8", tokens_per_s=800.0,
         step_s=0.625, peak_device_bytes=1e9, params=53_000_000),
  ]  # fmt: skip
  (d / "families.out").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (d / "frontier.out").write_text(
    "| table |\n\nRecommended (4.031 bytes/param):\n- mlp: bf16_sr+q8\n"
    "\nwrote x (config fragment) and y (optax code)\n"
  )
  md = device_report.markdown(device_report.collect(str(d)))
  assert "| freeze_gpt2_fp8, 53,000,000 params: recipe | tokens/s |" in md
  row = _row("families", "ok", 50)
  assert f"| families | {row} | 2.0 GB |" in md  # the largest
  assert "| float32 | 1,000 | 1.00x | 2.0 GB |" in md
  assert "| bf16_sr+q8 | 800 | 1.25x | 1.0 GB |" in md
  assert "Recommended (4.031 bytes/param):\n- mlp: bf16_sr+q8\n" in md


def test_report_cells_of_a_config_and_a_benchmark(tmp_path):
  name = "step_freeze_gpt2_fp8"
  d = _parts_dir(tmp_path, [(name, "0", "40", _limit(name))])
  result = dict(
    params=124_439_808,
    tokens_per_step=65536,
    tokens_per_s=512_000.0,
    mfu=0.4123,
    peak_device_bytes=31.26e9,
    compile_s=35.5,
    fusions=1947,
    distinct_fusions=375,
    step_s=0.128,
  )
  (d / "step_freeze_gpt2_fp8.out").write_text(json.dumps(result) + "\n")
  bench = {"rounding": {"cases": {"a": {"ratio_to": {
    "a": {"median": 1.0, "min": 1.0, "max": 1.0},
    "b": {"median": 0.5, "min": 0.25, "max": 0.75},
  }}}}}  # fmt: skip
  (d / "bench_rounding.json").write_text(json.dumps(bench))
  ratio = bench["rounding"]["cases"]["a"]["ratio_to"]
  cases = {name: {"ratio_to": ratio} for name in ("adamw", "a", "b")}
  columns = {
    "XLA bytes / param": {"adamw": 40.0, "a": 40.0, "b": 117.4},
    "GB/s": {"adamw": 3012.34, "a": 2500.0, "b": 1200.0},
  }
  note = "k: params after 2 steps equal to `r`'s bit for bit"
  writeback = {
    "writeback": {"cases": cases, "columns": columns, "notes": [note]}
  }
  (d / "bench_writeback.json").write_text(json.dumps(writeback))
  md = device_report.markdown(device_report.collect(str(d)))
  assert (
    "| freeze_gpt2_fp8 | 124,439,808 | 65,536 | 512,000 | 41.2% | 31.3 GB "
    "| 35.50 | 1,947 | 375 | 0.13 |" in md
  )
  row = _row("step_freeze_gpt2_fp8", "ok", 40)
  assert f"| step_freeze_gpt2_fp8 | {row} | 31.3 GB |" in md
  assert "| rounding | a | b | 0.50x (0.25-0.75) |" in md
  assert "| rounding | a | a |" not in md
  # The write-back section's bytes and rate, in a table of their own,
  # with each rate against AdamW's: 0.7 of it or more is memory speed.
  assert (
    "| writeback | XLA bytes / param | GB/s | GB/s / adamw's | bound by |" in md
  )
  assert "| adamw | 40.0 | 3012.3 | 1.00 | bytes |" in md
  assert "| a | 40.0 | 2500.0 | 0.83 | bytes |" in md
  assert "| b | 117.4 | 1200.0 | 0.40 | arithmetic or launches |" in md
  # The section's notes (a kernel's bits against the XLA path's).
  assert f"\nwriteback: {note}\n" in md
  assert "rounding: " not in md  # a section without notes prints none


@pytest.mark.parametrize(
  "jaxlib, accelerator, platforms, added",
  [
    ("0.10.2", False, "", True),  # CPU-only install: the CPU fix
    ("0.10.2", True, "", False),  # a GPU/TPU plugin: no CPU flag
    ("0.10.2", True, "cpu", True),  # the plugin, but the CPU asked for
    ("0.11.2", False, "", False),  # not the affected release
  ],
)
def test_cpu_only_xla_flags_stay_off_accelerators(
  jaxlib, accelerator, platforms, added
):
  flags = xla_flags.flags_for(jaxlib, accelerator, platforms, "--a=1")
  assert (xla_flags.WORKAROUND in flags) == added
  assert flags.startswith("--a=1")
  if added:  # never twice
    assert xla_flags.flags_for(jaxlib, accelerator, platforms, flags) == flags


def test_device_check_uses_python3_and_sets_no_xla_flags():
  with open(os.path.join(ROOT, "scripts", "device_check.sh")) as f:
    script = f.read()
  code = "\n".join(x for x in script.splitlines() if not x.startswith("#"))
  assert not re.search(r"(^|[\s(])python(\s|$)", code)  # python3 only
  assert "XLA_FLAGS" not in code and "xla_force_host" not in code


def test_wheel_list_pins_every_package_and_downloads_cp312_manylinux():
  wheels = wheel_list()
  assert "ml-collections" in wheels and "gfloat" in wheels
  assert all(re.fullmatch(r"\d+(\.\d+)*", v) for v in wheels.values())
  # Each pin is the version the tests run with here.
  for name, version in wheels.items():
    assert importlib.metadata.version(name) == version, name
  with open(os.path.join(ROOT, "scripts", "device_wheels.sh")) as f:
    script = f.read()
  for flag in (
    "--only-binary=:all:",
    "--python-version 3.12",
    "--implementation cp",
    "--platform manylinux_2_28_x86_64",
    "-d .whl",
  ):
    assert flag in script, flag


def test_deprecation_warnings_from_our_modules_fail_the_tests():
  # pyproject.toml turns them into errors; those of other modules stay
  # warnings.
  for module in OURS:
    with pytest.raises(DeprecationWarning):
      warnings.warn_explicit(
        "old", DeprecationWarning, "f.py", 1, module=f"{module}.x"
      )
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    warnings.warn_explicit("old", DeprecationWarning, "f.py", 1, module="jax")
  assert caught

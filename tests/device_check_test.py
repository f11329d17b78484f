"""scripts/device_check.sh: its CPU dry run, its report, its environment.

The dry run is the script as an accelerator machine runs it (`python3`,
every part, the report), on the CPU with tiny shapes, inside a Python that
hides every installed package the machine's image lacks and the wheel list
does not bring: an import the list misses fails here, not there. Also:
the report's reading of failed and timed-out parts, the XLA flags (no CPU
flag on an accelerator), the wheel list, and that DeprecationWarnings from
our own modules fail the test run.
"""

import importlib.metadata
import json
import os
import re
import stat
import subprocess
import sys
import warnings

import pytest
from packaging.requirements import Requirement

from experiments import device_report, golden_bits, xla_flags

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


@pytest.mark.slow
def test_dry_run_of_device_check_on_the_cpu(tmp_path):
  env, _ = _device_like_env(tmp_path)
  run = subprocess.run(
    ["bash", "scripts/device_check.sh"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  out = tmp_path / "out"
  logs = ""
  for p in sorted((out / "device_check").glob("*.err")):
    logs += f"--- {p.name}\n{p.read_text()[-2000:]}\n"
  assert run.returncode == 0, run.stdout + run.stderr + logs
  report = json.loads((out / "device_check.json").read_text())
  assert report["dry_run"] is True
  names = [p["name"] for p in report["parts"]]
  assert names == [
    "env",
    "golden_bits",
    "golden_bits_no_excess",
    "step_freeze_gpt2_fp8",
    "families",
    "step_attention_reuse",
    "bench_rounding",
    "frontier",
  ]
  assert all(p["status"] == "ok" for p in report["parts"]), report["parts"]
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
  assert report["advice"][0].startswith("Recommended (")
  assert len(report["advice"]) >= 6  # a line per group
  ratios = report["bench"]["rounding"]["ratios"]
  assert ratios and all(
    r["median"] > 0 for case in ratios.values() for r in case.values()
  )
  md = (out / "device_check.md").read_text()
  assert md.startswith("# Device check (dry run)")
  assert "| freeze_gpt2_fp8 | 21,984 |" in md
  assert "| bench_rounding | ok |" in md
  assert "| freeze_gpt2_fp8: recipe | tokens/s | step / float32's |" in md
  assert "| float32 |" in md and "| 1.00x |" in md
  assert "Frontier smoke, the advisor's recommendation:" in md
  # The golden bits, on the CPU, equal the file under both flag settings.
  for run_name in device_report.GOLDEN_RUNS:
    verdicts = report["golden_bits"][run_name]
    assert set(verdicts) == set(golden_bits.transforms())
    assert all(v == "equal" for v in verdicts.values()), verdicts
  assert "| writeback/bfloat16/stochastic | equal | equal |" in md


def test_golden_bits_table_shows_the_first_difference_and_information(
  tmp_path,
):
  d = _parts_dir(tmp_path, [("env", "0", "3", "60")])
  diff = "params['w'][1, 3]: expected 0.5, got 0.625 (1 of 256 elements differ)"
  (d / "golden_bits.json").write_text(
    json.dumps({"kahan/bfloat16/bfloat16/nearest": diff, "adamw/x": diff})
  )
  report = device_report.write(str(d), str(tmp_path / "out"))
  assert set(report["golden_bits"]) == {"golden_bits"}
  md = (tmp_path / "out" / "device_check.md").read_text()
  assert f"| kahan/bfloat16/bfloat16/nearest | {diff} |" in md
  assert f"| adamw/x | information: {diff} |" in md


def _parts_dir(tmp_path, rows):
  d = tmp_path / "parts"
  d.mkdir()
  (d / "parts.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
  return d


def test_report_names_failed_timed_out_and_skipped_parts(tmp_path):
  d = _parts_dir(
    tmp_path,
    [
      ("env", "0", "3", "60"),
      ("step_freeze_gpt2_fp8", "124", "140", "140"),
      ("step_attention_reuse", "1", "12", "170"),
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
  assert "| step_freeze_gpt2_fp8 | timed out | 140 | 140 |" in md
  assert "| attention_reuse | - | - |" in md


def test_report_tables_write_back_families_and_the_advice(tmp_path):
  d = _parts_dir(tmp_path, [("families", "0", "50", "150")])
  rows = [
    dict(config="freeze_gpt2_fp8", recipe="float32", tokens_per_s=1000.0,
         step_s=0.5, peak_device_bytes=2e9),
    dict(config="freeze_gpt2_fp8", recipe="bf16_sr+q8", tokens_per_s=800.0,
         step_s=0.625, peak_device_bytes=1e9),
  ]  # fmt: skip
  (d / "families.out").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (d / "frontier.out").write_text(
    "| table |\n\nRecommended (4.031 bytes/param):\n- mlp: bf16_sr+q8\n"
    "\nwrote x (config fragment) and y (optax code)\n"
  )
  md = device_report.markdown(device_report.collect(str(d)))
  assert "| float32 | 1,000 | 1.00x | 2.0 GB |" in md
  assert "| bf16_sr+q8 | 800 | 1.25x | 1.0 GB |" in md
  assert "Recommended (4.031 bytes/param):\n- mlp: bf16_sr+q8\n" in md


def test_report_cells_of_a_config_and_a_benchmark(tmp_path):
  d = _parts_dir(tmp_path, [("step_freeze_gpt2_fp8", "0", "40", "140")])
  result = dict(
    params=124_439_808,
    tokens_per_step=65536,
    tokens_per_s=512_000.0,
    mfu=0.4123,
    peak_device_bytes=31.26e9,
    compile_s=35.5,
    step_s=0.128,
  )
  (d / "step_freeze_gpt2_fp8.out").write_text(json.dumps(result) + "\n")
  bench = {"rounding": {"cases": {"a": {"ratio_to": {
    "a": {"median": 1.0, "min": 1.0, "max": 1.0},
    "b": {"median": 0.5, "min": 0.25, "max": 0.75},
  }}}}}  # fmt: skip
  (d / "bench_rounding.json").write_text(json.dumps(bench))
  md = device_report.markdown(device_report.collect(str(d)))
  assert (
    "| freeze_gpt2_fp8 | 124,439,808 | 65,536 | 512,000 | 41.2% | 31.3 GB "
    "| 35.50 | 0.13 |" in md
  )
  assert "| rounding | a | b | 0.50x (0.25-0.75) |" in md
  assert "| rounding | a | a |" not in md


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

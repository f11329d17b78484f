"""The entry scripts, run as files instead of modules, say how to run them."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = ["bench", "make_tables", "plan_full_scale", "plot", "prepare_text"]
ENTRY += ["reproduce", "bench_ops", "device_report", "refresh_goldens"]
ENTRY += ["peer_stream", "advise", "block_checks"]


@pytest.mark.parametrize("name", ENTRY)
def test_run_as_a_file_names_the_module_command(name):
  out = subprocess.run(
    [sys.executable, f"scripts/{name}.py", "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert out.returncode == 1
  assert f"python -m scripts.{name}" in out.stderr
  assert "Traceback" not in out.stderr


def test_every_entry_script_is_listed():
  # A script with a main block is an entry point: it gets the same hint.
  found = sorted(
    f[:-3]
    for f in os.listdir(os.path.join(ROOT, "scripts"))
    if f.endswith(".py")
    and "__main__" in open(os.path.join(ROOT, "scripts", f)).read()
  )
  assert found == sorted(ENTRY)


@pytest.mark.parametrize(
  "args",
  [["--help"], ["-h"], ["--config", "configs/smoke.py", "--help"]],
  ids=["help", "h", "help-with-config"],
)
def test_runner_help_lists_the_studies_and_exits_0(args):
  from experiments.analysis import studies

  out = subprocess.run(
    [sys.executable, "-m", "experiments.run", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert out.returncode == 0, out.stderr
  assert "--config configs/<study>.py" in out.stdout
  for name in studies.names():
    assert f"\n  {name} " in out.stdout, name
  assert (
    "--restart" in out.stdout and "--heartbeat_timeout_seconds" in out.stdout
  )


def test_only_real_studies_are_listed():
  # A study config defines get_config; common.py and presets.py are helpers.
  from experiments.analysis import reproduce, studies

  found = studies.names()
  assert "smoke" in found and "freeze_grid" in found
  assert "common" not in found and "presets" not in found
  for name in ("presets", "common", "no_such_study"):
    with pytest.raises(SystemExit, match="studies: advise_check, attention_"):
      reproduce.load_config(name, None)

"""The entry scripts, run as files instead of modules, say how to run them."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = ["bench", "make_tables", "plan_full_scale", "plot", "prepare_text"]
ENTRY += ["reproduce", "bench_ops", "device_report", "refresh_goldens"]


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

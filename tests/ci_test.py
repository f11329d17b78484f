"""`.ci/run`: the README's test command, then the slow tests, one venv."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
  with open(os.path.join(ROOT, name)) as f:
    return f.read()


def _commands():
  return [
    line.strip()
    for line in _read(".ci/run").splitlines()
    if line.strip() and not line.lstrip().startswith("#")
  ]


def test_ci_runs_the_readme_test_command():
  readme = _read("README.md")
  (command,) = re.findall(r"^python3 -m venv .*-m pytest.*$", readme, re.M)
  # The README's command makes its own venv; CI has made one already.
  run = command.split(" && ")[-1]
  assert run in _commands(), (run, _commands())


def test_ci_then_runs_every_slow_test_but_the_full_scale_ones():
  cmds = _commands()
  (select,) = [c for c in cmds if c.startswith("SLOW=")]
  assert select == 'SLOW="-m slow --ignore=tests/full_scale_test.py"'
  # Two workers, each test file on one of them (its fixtures made once).
  slow = ".venv/bin/python -m pytest -q -n 2 --dist loadfile $SLOW"
  assert slow in cmds
  assert cmds.index(slow) > cmds.index(".venv/bin/python -m pytest -q -n 2")


def test_ci_makes_one_venv_and_installs_once():
  cmds = _commands()
  assert sum("-m venv" in c for c in cmds) == 1
  assert sum("pip install" in c for c in cmds) == 1
  assert cmds.index("python3 -m venv .venv") < min(
    i for i, c in enumerate(cmds) if "pytest" in c
  )

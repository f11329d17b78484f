"""Every public name and every path the docs name resolves; the paths
from before the layer folders still import, to the same modules.

The docs check reads README.md and docs/*.md: each dotted `lowprec.a.b`
must import (its longest module prefix) and then resolve attribute by
attribute, unless it is a config key of the `lowprec` group
(`lowprec.rounding`, `lowprec.state`, ...); each `from lowprec... import`
line must import. Old paths are imported in a fresh process, where no
test has imported them first.
"""

import importlib
import json
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import lowprec
from configs import common
from lowprec import _moved

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOTTED = re.compile(r"(?<![\w.\-/])lowprec(?:\.[A-Za-z_]\w*)+")
FROM = re.compile(r"^\s*from (lowprec[\w.]*) import ([\w, ()]+)$", re.M)
CONFIG_KEYS = set(common.get_config().lowprec.keys())
# The page that lists the module paths from before the layer folders.
OLD_PATHS_PAGE = "docs/architecture.md"


def resolve(path: str):
  """The object `path` names, read as a user's code reads it: attribute by
  attribute from `lowprec`, importing a submodule where no attribute has
  the name. Raises AttributeError."""
  parts = path.split(".")
  obj = importlib.import_module(parts[0])
  for i, name in enumerate(parts[1:], start=1):
    if not hasattr(obj, name):
      try:
        importlib.import_module(".".join(parts[: i + 1]))
      except ModuleNotFoundError:
        pass
    obj = getattr(obj, name)
  return obj


def _page_paths():
  for page in PAGES:
    text = page.read_text()
    for m in DOTTED.finditer(text):
      path = m.group(0).rstrip(".")
      line = text.count("\n", 0, m.start()) + 1
      yield f"{page.relative_to(ROOT)}:{line}", path


def test_every_public_name_resolves():
  for name in lowprec.__all__:
    assert getattr(lowprec, name) is not None, name
  for module in ("grids", "engine", "optim", "freeze", "backward"):
    package = importlib.import_module(f"lowprec.{module}")
    for name in getattr(package, "__all__", ()):
      assert hasattr(package, name), (module, name)


def test_every_path_the_docs_name_resolves():
  bad = []
  with warnings.catch_warnings():
    # An old path in the docs is a failure, not a warning.
    warnings.simplefilter("error", DeprecationWarning)
    for where, path in _page_paths():
      if path.split(".")[1] in CONFIG_KEYS:
        continue
      if where.startswith(OLD_PATHS_PAGE) and _moved.new_path(path):
        continue  # the table of old paths and where they went
      try:
        resolve(path)
      except (AttributeError, DeprecationWarning) as e:
        bad.append(f"{where}: {path} ({type(e).__name__}: {e})")
  assert not bad, "\n".join(bad)


def test_every_import_line_in_the_docs_runs():
  bad = []
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    for page in PAGES:
      for m in FROM.finditer(page.read_text()):
        module = importlib.import_module(m.group(1))
        names = m.group(2).strip("()").split(",")
        for name in (n.split(" as ")[0].strip() for n in names):
          if name and not hasattr(module, name):
            try:
              importlib.import_module(f"{m.group(1)}.{name}")
            except ImportError:
              bad.append(f"{page.name}: from {m.group(1)} import {name}")
  assert not bad, bad


def test_the_docs_check_catches_a_wrong_path():
  with pytest.raises(AttributeError):
    resolve("lowprec.engine.codec.no_such_function")
  with pytest.raises(AttributeError):
    resolve("lowprec.nowhere.codec")
  assert resolve("lowprec.grids.formats.get_format") is lowprec.get_format


def test_every_moved_module_exists_at_its_new_path():
  for old, new in _moved.MOVED.items():
    module = importlib.import_module(f"lowprec.{new}")
    assert module.__name__ == f"lowprec.{new}"
    assert _moved.new_path(f"lowprec.{old}") == f"lowprec.{new}"
  assert _moved.new_path("lowprec.ops.base") == "lowprec.backward.ops.base"
  assert _moved.new_path("lowprec.grids.formats") is None
  assert _moved.new_path("numpy.store") is None


_OLD_IMPORTS = r"""
import json, sys, warnings
warnings.simplefilter("always")
import lowprec
out = {}
for old in sys.argv[1:]:
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(f"import {old}")
  module = sys.modules[old]
  out[old] = {
    "name": module.__name__,
    "spec": module.__spec__.name,
    "warnings": [
      [str(w.message), w.category.__name__, w.filename] for w in caught
    ],
  }
out["functions"] = [
  callable(getattr(lowprec, f)) for f in ("writeback", "eco", "telemetry")
]
print(json.dumps(out))
"""


def test_old_paths_import_the_new_modules_and_name_them():
  old = [f"lowprec.{m}" for m in _moved.MOVED] + [
    "lowprec.ops.dense",
    "lowprec.audit.derive",
  ]
  proc = subprocess.run(
    [sys.executable, "-c", _OLD_IMPORTS, *old],
    capture_output=True,
    text=True,
    cwd=ROOT,
    check=True,
  )
  got = json.loads(proc.stdout)
  # Importing lowprec.writeback (the module path) leaves lowprec.writeback
  # the function it always was.
  assert got.pop("functions") == [True, True, True]
  for path, seen in got.items():
    new = _moved.new_path(path)
    assert seen["name"] == new and seen["spec"] == new, path
    public = path.split(".")[1] in _moved.PUBLIC
    if public:
      assert seen["warnings"] == [], path
    else:
      [(message, category, filename)] = seen["warnings"]
      assert category == "DeprecationWarning", path
      assert f"{path} is now {new}" in message
      # Attributed to the line that imported the old path.
      assert filename == "<string>", (path, filename)

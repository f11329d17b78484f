"""Module paths from before lowprec's layer folders, still importable.

Up to 0.2, every module sat directly under `lowprec` (`lowprec.store`,
`lowprec.state_storage`, ...). Each now lives in the folder of its layer
(`lowprec.engine.codec`, `lowprec.optim.stored_state`, ...). Importing an
old path gives the module at its new path, the same object, with a
`DeprecationWarning` that names the new path. The short public names
(`lowprec.ops`, `lowprec.audit`, `lowprec.nn`, ...) are not deprecated:
they import silently, their submodules too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old module (under lowprec) -> its module now (under lowprec)
MOVED = {
  "_bits": "grids._bits",
  "names": "grids.choices",
  "rng": "grids.rng",
  "formats": "grids.formats",
  "rounding": "grids.rounding",
  "scaled": "grids.scaled",
  "codemaps": "grids.codemaps",
  "contract": "grids.contract",
  "store": "engine.codec",
  "rules": "engine.rules",
  "counting": "engine.counting",
  "leafwise": "engine.leafwise",
  "storage": "engine.weights",
  "record": "engine.record",
  "writeback": "optim.writeback",
  "compensated": "optim.compensated",
  "eco": "optim.eco",
  "split": "optim.split",
  "state_storage": "optim.stored_state",
  "recipes": "optim.recipes",
  "groups": "optim.groups",
  "telemetry": "optim.telemetry",
  "memory": "optim.memory",
  "float32_views": "optim.float32_views",
  "nnx": "optim.nnx",
  "policy": "backward.policy",
  "nn": "backward.nn",
  "ops": "backward.ops",
  "audit": "backward.audit",
}
# Short names that are lowprec's public API: no warning.
PUBLIC = frozenset(
  {"audit", "contract", "groups", "nn", "nnx", "ops", "policy", "recipes"}
  | {"scaled"}
)


def new_path(old: str) -> str | None:
  """The module path an old one now has, None if `old` did not move.

  Example:
    >>> new_path("lowprec.store")
    'lowprec.engine.codec'
    >>> new_path("lowprec.ops.dense")
    'lowprec.backward.ops.dense'
  """
  parts = old.split(".")
  if len(parts) < 2 or parts[0] != "lowprec" or parts[1] not in MOVED:
    return None
  return ".".join(["lowprec", MOVED[parts[1]], *parts[2:]])


def _caller_stacklevel() -> int:
  """The stacklevel, for `warnings.warn` called here, of the first frame
  outside this file and the import machinery (which `warnings` skips
  without counting)."""
  frame, level = sys._getframe(1), 1
  while frame is not None:
    name = frame.f_code.co_filename
    internal = "importlib" in name and "_bootstrap" in name
    if not internal and name != __file__:
      return level
    if not internal:
      level += 1
    frame = frame.f_back
  return 1


class _Alias(importlib.abc.Loader):
  """Loads an old path as the module at its new path."""

  def __init__(self, old: str, new: str):
    self.old, self.new = old, new

  def create_module(self, spec):
    module = importlib.import_module(self.new)
    self.spec = module.__spec__
    return module

  def exec_module(self, module):
    # The import system set the old spec on the module: give it back its own.
    module.__spec__ = self.spec
    if self.old.split(".")[1] not in PUBLIC:
      warnings.warn(
        f"{self.old} is now {self.new}; import it from there (the old "
        "path goes in a later release)",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
      )


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path, target=None):
    new = new_path(fullname)
    if new is None:
      return None
    return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new))


class _Package(types.ModuleType):
  """lowprec itself: importing an old submodule path does not replace a
  function of the same name (`lowprec.writeback`, `lowprec.eco`,
  `lowprec.telemetry` stay the functions)."""

  def __setattr__(self, name, value):
    if (
      isinstance(value, types.ModuleType)
      and name in MOVED
      and name in self.__dict__
    ):
      return
    super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
  """Makes the old paths importable (once per process)."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
  package.__class__ = _Package

"""The studies: the config files in configs/ that define a study.

A study config defines `get_config`; `common.py` (the shared defaults every
study starts from) and `presets.py` (model shapes) are helpers, not studies.
The files are read as text, not imported, so that listing them is instant
and starts no library.
"""

from __future__ import annotations

import ast
import os

CONFIGS = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "configs",
)
SHARED = ("common",)  # defines get_config, but as every study's defaults


def _module(name: str, configs: str) -> ast.Module:
  with open(os.path.join(configs, f"{name}.py")) as f:
    return ast.parse(f.read())


def _defines_get_config(module: ast.Module) -> bool:
  return any(
    isinstance(node, ast.FunctionDef) and node.name == "get_config"
    for node in module.body
  )


def summaries(configs: str = CONFIGS) -> dict[str, str]:
  """Each study's name and the first line of its config's docstring."""
  out = {}
  for f in sorted(os.listdir(configs)):
    name = f[:-3]
    if not f.endswith(".py") or f.startswith("_") or name in SHARED:
      continue
    module = _module(name, configs)
    if _defines_get_config(module):
      doc = ast.get_docstring(module) or ""
      out[name] = doc.splitlines()[0] if doc else ""
  return out


def names(configs: str = CONFIGS) -> list[str]:
  """The study names, sorted (`smoke`, `freeze_grid`, ...)."""
  return list(summaries(configs))

"""The modules of lowprec import each other without a circle, and each
layer imports only the layers below it.

Read from the source with `ast` (nothing is imported): every `import` and
`from ... import` of every module, at module level or inside a function,
absolute or relative. `from lowprec.x import y` is an edge to `lowprec.x.y`
where that is a module, else to `lowprec.x`. The package itself
(`lowprec/__init__.py`, which re-exports the public names) is no node:
importing any module runs it, so it would close every path into a circle.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "lowprec"


def _modules(root=ROOT / PACKAGE) -> dict[str, pathlib.Path]:
  """`{dotted module name: file}`; a subpackage is its `__init__.py`."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


def _is_package(name: str, modules) -> bool:
  return modules[name].name == "__init__.py"


def _imported(name: str, path: pathlib.Path, modules) -> set[str]:
  """The lowprec modules that module `name` imports anywhere in its file."""
  here = name if _is_package(name, modules) else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = here.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in modules else base)
  out = set()
  for target in found:
    # `import lowprec.a.b` names the module lowprec.a.b (or, for an
    # attribute, the closest module above it).
    while target and target not in modules:
      target = target.rpartition(".")[0]
    if target and target != PACKAGE and target != name:
      out.add(target)
  return out


def import_graph(modules=None) -> dict[str, set[str]]:
  """`{module: modules it imports}` among the modules of lowprec."""
  modules = modules or _modules()
  return {
    n: _imported(n, p, modules) for n, p in modules.items() if n != PACKAGE
  }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle as `[a, b, ..., a]`, or None (depth-first search)."""
  state = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done
  path: list[str] = []

  def visit(n):
    state[n] = 1
    path.append(n)
    for m in sorted(graph[n]):
      if state[m] == 1:
        return path[path.index(m) :] + [m]
      if state[m] == 0 and (cycle := visit(m)):
        return cycle
    path.pop()
    state[n] = 2
    return None

  for n in sorted(graph):
    if state[n] == 0 and (cycle := visit(n)):
      return cycle
  return None


def test_lowprec_modules_import_each_other_without_a_circle():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_formats_imports_nothing_from_scaled():
  # formats holds the scaled formats' data; scaled (the quantizer) builds
  # on it, never the other way round.
  graph = import_graph()
  assert "lowprec.grids.scaled" not in graph["lowprec.grids.formats"]
  assert "lowprec.grids.formats" in graph["lowprec.grids.scaled"]


_OLD_FORMATS = """
from lowprec import _bits, names

def get_format(name):
  from lowprec import scaled  # noqa: PLC0415
  return scaled.SCALED[name]
"""

_SOURCES = {
  "formats": _OLD_FORMATS,
  "scaled": "from lowprec import rounding",
  "rounding": "from .formats import Format",
  "_bits": "import jax",
  "names": "",
  "freeze/__init__": "from lowprec.freeze.trace import reference_trace",
  "freeze/trace": "from . import curves\nfrom lowprec import scaled",
  "freeze/curves": "import lowprec.freeze.trace as t",
}


@pytest.mark.parametrize(
  "drop, want",
  [
    (
      (),
      [
        "lowprec.formats",
        "lowprec.scaled",
        "lowprec.rounding",
        "lowprec.formats",
      ],
    ),
    (
      ("formats",),
      ["lowprec.freeze.trace", "lowprec.freeze.curves", "lowprec.freeze.trace"],
    ),
    (("formats", "freeze/curves"), None),
  ],
  ids=["lazy-import-in-a-function", "relative-and-import-as", "none"],
)
def test_the_search_finds_a_circle_where_there_is_one(tmp_path, drop, want):
  # A small package whose formats imports scaled lazily, as it once did,
  # and whose freeze modules close a second circle through a relative
  # import.
  root = tmp_path / PACKAGE
  for name, text in {
    "__init__": "from lowprec import scaled",
    **_SOURCES,
  }.items():
    path = root / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = name not in drop
    path.write_text(text if keep else "")
  cycle = find_cycle(import_graph(_modules(root)))
  assert cycle == want


# Each layer folder and the layers it may import (besides itself). The
# folders' docstrings say the same in their "May import:" line.
LAYERS = {
  "grids": set(),
  "engine": {"grids"},
  "optim": {"grids", "engine"},
  "freeze": {"grids", "engine", "optim"},
  "backward": {"grids", "engine"},
}
# Modules outside the layers: the deprecated-path shim, which only the
# package itself imports.
OUTSIDE = {"lowprec._moved"}


def _layer(name: str) -> str | None:
  parts = name.split(".")
  return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
  """`"a -> b"` for every import of a layer the importer may not use, and
  for every module that sits in no layer."""
  out = []
  for name in sorted(graph):
    layer = _layer(name)
    if layer is None:
      if name not in OUTSIDE:
        out.append(f"{name} is in no layer folder")
      continue
    for target in sorted(graph[name]):
      other = _layer(target)
      if other != layer and other not in LAYERS[layer]:
        out.append(f"{name} -> {target}")
  return out


def test_each_layer_imports_only_the_layers_below_it():
  breaches = layer_breaches(import_graph())
  assert not breaches, "imports across layers: " + "; ".join(breaches)


def test_the_layer_check_finds_an_import_upward(tmp_path):
  root = tmp_path / PACKAGE
  sources = {
    "__init__": "",
    "_moved": "",
    "grids/__init__": "",
    "grids/formats": "import numpy",
    "engine/__init__": "",
    "engine/codec": "from lowprec.grids import formats",
    "optim/__init__": "",
    "optim/writeback": "from lowprec.engine import codec",
    "flat": "",
  }
  for name, text in sources.items():
    path = root / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  assert layer_breaches(import_graph(_modules(root))) == [
    "lowprec.flat is in no layer folder"
  ]
  # The engine reaching up into the optimizers, inside a function.
  (root / "engine/codec.py").write_text(
    "def f():\n  from lowprec.optim.writeback import x\n"
  )
  (root / "flat.py").unlink()
  assert layer_breaches(import_graph(_modules(root))) == [
    "lowprec.engine.codec -> lowprec.optim.writeback"
  ]


def test_each_layer_folder_states_what_it_may_import():
  for layer, allowed in LAYERS.items():
    doc = ast.get_docstring(
      ast.parse((ROOT / PACKAGE / layer / "__init__.py").read_text())
    )
    lines = [x for x in doc.splitlines() if x.startswith("May import:")]
    assert len(lines) == 1, layer
    said = lines[0].removeprefix("May import:").strip().rstrip(".")
    named = {x.strip().removeprefix("lowprec.") for x in said.split(",")} - {
      "nothing else in lowprec"
    }
    assert named == allowed, (layer, said)

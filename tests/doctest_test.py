"""Docstring examples: those written with `>>>` run as doctests here.

The rule: a docstring example with expected output that runs on its own
is a doctest (`>>>`) and runs below; a sketch that needs context (params,
a model, a training loop) is a fenced `python` block, never `>>>`, so that
no example claims an output nobody checks.
"""

import doctest
import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec

ROOT = pathlib.Path(__file__).resolve().parent.parent
GLOBS = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "lowprec": lowprec}
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _module(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
  return ".".join(parts)


def _with_prompts():
  files = sorted(
    p
    for top in ("lowprec", "experiments")
    for p in (ROOT / top).rglob("*.py")
    if ">>>" in p.read_text()
  )
  return [_module(p) for p in files]


DOCTESTED = _with_prompts()


def test_some_modules_carry_doctests():
  # The discovery must find the modules known to hold doctests; an empty
  # list would make the test below pass vacuously.
  assert {"lowprec.grids.formats", "lowprec.backward.policy"} <= set(DOCTESTED)


@pytest.mark.parametrize("name", DOCTESTED)
def test_every_prompted_example_runs_and_prints_what_it_shows(name):
  mod = importlib.import_module(name)
  result = doctest.testmod(
    mod, extraglobs=GLOBS, optionflags=FLAGS, report=True, verbose=False
  )
  assert result.attempted > 0, f"{name}: '>>>' outside a docstring example"
  assert result.failed == 0, f"{name}: {result.failed} doctest(s) failed"

"""Test setup: 8 fake CPU devices, so sharding tests run on any machine."""

import gc
import os
import sys
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the whole session, shared by the test
# processes and the runs they start: most tests start the entry point on
# the same few programs, and compiling them again dominates their time.
# A cached executable is the compiled program itself, so results are the
# same bits with or without it.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(tempfile.gettempdir(), f"lowprec-tests-xla-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from experiments import xla_flags  # noqa: E402, F401  (jaxlib 0.10 CPU fix)


def pytest_sessionfinish(session):
  """Frees JAX's caches and collects garbage while the session still runs.

  A pytest-xdist worker that reports its session finished is asked to exit
  and gets 5 s before execnet sends it SIGINT. After the report, pytest
  still runs a full garbage collection (to report unraisable exceptions),
  which walks every live object (over 400,000 after two files of JAX
  tests); when it outlasts the 5 s, the SIGINT lands in a finalizer and
  the run ends with a KeyboardInterrupt traceback after `[100%]`. Here,
  before the report (xdist's hook wraps this one), the caches go, the
  garbage is collected (its finalizers still report to pytest), and what
  is left is frozen, so the last collection has nothing to walk.
  """
  del session
  jax = sys.modules.get("jax")
  if jax is not None:
    jax.clear_caches()
  gc.collect()
  gc.freeze()


HEAVY = os.path.join(os.path.dirname(__file__), "heavy_tests.txt")


def _heavy_ids() -> set[str]:
  with open(HEAVY) as f:
    return {
      line.strip() for line in f if line.strip() and not line.startswith("#")
    }


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks the tests of tests/heavy_tests.txt `slow` (before `-m` picks);
  an id there whose file was collected whole but which no longer exists
  is an error, so the list cannot go stale unseen."""
  heavy = _heavy_ids()
  seen = set()
  for item in items:
    if item.nodeid in heavy:
      item.add_marker(pytest.mark.slow)
      seen.add(item.nodeid)
  whole_files = {
    arg.split("::")[0] for arg in config.args if "::" not in arg
  } | ({"tests"} if not config.args else set())
  collected = {item.nodeid.split("::")[0] for item in items}
  # The docs' blocks are named by their line, which moves with every edit
  # of a page: those ids are not checked.
  missing = sorted(
    i
    for i in heavy - seen
    if i.split("::")[0] in collected
    and not i.startswith("tests/docs_test.py")
    and any(i.startswith(w.rstrip("/")) for w in whole_files)
  )
  if missing and not config.getoption("keyword"):
    raise pytest.UsageError(
      f"{HEAVY} lists tests that no longer exist: {missing[:5]}; remove "
      "them (or correct their ids)"
    )

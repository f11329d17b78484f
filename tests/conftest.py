"""Test setup: 8 fake CPU devices, so sharding tests run on any machine."""

import gc
import os
import sys
import tempfile

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

"""Test setup: 8 fake CPU devices, so sharding tests run on any machine."""

import os
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

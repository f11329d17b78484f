"""Test setup: 8 fake CPU devices, so sharding tests run on any machine."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments import xla_flags  # noqa: E402, F401  (jaxlib 0.10 CPU fix)

"""XLA flags the entry points set before JAX starts.

jaxlib 0.10 on CPU can return wrong values from jitted, vmapped reductions
that XLA hands to its YNNPACK reduce fusion (about 5% of entries off in a
small reproducer; jax-ml/jax#39103). Turning that one fusion type off fixes
it at no measurable cost. Import this module before `jax` (the entry points
and tests do); user code should set the same flag in `XLA_FLAGS`.

The flag is a CPU one: it is left out where an accelerator plugin (CUDA,
ROCm, TPU) is installed and `JAX_PLATFORMS` does not ask for the CPU, so
that a GPU or TPU run gets no CPU-only flags.
"""

import importlib.metadata
import os

WORKAROUND = "--xla_cpu_experimental_ynn_fusion_type=-reduce"
# Distribution name prefixes of JAX's accelerator plugins.
ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")


def flags_for(jaxlib: str, accelerator: bool, platforms: str, flags: str):
  """`XLA_FLAGS` with the workaround added where it applies: jaxlib 0.10,
  the CPU backend (no accelerator plugin, or `JAX_PLATFORMS` naming cpu),
  and not already set."""
  cpu = not accelerator or "cpu" in platforms.split(",")
  if jaxlib.startswith("0.10.") and cpu and "ynn_fusion_type" not in flags:
    return (flags + " " + WORKAROUND).strip()
  return flags


def _has_accelerator_plugin() -> bool:
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if name.startswith(ACCELERATOR_PLUGINS):
      return True
  return False


def configure() -> None:
  """Adds the workaround to `XLA_FLAGS` on the affected jaxlib releases."""
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return
  flags = os.environ.get("XLA_FLAGS", "")
  platforms = os.environ.get("JAX_PLATFORMS", "")
  new = flags_for(version, _has_accelerator_plugin(), platforms, flags)
  if new != flags:
    os.environ["XLA_FLAGS"] = new


configure()

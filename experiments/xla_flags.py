"""XLA flags the entry points set before JAX starts.

jaxlib 0.10 on CPU can return wrong values from jitted, vmapped reductions
that XLA hands to its YNNPACK reduce fusion (about 5% of entries off in a
small reproducer; jax-ml/jax#39103). Turning that one fusion type off fixes
it at no measurable cost. Import this module before `jax` (the entry points
and tests do); user code should set the same flag in `XLA_FLAGS`.
"""

import importlib.metadata
import os

WORKAROUND = "--xla_cpu_experimental_ynn_fusion_type=-reduce"


def configure() -> None:
  """Adds the workaround to `XLA_FLAGS` on the affected jaxlib releases."""
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if version.startswith("0.10.") and "ynn_fusion_type" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " " + WORKAROUND).strip()


configure()

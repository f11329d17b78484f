"""lowprec: numerics of low-precision training in JAX.

Formats and rounding (`get_format`, `round_nearest`, `round_stochastic`).
"""

from lowprec.formats import Format, get_format, ieee_format, int_format
from lowprec.rounding import round_nearest, round_stochastic

__all__ = [
  "Format",
  "get_format",
  "ieee_format",
  "int_format",
  "round_nearest",
  "round_stochastic",
]

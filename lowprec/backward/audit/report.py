"""How a difference from the reference is estimated and written down.

`estimate` is the split-sample test of a mean difference; the rest turns
estimates into the report's cells and Markdown tables.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Mean difference of one input's gradient from its baseline.

  `bias` and `se` are along the split-sample direction, relative to the
  root-mean-square norm of that input's reference gradient; `z = bias / se`.
  `exact`: the difference was zero for every forward draw (up to float32
  reassociation roundoff, `ROUNDOFF` relative to the gradient's scale).
  `deterministic` ("exact-different"): it was the same nonzero value for
  every draw, up to that roundoff; then `se` is 0 and `z` is +-inf, as
  no z is computed, and the difference is biased at any threshold.
  """

  gradient: str
  bias: float
  se: float
  z: float
  exact: bool
  deterministic: bool = False

  def biased(self, z_threshold: float) -> bool:
    if self.exact:
      return False
    return self.deterministic or abs(self.z) >= z_threshold


# Two float32 evaluations of the same gradient that XLA fuses or sums in a
# different order differ by reassociation roundoff; below this size relative
# to the reference gradient's scale a difference counts as none.
ROUNDOFF = 1e-5


def estimate(name, d, scale) -> Estimate:
  """Split-sample projected mean of per-forward differences `d[f, ...]`."""
  if not np.any(d) or np.max(np.abs(d)) <= ROUNDOFF * scale:
    return Estimate(name, 0.0, 0.0, 0.0, True)
  x = d.reshape(d.shape[0], -1)
  half = x.shape[0] // 2
  u = x[:half].mean(0)
  un = np.linalg.norm(u)
  t = x[half:] @ (u / un) if un > 0 else np.zeros(x.shape[0] - half)
  mean = float(t.mean())
  roundoff = ROUNDOFF * max(scale, abs(mean))
  if np.max(np.abs(t - mean)) <= roundoff:
    # The same value at every draw: a z would divide by roundoff.
    if abs(mean) <= roundoff:  # and that value is none along `u`
      return Estimate(name, mean / scale, 0.0, 0.0, False)
    inf = math.copysign(math.inf, mean)
    return Estimate(name, mean / scale, 0.0, inf, False, deterministic=True)
  se = float(t.std(ddof=1) / math.sqrt(t.size))
  return Estimate(name, mean / scale, se / scale, mean / se, False)


def strongest(ests) -> Estimate:
  return max(ests, key=lambda e: (not e.exact, e.deterministic, abs(e.z)))


def fmt_bias(e: Estimate) -> str:
  if e.exact:
    return "0 (exact)"
  if e.deterministic:
    return f"{e.bias:+.1e} (exact-different)"
  return f"{e.bias:+.1e} ± {e.se:.1e}"


def fmt_z(e: Estimate) -> str:
  if e.exact or e.deterministic:
    return "-"
  return f"{e.z:+.1f}" if abs(e.z) < 1e4 else f"{e.z:+.1e}"


def fmt_error(e: float) -> str:
  # Below ROUNDOFF the digits are float32 reassociation, which differs
  # between CPUs and compilers: print the bound instead.
  return f"< {ROUNDOFF:.0e} (roundoff)" if e < ROUNDOFF else f"{e:.1e}"


def yes_no(b) -> str:
  return "-" if b is None else ("yes" if b else "no")


def table(head, rows) -> str:
  """A Markdown table."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)

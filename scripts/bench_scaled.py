"""MX quantization throughput: `lowprec.scaled.quantize` vs a native cast.

One 4096 x 4096 float32 array (2^24 values; `--quick`: 1024 x 1024),
quantized to `mxfp8_e4m3` (the `float8_e4m3fn` elements and the E8M0
scales of blocks of 32 along the last axis), nearest and stochastic, side
by side with `x.astype(jnp.float8_e4m3fn)` of the same array. Targets:
nearest within 2x of the cast, stochastic within 3x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowprec import scaled
from scripts.benchlib import Result, interleave

FMT = "mxfp8_e4m3"
CAST = "native astype float8_e4m3fn"
TARGETS = {  # case -> the most it may take, in casts
  f"quantize {FMT} nearest": 2.0,
  f"quantize {FMT} stochastic": 3.0,
}


def run(quick: bool = False) -> Result:
  side = 1 << (10 if quick else 12)
  rounds = 3 if quick else 9
  rng = np.random.default_rng(0)
  # Blocks of very different magnitudes, so the scales differ per block.
  x = rng.normal(0, 1, (side, side)) * 2.0 ** rng.integers(-8, 8, (side, 1))
  x = jnp.asarray(x.astype(np.float32))
  key = jax.random.key(0)
  nearest, stochastic = TARGETS
  calls = {
    CAST: (jax.jit(lambda v: v.astype(jnp.float8_e4m3fn)), (x,)),
    nearest: (jax.jit(lambda v: scaled.quantize(v, FMT)), (x,)),
    stochastic: (
      jax.jit(lambda v, k: scaled.quantize(v, FMT, "stochastic", k)),
      (x, key),
    ),
  }
  times = interleave(calls, rounds=rounds, repeats=3 if quick else 5)
  result = Result(
    f"scaled: {side} x {side} float32 values to {FMT} (elements and scales)",
    times,
    (CAST,),
    extra={"targets": TARGETS},
  )
  notes = []
  for case, most in TARGETS.items():
    ratio = result.as_dict()["cases"][case]["ratio_to"][CAST]["median"]
    verdict = "met" if ratio <= most else "missed"
    notes.append(f"- {case}: target {most:g}x the cast ({verdict})")
  return Result(result.title, times, (CAST,), tuple(notes), result.extra)

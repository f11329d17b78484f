"""The engine's block scales computed on integer bit patterns, as every
backend computes them (lowprec.engine.codec).

`amax / max_E` is a division by a constant, which XLA:GPU computes as a
product with the rounded reciprocal; the float16 ceiling of a scale was a
conversion to float16 and back, which XLA:GPU simplifies away. Both are
now integer arithmetic. Oracles: float64 numpy division rounded to
float32 (double rounding is innocuous for a quotient of two float32s,
53 >= 2 * 24 + 2), and numpy's IEEE float16 with `nextafter`.

Seed 0; 4,000 magnitudes per constant over float32's whole exponent
range, plus the edges (0, the normal minimum, the maximum, subnormals).
"""

import jax
import numpy as np
import pytest

from lowprec.engine import codec

RNG = np.random.default_rng(0)


def _magnitudes(n=4000):
  m = RNG.uniform(1.0, 2.0, n) * 2.0 ** RNG.integers(-149, 128, n)
  edges = [0.0, 2.0**-126, 2.0**-149, 3.4028235e38, 1.0, 448.0, 2.0**-127]
  a = np.concatenate([m, edges]).astype(np.float32)
  return a[np.isfinite(a)]


@pytest.mark.parametrize("c", [448.0, 57344.0, 6.0, 127.0, 7.0, 1.5, 1.0])
def test_the_quotient_by_a_constant_is_the_correctly_rounded_one(c):
  a = _magnitudes()
  got = np.asarray(jax.jit(lambda x: codec._quotient_by_constant(x, c))(a))
  want = (a.astype(np.float64) / c).astype(np.float32)
  # Below float32's normal range the engine clamps scales up anyway.
  want = np.where(want < np.float32(2.0**-126), np.float32(0), want)
  np.testing.assert_array_equal(got, want)


def test_the_float16_ceiling_is_numpys_float16_rounded_up():
  a = np.concatenate(
    [
      RNG.uniform(1.0, 2.0, 4000) * 2.0 ** RNG.integers(-30, 17, 4000),
      [2.0**-24, 2.0**-14, 2.0**-14 * (1 - 2**-20), 65504.0, 65505.0, 1e6],
    ]
  ).astype(np.float32)
  got = np.asarray(jax.jit(codec._ceil_float16)(a))
  s = np.maximum(a, np.float32(2.0**-24))
  with np.errstate(over="ignore"):
    h = s.astype(np.float16)
  up = np.nextafter(h, np.float16(np.inf))
  h = np.where(h.astype(np.float32) < s, up, h)
  want = np.minimum(h.astype(np.float32), np.float32(65504.0))
  np.testing.assert_array_equal(got, want)

"""Rounding against independent oracles: ml_dtypes casts, gfloat, numpy."""

import fractions
import functools
import re

import gfloat
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gfloat.formats import (
  format_info_bfloat16,
  format_info_binary16,
  format_info_ocp_e2m1,
  format_info_ocp_e2m3,
  format_info_ocp_e3m2,
  format_info_ocp_e4m3,
  format_info_ocp_e5m2,
)

import lowprec
from lowprec.grids import rng, rounding
from lowprec.grids.formats import NAMED
from lowprec.grids.rounding import round_with_bits

NATIVE = [n for n in NAMED if n != "float32"]
# XLA on CPU cannot compile float6 arrays at all (they take the float32 path).
XLA_NATIVE = [n for n in NATIVE if not n.startswith("float6")]
F32_MAX = np.finfo(np.float32).max


def _bits_equal(a, b):
  """Equal bit patterns, any NaN equal to any NaN."""
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  same = a.view(np.uint32) == b.view(np.uint32)
  return same | (np.isnan(a) & np.isnan(b))


def _assert_bits_equal(actual, expected, x):
  ok = _bits_equal(actual, expected)
  if not ok.all():
    i = np.flatnonzero(~ok)[:5]
    raise AssertionError(
      f"{(~ok).sum()} mismatches; x={np.asarray(x)[i]} "
      f"got={np.asarray(actual)[i]} want={np.asarray(expected)[i]}"
    )


def _probe_points(values: np.ndarray, max_finite: float) -> np.ndarray:
  """Grid values, midpoints of neighbours and one float32 ulp either side."""
  pos = values.astype(np.float32)
  mids = ((values[1:] + values[:-1]) / 2).astype(np.float32)
  # Above the largest finite value: the overflow midpoint and beyond.
  top = np.float32(max_finite)
  extra = np.array(
    [
      top * 1.0625,
      top * 1.125,
      top * 2,
      F32_MAX,
      np.inf,
      np.nan,
      0.0,
      -0.0,
      1e-45,
      1e-40,
    ],
    np.float32,
  )
  pts = np.concatenate([pos, mids, extra])
  pts = np.concatenate(
    [
      pts,
      np.nextafter(pts, np.float32(np.inf)),
      np.nextafter(pts, np.float32(-np.inf)),
    ]
  )
  # NaN stays in: callers drop it only for formats without NaN.
  return np.concatenate([pts, -pts])


def _random_float32(n: int, seed: int) -> np.ndarray:
  """Random bit patterns: every exponent, subnormals, infs and NaNs."""
  return (
    np.random.default_rng(seed)
    .integers(0, 1 << 32, n, dtype=np.uint64)
    .astype(np.uint32)
    .view(np.float32)
  )


@functools.cache
def _jit_nearest(name, overflow):
  return jax.jit(lambda x: lowprec.round_nearest(x, name, overflow=overflow))


def _nearest_cases():
  # Every format under jit (with 10**6 random patterns); eager (compile-
  # bound here) by default for two formats, the rest marked slow.
  for name in NATIVE:
    for jit in (False, True):
      slow = not jit and name not in ("bfloat16", "float8_e4m3fn")
      yield pytest.param(
        name,
        jit,
        id=f"{name}-{'jit' if jit else 'eager'}",
        marks=pytest.mark.slow if slow else (),
      )


@pytest.mark.parametrize("name, jit", list(_nearest_cases()))
def test_nearest_equals_ml_dtypes_cast(name, jit):
  fmt = lowprec.get_format(name)
  dt = fmt.native_dtype
  x = _probe_points(
    fmt.values() if fmt.bits <= 16 else np.zeros(1), fmt.max_finite
  )
  if jit:  # 10**6 random bit patterns under jit; eager gets the probes.
    x = np.concatenate([x, _random_float32(1_000_000, seed=1)])
  if not fmt.has_nan:  # a cast of NaN to FP6/FP4 has no NaN to give
    x = x[~np.isnan(x)]
  with np.errstate(all="ignore"):
    want = x.astype(dt).astype(np.float32)
  fn = (
    _jit_nearest(name, "ieee")
    if jit
    else functools.partial(lowprec.round_nearest, fmt=name, overflow="ieee")
  )
  _assert_bits_equal(fn(jnp.asarray(x)), want, x)


@pytest.mark.parametrize(
  "name", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float4_e2m1fn", "e8m3"]
)
def test_saturate_clips_overflow_and_infinities(name):
  fmt = lowprec.get_format(name)
  m = np.float32(fmt.max_finite)
  x = jnp.asarray([m * 1.5, np.inf, -np.inf, -m * 3, np.nan, m], jnp.float32)
  got = np.asarray(lowprec.round_nearest(x, fmt))
  np.testing.assert_array_equal(got[[0, 1, 2, 3, 5]], [m, m, -m, -m, m])
  assert np.isnan(got[4])


def _gfloat_ieee(exp_bits: int, man_bits: int) -> gfloat.FormatInfo:
  """gfloat's description of the IEEE-like format eXmY (independent oracle)."""
  return gfloat.FormatInfo(
    f"e{exp_bits}m{man_bits}",
    k=1 + exp_bits + man_bits,
    precision=man_bits + 1,
    bias=(1 << (exp_bits - 1)) - 1,
    is_signed=True,
    domain=gfloat.Domain.Extended,
    has_nz=True,
    num_high_nans=(1 << man_bits) - 1,
    has_subnormals=True,
    is_twos_complement=False,
  )


GENERIC = [
  "e8m3",
  "e8m10",
  "e8m0",
  "e2m0",
  "e2m5",
  "e3m1",
  "e5m7",
  "e6m4",
  "e7m2",
  "e7m12",
  "e4m20",
  "e8m22",
]


@pytest.mark.parametrize("name", GENERIC)
def test_generic_nearest_equals_gfloat(name):
  fmt = lowprec.get_format(name)
  fi = _gfloat_ieee(fmt.exp_bits, fmt.man_bits)
  probes = _probe_points(
    fmt.values() if fmt.exp_bits + fmt.man_bits <= 16 else np.zeros(1),
    fmt.max_finite,
  )
  # Random values spread over the format's range and below it.
  r = np.random.default_rng(2)
  lo, hi = fmt.emin - fmt.man_bits - 3, fmt.emax + 2
  mags = 2.0 ** r.uniform(lo, hi, 200_000) * r.choice([-1, 1], 200_000)
  x = np.concatenate([probes, mags.astype(np.float32)])
  x = x[~np.isnan(x)]
  want = gfloat.round_ndarray(fi, x.astype(np.float64)).astype(np.float32)
  got = _jit_nearest(name, "ieee")(jnp.asarray(x))
  _assert_bits_equal(got, want, x)


@pytest.mark.parametrize("scale", [0.25, 1.0, 2.0**-7], ids=str)
@pytest.mark.parametrize("bits", [2, 3, 8])
def test_int_nearest_equals_float64_numpy(bits, scale):
  fmt = lowprec.get_format(f"int{bits}", scale=scale)
  kmax = 2 ** (bits - 1) - 1
  k = np.arange(-kmax - 2, kmax + 3, dtype=np.float64)
  r = np.random.default_rng(3).uniform(-kmax - 3, kmax + 3, 100_000)
  x = (np.concatenate([k, k + 0.5, r]) * scale).astype(np.float32)
  want = np.clip(np.round(x.astype(np.float64) / scale), -kmax, kmax) * scale
  got = _jit_nearest(fmt, "saturate")(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got, np.float64), want)


# ---- stochastic rounding --------------------------------------------------

SR_FORMATS = [
  "float8_e4m3fn",
  "float8_e5m2",
  "bfloat16",
  "e8m3",
  "float6_e3m2fn",
  "float4_e2m1fn",
]


def _brackets(fmt, x):
  """Grid neighbours lo <= x <= hi from the enumerated grid (float64)."""
  pos = fmt.values()
  grid = np.concatenate([-pos[::-1], pos[1:]])
  i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
  return grid[i], grid[i + 1]


@pytest.mark.parametrize("name", SR_FORMATS)
def test_stochastic_lands_on_a_bracketing_grid_value(name):
  fmt = lowprec.get_format(name)
  r = np.random.default_rng(4)
  m = fmt.max_finite
  x = r.uniform(-m, m, 200_000).astype(np.float32)
  x[:1000] = (x[:1000] * 1e-3 / m).astype(np.float32)  # near zero
  out = np.asarray(
    jax.jit(lambda v, k: lowprec.round_stochastic(v, fmt, k))(
      jnp.asarray(x), jax.random.key(0)
    ),
    np.float64,
  )
  lo, hi = _brackets(fmt, x.astype(np.float64))
  assert np.all((out == lo) | (out == hi))
  on = np.isin(x.astype(np.float64), fmt.values()) | np.isin(
    -x.astype(np.float64), fmt.values()
  )
  np.testing.assert_array_equal(out[on], x[on])


def _gfloat_fnuz(exp_bits: int, man_bits: int, bias: int) -> gfloat.FormatInfo:
  """gfloat's description of a `fnuz` format: no infinities and no negative
  zero, whose code is the one NaN."""
  return gfloat.FormatInfo(
    f"e{exp_bits}m{man_bits}fnuz",
    k=1 + exp_bits + man_bits,
    precision=man_bits + 1,
    bias=bias,
    is_signed=True,
    domain=gfloat.Domain.Finite,
    has_nz=False,
    num_high_nans=0,
    has_subnormals=True,
    is_twos_complement=False,
  )


# Every named format as gfloat describes it, written from the formats'
# specifications (OCP, IEEE, the fnuz biases); the test below checks each
# against the ml_dtypes codes, value for value.
GFLOAT = {
  "bfloat16": format_info_bfloat16,
  "float16": format_info_binary16,
  "float8_e4m3fn": format_info_ocp_e4m3,
  "float8_e5m2": format_info_ocp_e5m2,
  "float8_e4m3fnuz": _gfloat_fnuz(4, 3, 8),
  "float8_e5m2fnuz": _gfloat_fnuz(5, 2, 16),
  "float8_e4m3b11fnuz": _gfloat_fnuz(4, 3, 11),
  "float8_e3m4": _gfloat_ieee(3, 4),
  "float8_e4m3": _gfloat_ieee(4, 3),
  "float6_e2m3fn": format_info_ocp_e2m3,
  "float6_e3m2fn": format_info_ocp_e3m2,
  "float4_e2m1fn": format_info_ocp_e2m1,
}


def _gfloat_fi(name: str) -> gfloat.FormatInfo:
  """The gfloat oracle of a named format or of `eXmY`."""
  if name in GFLOAT:
    return GFLOAT[name]
  e, m = re.fullmatch(r"e(\d+)m(\d+)", name).groups()
  return _gfloat_ieee(int(e), int(m))


def _codes(width: int) -> np.ndarray:
  return np.arange(1 << width, dtype=np.uint8 if width <= 8 else np.uint16)


def test_the_gfloat_oracles_cover_every_named_format():
  assert sorted(GFLOAT) == sorted(NATIVE)


@pytest.mark.parametrize("name", sorted(GFLOAT))
def test_each_gfloat_oracle_decodes_every_code_as_ml_dtypes(name):
  fi = GFLOAT[name]
  codes = _codes(fi.k)
  want = codes.view(jnp.dtype(name)).astype(np.float64)
  got = gfloat.decode_ndarray(fi, codes.astype(np.int64))
  same = (got.view(np.uint64) == want.view(np.uint64)) | (
    np.isnan(got) & np.isnan(want)
  )
  assert same.all(), (codes[~same][:5], got[~same][:5], want[~same][:5])


def _gfloat_stochastic(name, x, bits):
  """gfloat's stochastic rounding of float32 `x` with our 32 random bits.

  gfloat rounds away iff srbits >= 2**32 - frac; we round up iff R < frac.
  So R and srbits = ~R (uint32) give the same decisions, bit for bit,
  wherever the discarded part of x fits in 32 bits (deeper, gfloat rounds
  the fraction to nearest and we truncate it: a different decision with
  probability 2**-32 per element).
  """
  return gfloat.round_ndarray(
    _gfloat_fi(name),
    np.asarray(x, np.float64),
    gfloat.RoundMode.Stochastic,
    sat=True,
    srbits=(~np.asarray(bits, np.uint32)).astype(np.int64),
    srnumbits=32,
  ).astype(np.float32)


@pytest.mark.parametrize("name", [*sorted(GFLOAT), "e8m3", "e3m1", "e5m7"])
def test_stochastic_equals_gfloat_with_injected_bits(name):
  """Seed 5: 100_000 values spread over two binades below the smallest
  subnormal up to twice the largest value (saturating), both signs."""
  fmt = lowprec.get_format(name)
  r = np.random.default_rng(5)
  n = 100_000
  lo, hi = fmt.emin - fmt.man_bits - 2, fmt.emax + 2
  x = (2.0 ** r.uniform(lo, hi, n) * r.choice([-1, 1], n)).astype(np.float32)
  bits = np.asarray(rng.random_bits(jax.random.key(7), x.shape))
  got = jax.jit(lambda v, b: round_with_bits(v, fmt, b))(x, bits)
  want = _gfloat_stochastic(name, x, bits)
  _assert_bits_equal(got, want, x)
  dt = fmt.native_dtype
  if name in XLA_NATIVE:  # the native code (one-byte codes from the bits)
    fn = jax.jit(lambda v, b: round_with_bits(v, fmt, b, dtype=dt))
    code = np.asarray(fn(x, bits))
    assert code.dtype == dt
    _assert_bits_equal(code.astype(np.float32), want, x)


# ---- the stochastic carry at its boundary bits -----------------------------
# Rounding up happens iff the injected bits R < frac, frac being where |x|
# lies between its neighbours in 32-bit fixed point: floor(f * 2**32) for a
# fraction f (intK compares 24 bits: ceil(f * 2**24) * 2**8). Random bits
# never hit the boundary, so these tests inject R = 0, 1, frac - 1, frac,
# frac + 1, 2**31 and 2**32 - 1 at grid values (frac = 0: never up) and at
# exactly known fractions, on both rounding paths (float32 out, `dtype=`).

TWO32 = 1 << 32
F = fractions.Fraction
FRACTIONS = (
  F(1, 2),
  F(1, 4),
  F(3, 4),
  F(1, 1 << 20),
  F((1 << 20) - 1, 1 << 20),
  F(1, TWO32),  # frac = 1: only R = 0 rounds up
  F(TWO32 - 1, TWO32),  # frac = 2**32 - 1: only R = 2**32 - 1 stays
  F(3, 1 << 33),  # frac = floor(1.5) = 1: the documented truncation
)
BOUNDARY = [
  *(pytest.param(n, "float32", id=f"{n}-float32") for n in NATIVE),
  *(pytest.param(n, "float32", id=f"{n}-float32") for n in ("e8m3", "e5m7")),
  pytest.param("int3", "float32", id="int3-float32"),
  *(pytest.param(n, "dtype", id=f"{n}-dtype") for n in XLA_NATIVE),
]


def _oracle_grid(name: str) -> np.ndarray:
  """Nonnegative finite grid values, ascending (float64): every ml_dtypes
  code decoded, gfloat's decoding for eXmY, `0 .. 2^(K-1) - 1` for intK."""
  if name.startswith("int"):
    return np.arange(1 << (int(name[3:]) - 1), dtype=np.float64)
  if name in GFLOAT:
    v = _codes(GFLOAT[name].k).view(jnp.dtype(name)).astype(np.float64)
  else:
    fi = _gfloat_fi(name)
    v = gfloat.decode_ndarray(fi, np.arange(1 << fi.k, dtype=np.int64))
  return np.unique(np.abs(v[np.isfinite(v)]))


def _overflow_value(name: str, overflow: str) -> float:
  """What a round up past the largest value gives: the maximum when
  saturating (and for intK), else what the ml_dtypes cast of an overflow
  gives (inf, NaN, or the maximum for FP6/FP4); eXmY has inf."""
  top = _oracle_grid(name)[-1]
  if overflow == "saturate" or name.startswith("int"):
    return top
  if name not in GFLOAT:
    return np.inf
  with np.errstate(all="ignore"):
    return float(np.float32(np.inf).astype(jnp.dtype(name)))


def _boundary_cases(name: str, overflow: str):
  """(x, bits, expected), float32 / uint32 / float64: grid values and exact
  fractions between neighbours at the bottom of the grid, either side of 1,
  at the top and one gap past the top (there a round up overflows); both
  signs."""
  g = _oracle_grid(name)
  one = int(np.searchsorted(g, 1.0))
  past = g[-1] + (g[-1] - g[-2])  # the next value of an unbounded grid
  pairs = [(g[0], g[1]), (g[1], g[2]), (g[one - 1], g[one])]
  pairs += [(g[one], g[one + 1]), (g[-2], g[-1]), (g[-1], past)]
  over = _overflow_value(name, overflow)
  is_int = name.startswith("int")

  def frac_of(f):
    if is_int:
      return -(-f.numerator * (1 << 24) // f.denominator) << 8  # ceil
    return f.numerator * TWO32 // f.denominator  # floor

  cases = []
  for lo, hi in pairs:
    up = over if hi == past else hi
    for f in (F(0), *FRACTIONS):
      x = F(lo) + f * (F(hi) - F(lo))
      with np.errstate(over="ignore"):
        x32 = np.float32(float(x))
      if not np.isfinite(x32) or F(float(x32)) != x:
        continue  # not a float32 value
      frac = frac_of(f)
      # intK rounds up toward +inf: -x lies 1 - f above its floor -hi.
      neg_frac = frac_of(1 - f) if is_int and f else frac
      for r in {0, 1, frac - 1, frac, frac + 1, 1 << 31, TWO32 - 1}:
        if not 0 <= r < TWO32:
          continue
        cases.append((float(x), r, up if r < frac else lo))
        if is_int:
          neg = -lo if r < neg_frac else -(g[-1] if hi == past else hi)
          cases.append((-float(x), r, neg if f else -lo))
        else:
          cases.append((-float(x), r, -(up if r < frac else lo)))
  x, bits, want = (np.array(c) for c in zip(*cases, strict=True))
  return x.astype(np.float32), bits.astype(np.uint32), want


@pytest.mark.parametrize("overflow", ["saturate", "ieee"])
@pytest.mark.parametrize("name, path", BOUNDARY)
def test_stochastic_carry_at_the_boundary_bits(name, path, overflow):
  """Independent of the library: the grid from the ml_dtypes codes (or
  gfloat, or the integers), the fractions exact, the expected neighbour
  from `R < frac` in Python integers."""
  is_int = name.startswith("int")
  fmt = lowprec.get_format(name, scale=1.0) if is_int else name
  x, bits, want = _boundary_cases(name, overflow)
  if path == "float32":
    got = jax.jit(lambda v, b: round_with_bits(v, fmt, b, overflow=overflow))(
      x, bits
    )
    got = np.asarray(got)
    assert got.dtype == np.float32
    if is_int:  # intK's zero has no sign to check
      np.testing.assert_array_equal(got, want.astype(np.float32))
      return
    want = want.astype(np.float32)
    if name in GFLOAT and not np.signbit(np.float32(-0.0).astype(name)):
      want[want == 0] = 0.0  # no negative zero (fnuz)
    _assert_bits_equal(got, want, x)
  else:
    dt = jnp.dtype(name)
    got = jax.jit(
      lambda v, b: round_with_bits(v, fmt, b, overflow=overflow, dtype=dt)
    )(x, bits)
    got = np.asarray(got)
    assert got.dtype == dt
    with np.errstate(all="ignore"):
      _assert_codes_equal(got, want.astype(np.float32).astype(dt))


def _up_probability_points(fmt):
  """Off-grid points in the normal, subnormal and near-max ranges."""
  v = fmt.values()
  sub = v[1 : (1 << fmt.man_bits)]
  picks = [
    (v[0], v[1]),  # zero to smallest subnormal
    (sub[len(sub) // 2], sub[len(sub) // 2 + 1]),
    (1.0, float(fmt.next_up(jnp.float32(1.0)))),
    (v[-2], v[-1]),  # just below the maximum
  ]
  pts = []
  for lo, hi in picks:
    for frac in (0.1, 0.5, 0.75):
      x = np.float32(lo + frac * (hi - lo))
      pts.append((x, lo, hi))
  return pts


@pytest.mark.parametrize(
  "name", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "e8m3"]
)
def test_stochastic_up_probability_is_binomially_right(name):
  """Seed 11, N = 40_000 draws per point, tolerance 5 binomial sigmas."""
  fmt = lowprec.get_format(name)
  n = 40_000
  fn = jax.jit(lambda v, k: lowprec.round_stochastic(v, fmt, k))
  for i, (x, lo, hi) in enumerate(_up_probability_points(fmt)):
    out = np.asarray(fn(jnp.full((n,), x), jax.random.key(11 + i)), np.float64)
    assert np.all((out == lo) | (out == hi)), (x, lo, hi)
    p = (np.float64(x) - lo) / (hi - lo)
    p_hat = np.mean(out == hi)
    tol = 5 * np.sqrt(p * (1 - p) / n)
    assert abs(p_hat - p) <= tol, (x, p, p_hat, tol)


def test_stochastic_is_unbiased_on_average():
  """Seed 3, 2**20 values, mean error within 5 standard errors."""
  fmt = lowprec.get_format("float8_e4m3fn")
  x = jnp.asarray(
    np.random.default_rng(3).uniform(0.01, 400, 1 << 20).astype(np.float32)
  )
  err = np.asarray(
    lowprec.round_stochastic(x, fmt, jax.random.key(3)), np.float64
  ) - np.asarray(x, np.float64)
  assert abs(err.mean()) <= 5 * err.std() / np.sqrt(err.size)


def test_no_correlation_between_neighbours_or_successive_keys():
  """Seed 0; N = 2**18 elements at p = 1/2; |corr| <= 5/sqrt(N)."""
  n = 1 << 18
  fmt = lowprec.get_format("bfloat16")
  x = jnp.full((n,), 1.0 + 2.0**-8, jnp.float32)  # midway: p = 1/2
  key = jax.random.key(0)
  a = np.asarray(lowprec.round_stochastic(x, fmt, key) > 1.0, np.float64)
  k2 = jax.random.split(key)[1]
  b = np.asarray(lowprec.round_stochastic(x, fmt, k2) > 1.0, np.float64)
  c = np.asarray(
    lowprec.round_stochastic(x, fmt, jax.random.key(1)) > 1.0, np.float64
  )
  bound = 5 / np.sqrt(n)
  assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) <= bound
  assert abs(np.corrcoef(a[:-2], a[2:])[0, 1]) <= bound
  assert abs(np.corrcoef(a, b)[0, 1]) <= bound
  assert abs(np.corrcoef(a, c)[0, 1]) <= bound
  # Two-dimensional arrays: rows and columns are independent too.
  m = np.asarray(
    lowprec.round_stochastic(x.reshape(512, 512), fmt, key) > 1.0, np.float64
  )
  assert abs(np.corrcoef(m[:-1].ravel(), m[1:].ravel())[0, 1]) <= bound


def test_random_bits_are_uniform():
  """Chi-square of the top byte of 2**20 draws: 255 dof, mean 255, sd 22.6."""
  bits = np.asarray(rng.random_bits(jax.random.key(5), (1 << 20,)))
  counts = np.bincount(bits >> 24, minlength=256)
  expected = bits.size / 256
  chi2 = ((counts - expected) ** 2 / expected).sum()
  assert chi2 < 255 + 6 * 22.6
  per_bit = [(bits >> i & 1).mean() for i in range(32)]
  assert np.allclose(per_bit, 0.5, atol=5 * 0.5 / np.sqrt(bits.size))


def test_stochastic_is_the_same_eager_jit_and_on_eight_devices():
  devices = jax.devices()
  assert len(devices) == 8, "tests/conftest.py should give 8 CPU devices"
  fmt = lowprec.get_format("float8_e5m2")
  x = jnp.asarray(
    np.random.default_rng(9).normal(size=(64, 48)).astype(np.float32)
  )
  key = jax.random.key(42)
  fn = jax.jit(lambda v, k: lowprec.round_stochastic(v, fmt, k))
  one = np.asarray(fn(x, key))
  eager = np.asarray(lowprec.round_stochastic(x, fmt, key))
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
  sharded = jax.device_put(x, spec)
  eight = fn(sharded, key)
  assert len(eight.sharding.device_set) == 8
  np.testing.assert_array_equal(one, eager)
  np.testing.assert_array_equal(
    one.view(np.uint32), np.asarray(eight).view(np.uint32)
  )
  # A different key gives different bits.
  assert np.any(one != np.asarray(fn(x, jax.random.key(43))))


@pytest.mark.slow
def test_float64_input_under_x64():
  """Stochastic half: jax.random.key(0), n = 4096 values midway between
  bf16 neighbours (p = 1/2), up-share within 5 binomial sigmas (0.039)."""
  with jax.enable_x64(True):
    x = jnp.asarray([1.0 + 2.0**-9 + 2.0**-40, 3.0e-42, 1e300, -0.0])
    got = np.asarray(lowprec.round_nearest(x, "bfloat16"))
    assert got.dtype == np.float64
    want = np.asarray(x).astype(np.float32)  # exact here: no double rounding
    want = want.astype(lowprec.get_format("bfloat16").native_dtype)
    np.testing.assert_array_equal(got[:2], want[:2].astype(np.float64))
    assert got[2] == lowprec.get_format("bfloat16").max_finite
    assert np.signbit(got[3])
    n = 4096
    s = lowprec.round_stochastic(
      jnp.full((n,), 1.0 + 2.0**-8), "bfloat16", jax.random.key(0)
    )
    assert s.dtype == jnp.float64
    s = np.asarray(s)
    assert np.all((s == 1.0) | (s == 1.0 + 2.0**-7))
    assert abs((s > 1).mean() - 0.5) <= 5 * np.sqrt(0.25 / n)


def test_rounding_survives_jit_where_a_cast_pair_may_not():
  x = jnp.asarray(np.linspace(1, 2, 1001, dtype=np.float32))
  got = jax.jit(lambda v: lowprec.round_nearest(v, "bfloat16") * 1.0)(x)
  want = np.asarray(x).astype(lowprec.get_format("bfloat16").native_dtype)
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


def test_output_keeps_shape_and_carrier_dtype():
  x = jnp.ones((3, 4, 5), jnp.float32) * 1.1
  assert lowprec.round_nearest(x, "float8_e4m3fn").shape == (3, 4, 5)
  y = lowprec.round_nearest(x.astype(jnp.bfloat16), "float8_e4m3fn")
  assert y.dtype == jnp.float32


@pytest.mark.parametrize(
  "call, err, match",
  [
    (
      lambda: lowprec.round_nearest(jnp.arange(3), "bfloat16"),
      TypeError,
      "floating-point",
    ),
    (
      lambda: lowprec.round_nearest(jnp.ones(3), "bf16"),
      ValueError,
      "unknown format",
    ),
    (lambda: lowprec.round_nearest(jnp.ones(3), "int3"), ValueError, "scale"),
    (
      lambda: lowprec.round_nearest(jnp.ones(3), "bfloat16", overflow="clip"),
      ValueError,
      "saturate",
    ),
    (
      lambda: lowprec.round_stochastic(jnp.ones(3), "bfloat16", 0),
      TypeError,
      "PRNG key",
    ),
    (
      lambda: lowprec.round_stochastic(
        jnp.ones(3), "bfloat16", jax.random.split(jax.random.key(0))
      ),
      ValueError,
      "single PRNG key",
    ),
    (
      lambda: lowprec.round_stochastic(
        jnp.ones(3), "bfloat16", jax.random.key(0), rng="pcg"
      ),
      ValueError,
      "hash",
    ),
  ],
  ids=[
    "integer-input",
    "unknown-format",
    "int-no-scale",
    "bad-overflow",
    "not-a-key",
    "key-array",
    "bad-rng",
  ],
)
def test_bad_input_errors(call, err, match):
  with pytest.raises(err, match=match):
    call()


# The underscore twins take a resolved format and a checked overflow mode,
# so each public function must refuse a bad name itself.
@pytest.mark.parametrize(
  "call",
  [
    lambda fmt, ovf: lowprec.round_nearest(jnp.ones(3), fmt, overflow=ovf),
    lambda fmt, ovf: lowprec.round_stochastic(
      jnp.ones(3), fmt, jax.random.key(0), overflow=ovf
    ),
    lambda fmt, ovf: round_with_bits(
      jnp.ones(3), fmt, jnp.zeros(3, jnp.uint32), overflow=ovf
    ),
    lambda fmt, ovf: rounding.round_and_flag(jnp.ones(3), fmt, overflow=ovf),
    lambda fmt, ovf: rounding.round_scaled_code(
      jnp.ones(3),
      jnp.zeros(3, jnp.int32),
      fmt,
      overflow=ovf,
      dtype=jnp.float8_e4m3fn,
    ),
  ],
  ids=[
    "round_nearest",
    "round_stochastic",
    "round_with_bits",
    "round_and_flag",
    "round_scaled_code",
  ],
)
@pytest.mark.parametrize(
  "fmt, ovf, match",
  [
    ("bf16", "saturate", "unknown format"),
    ("float8_e4m3fn", "clip", "unknown overflow mode"),
  ],
  ids=["format", "overflow"],
)
def test_each_public_function_checks_its_names(call, fmt, ovf, match):
  with pytest.raises(ValueError, match=match):
    call(fmt, ovf)


def _assert_codes_equal(got, want):
  """Native codes equal byte for byte, NaN payloads aside (any NaN code is
  the cast's NaN)."""
  nan = np.isnan(want.astype(np.float32))
  assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
  view = np.uint8 if want.dtype.itemsize == 1 else np.uint16
  np.testing.assert_array_equal(got[~nan].view(view), want[~nan].view(view))


EMITTED = [
  "bfloat16",
  "float16",
  "float8_e4m3fn",
  "float8_e5m2",
  "float8_e4m3fnuz",
  "float8_e5m2fnuz",
  "float8_e3m4",
]


@pytest.mark.parametrize("name", EMITTED)
def test_native_output_dtype_equals_the_ml_dtypes_cast_byte_for_byte(name):
  """Nearest: the ml_dtypes cast. Stochastic: gfloat with the bits of
  `jax.random.key(3)` injected, then the (exact) ml_dtypes cast; both for
  the grid probes and 200_000 random float32 patterns, seed 4."""
  fmt = lowprec.get_format(name)
  dt = fmt.native_dtype
  x = np.concatenate(
    [
      _probe_points(
        fmt.values() if fmt.bits <= 8 else np.zeros(1), fmt.max_finite
      ),
      _random_float32(200_000, seed=4),
    ]
  )
  if not fmt.has_nan:
    x = x[~np.isnan(x)]
  with np.errstate(all="ignore"):
    want = x.astype(dt)
  fn = jax.jit(
    lambda v: lowprec.round_nearest(v, name, overflow="ieee", dtype=dt)
  )
  got = np.asarray(fn(jnp.asarray(x)))
  assert got.dtype == dt
  _assert_codes_equal(got, want)
  key = jax.random.key(3)
  sr = jax.jit(lambda v: lowprec.round_stochastic(v, name, key, dtype=dt))
  wide = jax.jit(lambda v: lowprec.round_stochastic(v, name, key))
  xs = x[np.isfinite(x)]
  want_wide = _gfloat_stochastic(name, xs, rng.random_bits(key, xs.shape))
  want_sr = want_wide.astype(dt)
  assert not np.isnan(want_wide).any()  # finite inputs, saturated
  _assert_bits_equal(wide(jnp.asarray(xs)), want_wide, xs)
  got_sr = np.asarray(sr(jnp.asarray(xs)))
  assert got_sr.dtype == dt
  _assert_codes_equal(got_sr, want_sr)


ONE_BYTE = [
  n
  for n in NATIVE
  if lowprec.get_format(n).bits == 8 and lowprec.get_format(n).man_bits
]


@pytest.mark.parametrize("overflow", ["saturate", "ieee"])
@pytest.mark.parametrize("name", ONE_BYTE)
def test_one_byte_codes_equal_the_cast_of_the_rounded_values(name, overflow):
  """`dtype=` builds one-byte codes straight from the float32 bits.

  Oracles: nearest is the ml_dtypes cast of `x` ("ieee") or of `x` clipped
  to +-max ("saturate"); stochastic (bits injected) is the ml_dtypes cast
  of the float32 result, whose own oracle is gfloat (above). Inputs: every
  grid value, midpoint and neighbour, and 200_000 random float32 patterns
  (every exponent, subnormals, infinities, NaNs), seed 8.
  """
  fmt = lowprec.get_format(name)
  dt = fmt.native_dtype
  x = np.concatenate(
    [_probe_points(fmt.values(), fmt.max_finite), _random_float32(200_000, 8)]
  )
  top = np.float32(fmt.max_finite)
  with np.errstate(all="ignore"):
    clipped = x if overflow == "ieee" else np.clip(x, -top, top)
    want_rn = clipped.astype(dt)
  rn = jax.jit(
    lambda v: lowprec.round_nearest(v, name, overflow=overflow, dtype=dt)
  )
  bits = np.asarray(rng.random_bits(jax.random.key(9), x.shape))
  sr = jax.jit(
    lambda v, b: round_with_bits(v, name, b, overflow=overflow, dtype=dt)
  )
  wide = jax.jit(lambda v, b: round_with_bits(v, name, b, overflow=overflow))
  with np.errstate(all="ignore"):
    want_sr = np.asarray(wide(x, bits)).astype(dt)
  for got, want in ((rn(x), want_rn), (sr(x, bits), want_sr)):
    got = np.asarray(got)
    assert got.dtype == dt
    _assert_codes_equal(got, want)


def test_output_dtype_must_hold_the_grid():
  with pytest.raises(ValueError, match="does not hold the float8_e4m3fn grid"):
    lowprec.round_nearest(jnp.ones(2), "float8_e4m3fn", dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="does not hold the e8m3 grid"):
    lowprec.round_nearest(jnp.ones(2), "e8m3", dtype=jnp.bfloat16)
  out = lowprec.round_nearest(jnp.ones(2), "e8m3", dtype=jnp.float32)
  assert out.dtype == jnp.float32

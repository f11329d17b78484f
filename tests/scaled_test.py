"""Scaled formats against oracles: a numpy reference with ml_dtypes element
casts, Qwix's MX / NVFP4 / per-tensor fp8 quantizers, and statistics."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix

from lowprec import scaled
from lowprec.grids.scaled import SCALED

MX = [n for n, f in SCALED.items() if f.scale_type == "e8m0"]
ELEMENT_DTYPES = {
  "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
  "float8_e5m2": ml_dtypes.float8_e5m2,
  "float6_e3m2fn": ml_dtypes.float6_e3m2fn,
  "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
  "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
}


def _data(shape, seed=0, spread=8):
  """Normal values times 2^j per row (j in [-spread, spread]), with a row
  of zeros, a row of float32 subnormals and a row near float32's max."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x *= np.exp2(rng.integers(-spread, spread + 1, (shape[0], 1)))
  x[0] = 0.0
  x[1] = (x[1] * np.float32(2.0**-135)).astype(np.float32)  # subnormals
  x[2] = (x[2] * np.float32(2.0**124)).astype(np.float32)
  return x.astype(np.float32)


def _element_cast(y, element: str):
  """ml_dtypes' nearest cast, saturating: the element oracle."""
  top = float(ml_dtypes.finfo(ELEMENT_DTYPES[element]).max)
  return np.clip(y, -top, top).astype(ELEMENT_DTYPES[element])


def _reference_mx(x, fmt):
  """float64 numpy reference of an MX format along the last axis."""
  top = fmt.max_finite
  emax = int(np.floor(np.log2(top)))
  xb = x.astype(np.float64).reshape(x.shape[0], -1, fmt.block)
  amax = np.max(np.abs(xb), axis=-1, keepdims=True)
  with np.errstate(divide="ignore"):
    if fmt.rule == "ocp":
      k = np.floor(np.log2(amax)) - emax
    else:
      k = np.ceil(np.log2(amax / top))
  k = np.where(amax > 0, np.clip(k, -127, 127), 0.0)
  elements = _element_cast(xb / np.exp2(k), fmt.element.name)
  values = elements.astype(np.float64) * np.exp2(k)
  return values.reshape(x.shape), elements.reshape(x.shape), k[..., 0]


def _reference_nvfp4(x, tensor_amax=None):
  """NVFP4 by its definition, in float32 numpy arithmetic (no flushing)."""
  f32 = np.float32
  xb = x.reshape(x.shape[0], -1, 16)
  amax = np.max(np.abs(xb), axis=-1, keepdims=True)
  t = f32(np.max(amax)) if tensor_amax is None else f32(tensor_amax)
  s_t = t / f32(6 * 448) if t > 0 else f32(1)
  s_t = max(s_t, f32(2.0**-117))
  s_b = _element_cast(amax / (f32(6) * s_t), "float8_e4m3fn").astype(f32)
  s = s_b * s_t
  with np.errstate(invalid="ignore", divide="ignore"):
    y = np.where(s > 0, xb / s, f32(0))
  e = _element_cast(y, "float4_e2m1fn").astype(f32)
  return (e * s).reshape(x.shape), s_b[..., 0], s_t


def _same_bits(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@functools.cache
def _fq(name, rule, mode="nearest"):
  fmt = scaled.get_scaled_format(name, rule=rule)
  return jax.jit(lambda x, key: scaled.fake_quantize(x, fmt, mode, key))


@pytest.mark.parametrize("rule", scaled.SCALE_RULES)
@pytest.mark.parametrize("name", MX)
def test_mx_equals_the_float64_reference_bit_for_bit(name, rule):
  fmt = scaled.get_scaled_format(name, rule=rule)
  x = _data((16, 128))
  want, want_elements, want_k = _reference_mx(x, fmt)
  got = _fq(name, rule)(x, None)
  assert _same_bits(got, want.astype(np.float32))
  q = scaled.quantize(x, fmt)
  codes = np.asarray(jax.lax.bitcast_convert_type(q.scales.block, jnp.uint8))
  np.testing.assert_array_equal(codes.astype(np.int64) - 127, want_k)
  elements = np.asarray(q.elements.astype(jnp.float32))
  assert _same_bits(elements, want_elements.astype(np.float32))
  assert _same_bits(scaled.dequantize(q, fmt), got)


def test_nvfp4_equals_its_definition_in_float32():
  x = _data((16, 64), spread=3)[3:]  # normal values: float32 arithmetic
  got = scaled.fake_quantize(x, "nvfp4")
  want, s_b, s_t = _reference_nvfp4(x)
  assert _same_bits(got, want)
  q = scaled.quantize(x, "nvfp4")
  assert q.scales.block.dtype == jnp.float8_e4m3fn
  assert _same_bits(q.scales.block.astype(jnp.float32), s_b)
  assert _same_bits(q.scales.tensor, s_t)
  assert _same_bits(scaled.dequantize(q, "nvfp4"), got)


def _qwix(x, qtype, tile):
  tiled = {1: tile} if tile else None
  axes = (0,) if tile else ()
  return qwix.quantize(x, qtype, channelwise_axes=axes, tiled_axes=tiled)


@pytest.mark.parametrize(
  "name, qtype",
  [
    ("mxfp8_e4m3", "mxfp8"),
    ("mxfp4_e2m1", "mxfp4"),
    ("float8_e4m3fn:tensor", jnp.float8_e4m3fn),
    ("float8_e5m2:tensor", jnp.float8_e5m2),
  ],
  ids=["mxfp8", "mxfp4", "e4m3_tensor", "e5m2_tensor"],
)
def test_equals_qwix_where_qwix_has_the_same_rule(name, qtype):
  # Qwix's MX scale is 2^ceil(log2(amax / max_E)): the no-clip rule. Its
  # per-tensor fp8 scale is amax / max_E, as ours. Normal data only: Qwix
  # replaces scales below sqrt(float32 tiny) by 1.
  fmt = scaled.get_scaled_format(
    name, rule="noclip" if fmt_is_mx(name) else None
  )
  x = jnp.asarray(_data((32, 256), seed=1)[3:])
  theirs = _qwix(x, qtype, fmt.block)
  ours = scaled.quantize(x, fmt)
  assert _same_bits(scaled.fake_quantize(x, fmt), qwix.dequantize(theirs))
  assert _same_bits(
    ours.elements.astype(jnp.float32), theirs.qvalue.astype(jnp.float32)
  )
  theirs_scale = np.asarray(theirs.scale).reshape(ours.scales.block.shape)
  assert _same_bits(ours.scales.block.astype(jnp.float32), theirs_scale)


def fmt_is_mx(name):
  return SCALED[name].scale_type == "e8m0"


def test_nvfp4_with_a_unit_tensor_scale_equals_qwix():
  # Qwix's NVFP4 has no tensor scale: s_b = e4m3(amax_block / 6). Ours with
  # tensor_amax = 6 * 448 has s_t = 1 exactly.
  x = jnp.asarray(_data((32, 256), seed=2, spread=4)[3:])
  amax = scaled.block_amax(x, "nvfp4")
  s = scaled.scales_from_amax(amax, "nvfp4", tensor_amax=6.0 * 448)
  assert float(s.tensor) == 1.0
  theirs = _qwix(x, "nvfp4", 16)
  got = scaled.fake_quantize(x, "nvfp4", scales=s)
  assert _same_bits(got, qwix.dequantize(theirs))
  assert _same_bits(
    s.block.astype(jnp.float32), np.asarray(theirs.scale).reshape(amax.shape)
  )


# ---- rules and edge cases -------------------------------------------------


@pytest.mark.parametrize("name", MX)
def test_the_two_rules_differ_exactly_where_ocp_saturates(name):
  x = _data((16, 128), seed=3)
  ocp, _, k_ocp = _reference_mx(x, scaled.get_scaled_format(name))
  f = scaled.get_scaled_format(name, rule="noclip")
  _, _, k_noclip = _reference_mx(x, f)
  assert np.all((k_noclip == k_ocp) | (k_noclip == k_ocp + 1))
  # OCP's scale is the smaller where the block maximum would not fit.
  xb = np.abs(x).reshape(16, -1, 32).max(-1)
  over = xb > f.max_finite * np.exp2(k_ocp)
  np.testing.assert_array_equal(k_noclip == k_ocp + 1, over & (k_ocp < 127))
  got = np.asarray(_fq(name, "ocp")(x, None))
  assert np.all(np.abs(got) <= f.max_finite * np.repeat(np.exp2(k_ocp), 32, 1))


@pytest.mark.parametrize("name", list(SCALED))
def test_a_block_of_zeros_has_scale_one_and_zero_elements(name):
  x = jnp.zeros((2, 32)).at[1].set(-0.0)
  q = scaled.quantize(x, name)
  nvfp4 = SCALED[name].scale_type == "e4m3"  # s_b = e4m3(0) = 0, s_t = 1
  want = 0.0 if nvfp4 else 1.0
  np.testing.assert_array_equal(q.scales.block.astype(jnp.float32), want)
  if nvfp4:
    assert float(q.scales.tensor) == 1.0
  v = scaled.fake_quantize(x, name)
  assert _same_bits(v, x)  # the sign of zero kept


def test_scales_saturate_at_the_ends_of_e8m0():
  # amax 2^-140 would need 2^-148 (ocp, e4m3): E8M0 stops at 2^-127.
  x = jnp.full((1, 32), 2.0**-140, jnp.float32)
  q = scaled.quantize(x, "mxfp8_e4m3")
  code = jax.lax.bitcast_convert_type(q.scales.block, jnp.uint8)
  assert int(code[0, 0]) == 0
  # x / 2^-127 = 2^-13, below half e4m3's smallest subnormal 2^-9.
  np.testing.assert_array_equal(q.elements.astype(jnp.float32), 0.0)
  # 2^-130 / 2^-127 = 2^-3: representable, exact despite being subnormal.
  y = jnp.full((1, 32), 2.0**-130, jnp.float32)
  assert _same_bits(scaled.fake_quantize(y, "mxfp8_e4m3"), y)
  # The largest float32 needs 2^(127 - 8): in range, no E8M0 NaN.
  big = jnp.full((1, 32), np.finfo(np.float32).max)
  for name in MX:
    code = jax.lax.bitcast_convert_type(
      scaled.quantize(big, name).scales.block, jnp.uint8
    )
    assert int(code[0, 0]) < 255


def test_nvfp4_block_scale_saturates_at_448():
  x = jnp.full((1, 16), 10_000.0)
  s = scaled.scales_from_amax(
    scaled.block_amax(x, "nvfp4"), "nvfp4", tensor_amax=6.0 * 448
  )
  assert float(s.block.astype(jnp.float32)[0, 0]) == 448.0
  v = scaled.fake_quantize(x, "nvfp4", scales=s)
  np.testing.assert_array_equal(v, 6.0 * 448)  # elements saturate at 6


def test_nvfp4_block_far_below_the_tensor_amax_is_zero():
  x = jnp.ones((2, 16)).at[0].set(1e-7)
  v = scaled.fake_quantize(x, "nvfp4")
  np.testing.assert_array_equal(v[0], 0.0)
  np.testing.assert_array_equal(v[1], 1.0)


@pytest.mark.parametrize("name", list(SCALED))
def test_nonfinite_values_stay_in_their_place(name):
  f = scaled.get_scaled_format(name)
  x = jnp.asarray(_data((4, 64), seed=4)[3:]) * 0 + jnp.linspace(-2, 2, 64)
  bad = x.at[0, 5].set(jnp.nan).at[0, 7].set(jnp.inf).at[0, 9].set(-jnp.inf)
  clean = x.at[0, 5].set(0.0).at[0, 7].set(0.0).at[0, 9].set(0.0)
  v, want = scaled.fake_quantize(bad, f), scaled.fake_quantize(clean, f)
  keep = np.ones(64, bool)
  keep[[5, 7, 9]] = False
  np.testing.assert_array_equal(
    np.asarray(v)[0, keep], np.asarray(want)[0, keep]
  )
  assert np.isnan(v[0, 5])
  per = np.asarray(scaled.compute_scales(clean, f).block.astype(jnp.float32))
  per = per.ravel()[0]
  if f.scale_type == "e4m3":
    per = per * float(scaled.compute_scales(clean, f).tensor)
  np.testing.assert_allclose(v[0, 7], f.max_finite * per, rtol=1e-6)
  np.testing.assert_allclose(v[0, 9], -f.max_finite * per, rtol=1e-6)


def test_ldexp_is_exact_across_float32_subnormals():
  rng = np.random.default_rng(5)
  bits = rng.integers(0, 0x7F800000, 20_000, dtype=np.uint32)
  x = bits.view(np.float32)
  k = rng.integers(-60, 60, x.shape).astype(np.int32)
  got = np.asarray(jax.jit(scaled.ldexp)(x, k))
  want = np.ldexp(x.astype(np.float64), k)
  exact = want.astype(np.float32).astype(np.float64) == want
  in_range = np.abs(want) <= np.finfo(np.float32).max
  sel = exact & in_range
  assert sel.sum() > 15_000
  assert _same_bits(got[sel], want[sel].astype(np.float32))


def test_blocks_along_another_axis():
  x = jnp.asarray(_data((64, 8), seed=6))
  f0 = scaled.get_scaled_format("mxfp8_e4m3", axis=0)
  got = scaled.fake_quantize(x, f0)
  want = scaled.fake_quantize(x.T, "mxfp8_e4m3").T
  assert _same_bits(got, want)
  assert scaled.quantize(x, f0).scales.block.shape == (2, 8)
  f16 = scaled.get_scaled_format("mxfp8_e4m3", block=16)
  assert scaled.quantize(x.T, f16).scales.block.shape == (8, 4)


def test_delayed_scaling_takes_the_amax_of_a_history():
  # Per tensor: the scale from the history's largest amax; a history equal
  # to the current amax is current scaling.
  x = jnp.asarray(_data((8, 64), seed=14)[3:])
  f = "float8_e4m3fn:tensor"
  now = scaled.block_amax(x, f)
  history = jnp.stack([now * 0.5, now, now * 4.0])
  s = scaled.scales_from_amax(jnp.max(history), f)
  assert float(s.block) == float(now * 4.0 / jnp.float32(448.0))
  delayed = scaled.fake_quantize(x, f, scales=s)
  assert float(jnp.max(jnp.abs(delayed))) <= float(now)
  same = scaled.scales_from_amax(jnp.max(history[:2]), f)
  assert _same_bits(
    scaled.fake_quantize(x, f, scales=same), scaled.fake_quantize(x, f)
  )


# ---- stochastic rounding --------------------------------------------------


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"])
def test_stochastic_rounding_is_unbiased_given_the_scale(name):
  # Seed 0, 4096 copies of one block pair (same scales in every row):
  # per element the mean of 4096 draws is within 5 standard errors of x,
  # se = gap / (2 sqrt(4096)) at most; nearest rounding misses by more.
  rows = 4096
  base = np.random.default_rng(7).standard_normal((1, 32)).astype(np.float32)
  x = jnp.asarray(np.repeat(base, rows, 0))
  sr = np.asarray(_fq(name, None, "stochastic")(x, jax.random.key(0)))
  nearest = np.asarray(_fq(name, None)(x, None))[0]
  lo = np.min(sr, axis=0)
  hi = np.max(sr, axis=0)
  # Elements that never move are on the grid or saturated (NVFP4's block
  # maximum saturates where its E4M3 scale rounded down).
  moves = hi > lo
  assert moves.sum() >= 28
  b, gap = base[0][moves], (hi - lo)[moves]
  assert np.all((lo[moves] <= b) & (b <= hi[moves]))
  tol = 5 * gap / (2 * np.sqrt(rows))
  assert np.all(np.abs(sr.mean(0)[moves] - b) <= tol)
  assert np.any(np.abs(nearest[moves] - b) > tol)
  # Every draw is one of the two grid neighbours of x.
  assert np.all((sr == lo) | (sr == hi))


def test_stochastic_is_the_same_eager_and_jitted():
  x = jnp.asarray(_data((8, 64), seed=8))
  key = jax.random.key(3)
  eager = scaled.fake_quantize(x, "mxfp6_e2m3", "stochastic", key)
  assert _same_bits(eager, _fq("mxfp6_e2m3", None, "stochastic")(x, key))


# ---- errors ---------------------------------------------------------------


@pytest.mark.parametrize(
  "call, match",
  [
    (
      lambda: scaled.quantize(jnp.ones((2, 40)), "mxfp8_e4m3"),
      "not a multiple of the block size 32. Pad it to 64",
    ),
    (
      lambda: scaled.get_scaled_format("float8_e4m3fn"),
      "unscaled format: use lowprec.get_format",
    ),
    (lambda: scaled.get_scaled_format("mxfp8_e4m"), "Did you mean"),
    (
      lambda: scaled.get_scaled_format("nvfp4", rule="ocp"),
      "unknown scale rule for nvfp4 'ocp'; valid: nvfp4",
    ),
    (
      lambda: scaled.get_scaled_format("float8_e5m2:tensor", block=32),
      "one scale per tensor",
    ),
    (
      lambda: scaled.fake_quantize(jnp.ones((1, 32)), "nvfp4", "stochastic"),
      "needs a PRNG key",
    ),
    (
      lambda: scaled.fake_quantize(jnp.ones((1, 32)), "nvfp4", "nearst"),
      "Did you mean 'nearest'",
    ),
    (
      lambda: scaled.quantize(jnp.ones((32,)), "mxfp8_e4m3", overflow="x"),
      "unknown overflow mode",
    ),
  ],
  ids=[
    "indivisible",
    "unscaled",
    "typo",
    "rule",
    "block",
    "key",
    "mode",
    "ovf",
  ],
)
def test_bad_input_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# The block helpers take a resolved format and checked choices, so each
# public function must refuse a bad name itself.
_X = jnp.ones((1, 32))


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: scaled.block_amax(_X, "mxfp8"), "unknown scaled format"),
    (lambda: scaled.scales_from_amax(1.0, "mxfp8"), "unknown scaled format"),
    (lambda: scaled.compute_scales(_X, "mxfp8"), "unknown scaled format"),
    (lambda: scaled.pow2_exponent(1.0, 448.0, "ocpp"), "unknown scale rule"),
    (lambda: scaled.quantize(_X, "nvfp4", "nearst"), "unknown rounding mode"),
    (
      lambda: scaled.fake_quantize(_X, "nvfp4", overflow="clip"),
      "unknown overflow mode",
    ),
    (
      lambda: scaled.fake_quantize_and_scales(_X, "mxfp8_e4m3", "up"),
      "unknown rounding mode",
    ),
    (
      lambda: scaled.fake_quantize_and_scales(_X, "nvfp4", overflow="clip"),
      "unknown overflow mode",
    ),
    (
      lambda: scaled.dequantize(scaled.quantize(_X, "nvfp4"), "nvfp"),
      "unknown scaled format",
    ),
  ],
  ids=[
    "block_amax",
    "scales_from_amax",
    "compute_scales",
    "pow2_exponent",
    "quantize-mode",
    "fake_quantize-ovf",
    "and_scales-mode",
    "and_scales-ovf",
    "dequantize",
  ],
)
def test_each_public_function_checks_its_names(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_get_format_points_a_scaled_name_to_the_scaled_api():
  from lowprec import get_format

  with pytest.raises(ValueError, match="is a scaled format"):
    get_format("mxfp8_e4m3")


# ---- where format names are used --------------------------------------------


def test_ops_rounding_takes_a_scaled_format():
  from lowprec import ops

  x = jnp.asarray(_data((8, 64), seed=9)[3:])
  key = jax.random.key(4)
  r = ops.Rounding("mxfp8_e4m3", "stochastic")
  assert repr(r) == "Rounding('mxfp8_e4m3:stochastic')" and r.scaled
  value, stored = r.round(x, key)
  want = scaled.fake_quantize(x, "mxfp8_e4m3", "stochastic", key)
  assert _same_bits(value, want)
  assert _same_bits(stored.value(), want)
  assert stored.quantized.elements.dtype == jnp.float8_e4m3fn
  parsed = ops.Rounding.parse("float8_e4m3fn:tensor:stochastic")
  assert parsed.format is SCALED["float8_e4m3fn:tensor"]
  assert parsed.mode == "stochastic"
  assert ops.Rounding.parse("nvfp4").format is SCALED["nvfp4"]


def test_a_dense_op_saves_its_input_on_a_scaled_grid():
  from lowprec import ops

  x = jnp.asarray(_data((8, 64), seed=10)[3:])
  w = jnp.asarray(np.random.default_rng(11).standard_normal((64, 32)))
  op = ops.Dense(x="mxfp4_e2m1:nearest")

  def loss(w):
    return jnp.sum(op(x, w) ** 2)

  g = jax.jit(jax.grad(loss))(w)
  xq = scaled.fake_quantize(x, "mxfp4_e2m1")
  want = jax.grad(lambda w: jnp.sum((xq @ w) ** 2))(w)
  # Both are float32 sums of 64 products (|g| up to 1e6) in orders that
  # the compiler picks; a wrong rounding of x moves g by far more.
  np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)
  # Incoming gradients on a scaled grid too (blocks of 32 along `out`).
  op = ops.Dense(x="mxfp4_e2m1:nearest", grad="mxfp8_e5m2:stochastic")
  g = jax.jit(jax.grad(lambda w: jnp.sum(op(x, w, key=jax.random.key(0)))))
  assert bool(jnp.all(jnp.isfinite(g(w))))


def _sgd_writeback(fmt, rounding, lr):
  import optax

  import lowprec

  key = jax.random.key(5)
  return optax.chain(
    optax.sgd(lr), lowprec.writeback(fmt, rounding, key=key)
  ), lowprec


def test_writeback_onto_a_scaled_grid_rescales_from_the_written_values():
  import optax

  w0 = np.random.default_rng(12).standard_normal((4, 64)).astype(np.float32)
  g = np.random.default_rng(13).standard_normal((4, 64)).astype(np.float32)
  opt, lowprec = _sgd_writeback("mxfp8_e4m3", "nearest", 0.5)
  w = lowprec.to_grid({"w": jnp.asarray(w0)}, "mxfp8_e4m3")
  state = opt.init(w)
  updates, state = jax.jit(opt.update)({"w": jnp.asarray(g)}, state, w)
  new = optax.apply_updates(w, updates)
  u = np.float32(-0.5) * g
  x = w["w"] + u
  assert _same_bits(new["w"], scaled.fake_quantize(x, "mxfp8_e4m3"))
  lowprec.check_on_grid(new, "mxfp8_e4m3")
  t = lowprec.telemetry(state)
  old_k = scaled.compute_scales(w["w"], "mxfp8_e4m3").block
  new_k = scaled.compute_scales(x, "mxfp8_e4m3").block
  code = lambda s: np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8))  # noqa: E731
  changed = int(np.sum(code(old_k) != code(new_k)))
  assert t["blocks"] == 8 and t["rescaled"] == changed
  assert t["rescaled_fraction"] == changed / 8
  arrays = jax.jit(lowprec.telemetry_arrays)(state)
  assert int(arrays["rescaled/w"]) == changed
  moved = np.asarray(new["w"] != w["w"]) & (u != 0)
  assert t["erased"] == int(np.sum((u != 0) & ~moved))


def test_small_proposals_are_erased_on_a_scaled_grid_and_not_under_sr():
  import optax

  # 1.5 - 0.03 stays in 1.5's binade: same scale, gap 0.125, |u| < gap / 2.
  w0 = np.full((2, 32), 1.5, np.float32)
  g = np.ones((2, 32), np.float32)
  for rounding in ("nearest", "stochastic", "deadzone"):
    opt, lowprec = _sgd_writeback("mxfp8_e4m3", rounding, 0.03)
    w = lowprec.to_grid({"w": jnp.asarray(w0)}, "mxfp8_e4m3")
    state = opt.init(w)
    updates, state = opt.update({"w": jnp.asarray(g)}, state, w)
    t = lowprec.telemetry(state)
    assert t["proposals"] == 64 and t["rescaled"] == 0
    if rounding == "nearest":
      assert t["erased"] == 64
    else:  # down with probability 0.03 / 0.125 each: none moving, 2e-8
      assert 0 < t["moved"] < 64  # deadzone: SR wherever nearest erases
    lowprec.check_on_grid(optax.apply_updates(w, updates), "mxfp8_e4m3")


def _sr_mx_oracle(x, bits, fmt):
  """Stochastic MX rounding of float32 `x` given 32 random bits per
  element, in float64 numpy: scales as `_reference_mx`, then each element
  `y` goes away from zero to the next grid magnitude iff `bits <
  floor(2^32 (|y| - lo) / (hi - lo))`, `lo <= |y| < hi` neighbours in the
  element grid (enumerated by ml_dtypes). No element past max_E here."""
  dtype = ELEMENT_DTYPES[fmt.element.name]
  codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
  grid = np.unique(np.abs(codes[np.isfinite(codes)]))
  _, _, k = _reference_mx(x, fmt)
  y = x.astype(np.float64).reshape(x.shape[0], -1, fmt.block)
  y = (y / np.exp2(k)[..., None]).reshape(x.shape)
  a = np.abs(y)
  i = np.searchsorted(grid, a, side="right") - 1
  lo, hi = grid[i], grid[np.minimum(i + 1, len(grid) - 1)]
  frac = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, 1), 0)
  away = bits.astype(np.float64) < np.floor(frac * 2.0**32)
  q = np.sign(y) * np.where(away, hi, lo)
  q = q.reshape(x.shape[0], -1, fmt.block) * np.exp2(k)[..., None]
  return q.reshape(x.shape)


def test_deadzone_on_an_mx_grid_is_nearest_where_it_moves_else_sr():
  # Deterministic: the write-back's 32 bits per element are drawn as it
  # draws them (the step's key folded by the path), and the outcome of
  # each rounding is recomputed from them in numpy. Each row has blocks
  # at their own magnitudes (max 1.5 * 2^j: no element saturates); half
  # the proposals are below a quarter of the element gap (nearest erases
  # them), half are up to three gaps (nearest moves them).
  import optax

  import lowprec
  from lowprec.grids import rng as rng_lib

  fmt = scaled.get_scaled_format("mxfp8_e4m3")
  r = np.random.default_rng(21)
  shape = (4, 64)
  mag = r.uniform(0.1, 1.0, shape) * np.exp2(r.integers(-6, 7, (4, 1)))
  w0 = np.sign(r.standard_normal(shape)) * mag
  w0[:, ::32] = np.sign(w0[:, ::32]) * 1.5 * np.abs(w0[:, ::32]).max()
  w = _reference_mx(w0.astype(np.float32), fmt)[0].astype(np.float32)
  # The gap at w: 2^(e - 3) in the element's binade 2^e, times the scale.
  scale = np.repeat(np.exp2(_reference_mx(w, fmt)[2]), 32, axis=1)
  gap = np.exp2(np.floor(np.log2(np.abs(w) / scale)) - 3) * scale
  small = r.uniform(-0.25, 0.25, shape) * gap
  large = r.uniform(-3, 3, shape) * gap
  u = np.where(r.random(shape) < 0.5, small, large).astype(np.float32)
  u[:, ::32] = 0.0  # the block maxima stay: the scales stay
  key = jax.random.key(3)
  words, impl = rng_lib.state_key(key, "test")
  _, step_key = rng_lib.next_step(words, impl)
  leaf_key = rng_lib.leaf_keys(step_key, ["w"])["w"]
  bits = np.asarray(rng_lib.random_bits(leaf_key, shape))

  def written(rounding):
    tx = lowprec.writeback(fmt, rounding, key=key)
    params = {"w": jnp.asarray(w)}
    d, _ = jax.jit(tx.update)({"w": jnp.asarray(u)}, tx.init(params), params)
    return np.asarray(optax.apply_updates(params, d)["w"], np.float64)

  x = (w + u).astype(np.float32)
  rn = _reference_mx(x, fmt)[0]
  sr = _sr_mx_oracle(x, bits, fmt)
  erased = rn == w
  assert 40 < erased.sum() < 200 and (sr != rn)[~erased].any()
  assert (sr != w)[erased].sum() > 5  # SR moves some that nearest erases
  np.testing.assert_array_equal(written("nearest"), rn)
  np.testing.assert_array_equal(written("stochastic"), sr)
  np.testing.assert_array_equal(written("deadzone"), np.where(erased, sr, rn))


def test_under_the_ocp_rule_a_block_just_below_a_power_of_two_saturates():
  # 1 - 0.001: floor(log2 amax) drops, the scale halves to 2^-9 and
  # 0.999 / 2^-9 = 511.5 saturates at 448: the block lands on 0.875. The
  # no-clip rule keeps the scale and erases the proposal.
  import optax

  w0, g = np.ones((1, 32), np.float32), np.ones((1, 32), np.float32)
  for rule, want in [("ocp", 0.875), ("noclip", 1.0)]:
    fmt = scaled.get_scaled_format("mxfp8_e4m3", rule=rule)
    opt, lowprec = _sgd_writeback(fmt, "nearest", 1e-3)
    w = {"w": jnp.asarray(w0)}
    updates, state = opt.update({"w": jnp.asarray(g)}, opt.init(w), w)
    np.testing.assert_array_equal(optax.apply_updates(w, updates)["w"], want)
    assert lowprec.telemetry(state)["rescaled"] == (rule == "ocp")


def _reference_keep(w, x, fmt):
  """float64 oracle of a "keep" write-back: `x` rounded (nearest,
  saturating) with the exponents of `w`'s blocks; under `ocp`, then onto
  the grid of its own scales. Returns the values (`w`'s own where equal,
  so -0 stays) and the mask of elements whose rounding went past max_E."""
  top = fmt.max_finite
  # Past the top when rounding (ties to even) in the top binade's gap
  # gives more than max_E.
  gap = 2.0 ** (np.floor(np.log2(top)) - fmt.element.man_bits)

  def past_top(y):
    return np.round(np.abs(y) / gap) * gap > top

  _, _, k = _reference_mx(w, fmt)
  xb = x.astype(np.float64).reshape(x.shape[0], -1, fmt.block)
  y = xb / np.exp2(k)[..., None]
  over = past_top(y)
  v = _element_cast(y, fmt.element.name).astype(np.float64)
  v = (v * np.exp2(k)[..., None]).reshape(x.shape)
  if fmt.rule == "ocp":
    own, _, k2 = _reference_mx(v, fmt)
    over |= past_top(v.reshape(xb.shape) / np.exp2(k2)[..., None])
    v = own
  return np.where(v == w, w, v), over.reshape(x.shape)


def _keep_step(fmt, w, u, rounding="nearest"):
  """One jitted SGD(lr=1) step with scales="keep": new w and telemetry."""
  import optax

  import lowprec

  opt = optax.chain(
    optax.sgd(1.0),
    lowprec.writeback(fmt, rounding, key=jax.random.key(8), scales="keep"),
  )
  params = {"w": jnp.asarray(w)}
  lowprec.check_on_grid(params, fmt)
  state = opt.init(params)
  updates, state = jax.jit(opt.update)({"w": -jnp.asarray(u)}, state, params)
  new = optax.apply_updates(params, updates)
  lowprec.check_on_grid(new, fmt)  # the next step's scales come from it
  return np.asarray(new["w"]), lowprec.telemetry(state)


def test_keep_rounds_with_the_scales_of_w_where_recompute_rescales():
  # Block max 2 (scale 2^-7, top 448 * 2^-7 = 3.5) proposed to 4.5, which
  # would double the scale. A subnormal element 2^-14 (4 gaps of 2^-16)
  # with u = 0.6 gap: it moves under the kept scale and is erased under
  # the doubled one (gap 2^-15, u = 0.3 gap).
  w = np.full((1, 32), 0.5, np.float32)
  w[0, 0], w[0, 1] = 2.0, 2.0**-14
  u = np.zeros_like(w)
  u[0, 0], u[0, 1], u[0, 2] = 2.5, np.float32(1.2 * 2.0**-17), 0.25
  x = (w + u).astype(np.float32)
  for rule in scaled.SCALE_RULES:
    fmt = scaled.get_scaled_format("mxfp8_e4m3", rule=rule)
    new, t = _keep_step(fmt, w, u)
    want, over = _reference_keep(w, x, fmt)
    assert _same_bits(new, want.astype(np.float32))
    assert new[0, 0] == 3.5 and new[0, 1] == 2.0**-14 + 2.0**-16
    assert t["saturated"] == 1 == int(over.sum())
    assert t["rescaled"] == 0 and t["blocks"] == 1
    assert t["proposals"] == 3 and t["erased"] == 0
  recomputed = scaled.fake_quantize(x, "mxfp8_e4m3")
  assert recomputed[0, 0] == 4.5 and recomputed[0, 1] == 2.0**-14


@pytest.mark.parametrize("rule", scaled.SCALE_RULES)
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"])
def test_keep_equals_the_float64_reference_with_its_counts(name, rule):
  fmt = scaled.get_scaled_format(name, rule=rule)
  rng = np.random.default_rng(14)
  w = np.asarray(scaled.fake_quantize(_data((8, 64), seed=15)[3:], fmt))
  # Proposals from a tenth of a gap to past the block max, some zero.
  u = w * rng.choice([0.0, 0.01, -0.05, 0.3, 1.5], w.shape)
  u = u.astype(np.float32)
  new, t = _keep_step(fmt, w, u)
  x = (w + u).astype(np.float32)
  want, over = _reference_keep(w, x, fmt)
  assert _same_bits(new, want.astype(np.float32))
  proposed = u != 0
  assert t["proposals"] == int(proposed.sum())
  assert t["erased"] == int((proposed & (want == w)).sum())
  assert t["moved"] == int((proposed & (want != w)).sum())
  assert t["saturated"] == int((proposed & over).sum()) > 0
  assert t["rescaled"] == 0 and t["unreachable"] == 0


def test_keep_puts_an_ocp_e4m3_block_that_fell_a_binade_on_its_own_grid():
  # 256 * 2^-8 = 1 falls to 0.9375 = 240 * 2^-8: on the kept grid, but its
  # own OCP scale is 2^-9 and 480 > 448 saturates it to 0.875. No-clip:
  # 1 has scale 2^-8 already (256 <= 448) and 0.9375 stays.
  w = np.full((1, 32), 0.25, np.float32)
  w[0, 0] = 1.0
  u = np.zeros_like(w)
  u[0, 0] = -0.0625
  for rule, want in [("ocp", 0.875), ("noclip", 0.9375)]:
    fmt = scaled.get_scaled_format("mxfp8_e4m3", rule=rule)
    new, t = _keep_step(fmt, w, u)
    assert new[0, 0] == want and t["saturated"] == (rule == "ocp")
    assert np.array_equal(new[0, 1:], w[0, 1:])


@pytest.mark.parametrize("rounding", ["stochastic", "deadzone"])
def test_keep_under_random_roundings_stays_on_the_kept_grid(rounding):
  w = np.asarray(
    scaled.fake_quantize(_data((8, 64), seed=16)[3:], "mxfp8_e4m3")
  )
  u = (w * np.float32(0.02)).astype(np.float32)
  new, t = _keep_step("mxfp8_e4m3", w, u, rounding)
  k = np.asarray(scaled.compute_scales(w, "mxfp8_e4m3").block, np.float32)
  kept = scaled.fake_quantize(
    new,
    "mxfp8_e4m3",
    scales=scaled.Scales(jnp.asarray(k).astype(jnp.float8_e8m0fnu)),
  )
  assert _same_bits(kept, new) and t["rescaled"] == 0 and t["moved"] > 0


def test_mx_grids_are_fixed_points_and_nvfp4_is_not():
  # Why write-back takes MX and refuses NVFP4: a tensor on an MX grid is
  # on the grid of its own scales; rounding one already on the NVFP4 grid
  # recomputes s_t from the rounded amax and moves most of its values.
  rng = np.random.default_rng(17)
  moved = {}
  for name in (*MX, "nvfp4"):
    x = rng.standard_normal((50, 256)).astype(np.float32)
    q = scaled.fake_quantize(x, name)
    moved[name] = int(jnp.sum(scaled.fake_quantize(q, name) != q))
  assert all(moved[n] == 0 for n in MX), moved
  assert moved["nvfp4"] > 10_000, moved  # of 11,932 nonzero values


@pytest.mark.parametrize(
  "call, match",
  [
    (
      lambda: _sgd_writeback("nvfp4", "nearest", 0.1)[0].init(
        {"w": jnp.ones((2, 16))}
      ),
      "not a fixed point of its own rounding.*Use 'mxfp4_e2m1'",
    ),
    (
      lambda: _sgd_writeback("float8_e4m3fn:tensor", "nearest", 0.1)[0].init(
        {"w": jnp.ones((2, 16))}
      ),
      "moves every value of the tensor.*Use the element format itself",
    ),
    (
      lambda: __import__("lowprec").writeback("mxfp8_e4m3", scales="kept"),
      "Did you mean 'keep'",
    ),
    (
      lambda: __import__("lowprec").store_state(
        __import__("optax").adam(1e-3), {"mu": "mxfp8_e4m3"}
      ),
      "is a scaled format",
    ),
    (
      lambda: __import__("lowprec").ops.Rounding("nvfp4", scaled=False),
      "always uses its own scales",
    ),
  ],
  ids=["writeback_nvfp4", "writeback_tensor", "scales", "state", "rounding"],
)
def test_scaled_names_where_they_do_not_apply(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def _every_exponent(rows, seed=0):
  """Float32 values of every biased exponent (subnormals, inf and NaN
  included), both signs, random mantissas: each row holds all 2048, in
  64 blocks of 32."""
  rng = np.random.default_rng(seed)
  exp = np.arange(256, dtype=np.uint32).repeat(8)
  man = rng.integers(0, 1 << 23, (rows, exp.size), dtype=np.uint32)
  man[:, ::8] = 0  # powers of two, zeros and infinities
  sign = rng.integers(0, 2, (rows, exp.size), dtype=np.uint32) << 31
  x = (sign | (exp << 23) | man).view(np.float32)
  return rng.permuted(x, axis=1)


@pytest.mark.parametrize("overflow", ["saturate", "ieee"])
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_one_byte_codes_equal_the_scaled_values_rounded(name, mode, overflow):
  # `quantize` emits one-byte MX elements straight from x's bits and the
  # block exponents; `fake_quantize` scales first (ldexp), then rounds.
  # Every exponent class under computed scales (both rules), and under
  # given scales: row r's blocks all take E8M0 exponent -127 + 4r (up to
  # +125) or +127 (the last row).
  x = _every_exponent(65)
  key = jax.random.key(4)
  codes = np.minimum(np.arange(65) * 4, 254).astype(np.uint8)
  given = jax.lax.bitcast_convert_type(
    jnp.asarray(np.repeat(codes[:, None], 64, 1)), jnp.float8_e8m0fnu
  )
  for rule, scales in (
    ("ocp", None),
    ("noclip", None),
    ("ocp", scaled.Scales(given)),
  ):
    fmt = scaled.get_scaled_format(name, rule=rule)
    kw = dict(overflow=overflow, scales=scales)
    q = scaled.quantize(x, fmt, mode, key, **kw)
    got = np.asarray(scaled.dequantize(q, fmt))
    want = np.asarray(scaled.fake_quantize(x, fmt, mode, key, **kw))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert _same_bits(got[ok], want[ok]), (rule, scales is None)

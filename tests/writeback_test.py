"""Write-back transforms against independent oracles.

Grids come from ml_dtypes code enumerations (named formats) or from the
format definitions written out here (eXmY, intK); nearest rounding is
recomputed in float64 numpy from those tables. Nothing below uses lowprec's
rounding to compute an expected value.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lowprec
from lowprec.optim.writeback import ROUNDINGS
from tests.telemetry_test import assert_telemetry_equal

INT3 = lowprec.get_format("int3", scale=0.125)

# name: (format, storage, apply_updates)
STORAGES = {
  "bf16-native": ("bfloat16", "native", optax.apply_updates),
  "e4m3fn-native": ("float8_e4m3fn", "native", lowprec.apply_updates),
  "bf16-f32": ("bfloat16", "float32", optax.apply_updates),
  "e4m3fn-f32": ("float8_e4m3fn", "float32", optax.apply_updates),
  "e5m2-f32": ("float8_e5m2", "float32", optax.apply_updates),
  "e8m3-f32": ("e8m3", "float32", optax.apply_updates),
  "int3-f32": (INT3, "float32", optax.apply_updates),
}
KEY = jax.random.key(7)


def _harness_cases():
  """Every rounding x storage. The default run takes each storage once,
  cycling through the rounding modes; the rest of the product is marked
  slow (run it with `pytest -m slow`)."""
  for i, storage in enumerate(STORAGES):
    for j, rounding in enumerate(ROUNDINGS):
      marks = () if i % len(ROUNDINGS) == j else pytest.mark.slow
      yield pytest.param(
        rounding, storage, marks=marks, id=f"{rounding}-{storage}"
      )


HARNESS = list(_harness_cases())


# ---- oracles ---------------------------------------------------------------


def _grid(fmt) -> np.ndarray:
  """Nonnegative finite grid values, ascending; the index is the code."""
  fmt = lowprec.get_format(fmt)
  if not fmt.is_float:
    return np.arange(fmt.int_max + 1) * fmt.scale
  if fmt.native_dtype is not None:
    codes = np.arange(1 << (fmt.bits - 1), dtype=np.uint16)
    if fmt.bits == 8:
      codes = codes.astype(np.uint8)
    with np.errstate(invalid="ignore"):
      v = codes.view(fmt.native_dtype).astype(np.float64)
    return v[np.isfinite(v)]
  # IEEE-like eXmY: subnormals k 2^(emin - m), normals (2^m + j) 2^(e - m).
  m, bias = fmt.man_bits, (1 << (fmt.exp_bits - 1)) - 1
  emin, emax = 1 - bias, (1 << fmt.exp_bits) - 2 - bias
  e = np.repeat(np.arange(emin, emax + 1), 1 << m)
  j = np.tile(np.arange(1 << m), emax - emin + 1)
  sub = np.arange(1 << m) * 2.0 ** (emin - m)
  return np.concatenate([sub, ((1 << m) + j) * 2.0 ** (e - m)])


def _bracket(x, pos):
  """Grid neighbours lo <= |x| <= hi by code index; hi past max is the
  value one top gap above it (the code an overflow would take)."""
  a = np.abs(np.asarray(x, np.float64))
  top = len(pos) - 1
  i = np.clip(np.searchsorted(pos, a, side="right") - 1, 0, top)
  beyond = pos[top] + (pos[top] - pos[top - 1])
  hi = np.where(i < top, pos[np.minimum(i + 1, top)], beyond)
  return i, pos[i], hi


def _rn(x, pos):
  """Round to nearest, ties to the even code, saturating; and overflow."""
  i, lo, hi = _bracket(x, pos)
  a = np.abs(np.asarray(x, np.float64))
  up = (hi - a < a - lo) | ((hi - a == a - lo) & (i % 2 == 1))
  idx = np.where(a == lo, i, i + up)
  over = idx >= len(pos)
  mag = pos[np.minimum(idx, len(pos) - 1)]
  return np.copysign(mag, x), over


def _gaps(w, pos):
  """Gap above and below each grid value w (inf past the ends)."""
  a = np.abs(np.asarray(w, np.float64))
  i = np.searchsorted(pos, a)
  assert np.array_equal(pos[i], a), "not a grid value"
  up = np.where(i + 1 < len(pos), pos[np.minimum(i + 1, len(pos) - 1)], np.inf)
  down = np.where(i > 0, pos[np.maximum(i - 1, 0)], -pos[1])
  g_out, g_in = up - a, a - down  # away from / toward zero
  neg = np.signbit(w)
  return np.where(neg, g_in, g_out), np.where(neg, g_out, g_in)


def _sample_grid(fmt, n, rng, lo=2.0**-100):
  pos = _grid(fmt)
  pos = pos[(pos >= lo) | (pos == 0)]
  return rng.choice(pos, n) * rng.choice([-1.0, 1.0], n)


# ---- harness ---------------------------------------------------------------


def _params(fmt, storage):
  f = lowprec.get_format(fmt)
  std = 0.4 * f.max_finite if not f.is_float else 0.5
  k1, k2 = jax.random.split(jax.random.key(0))
  p = {
    "dense": {
      "kernel": std * jax.random.normal(k1, (16, 8)),
      "bias": std * jax.random.normal(k2, (8,)),
    }
  }
  return lowprec.to_grid(p, fmt, storage=storage)


def _proposals(params, t):
  """Float32 proposals: some erased, some moving on every grid here."""
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(t)
  out = [
    (0.05 * rng.standard_normal(x.shape)).astype(np.float32) for x in leaves
  ]
  out[0][0] = 0.0  # some coordinates propose nothing
  return jax.tree.unflatten(treedef, [jnp.asarray(u) for u in out])


def _f32(tree):
  return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def _assert_bits_equal(a, b):
  for x, y in zip(_f32(a), _f32(b), strict=True):
    np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


def _check_step(fmt, rounding, params, u, deltas, new):
  """Exact landing, dtype, and the rounding rule against the oracle."""
  pos = _grid(fmt)
  for p, d, n, uu in zip(
    jax.tree.leaves(params),
    jax.tree.leaves(deltas),
    jax.tree.leaves(new),
    jax.tree.leaves(u),
    strict=True,
  ):
    assert n.dtype == p.dtype and d.dtype == np.float32
    w = np.asarray(p, np.float32)
    got = np.asarray(n, np.float32)
    # The float32 sum itself is the new grid value: no cast rounded it.
    landed = w + np.asarray(d)
    np.testing.assert_array_equal(landed.view(np.uint32), got.view(np.uint32))
    x = w + np.asarray(uu)
    rn, _ = _rn(x, pos)
    _, lo, hi = _bracket(x, pos)
    lo, hi = np.copysign(lo, x), np.copysign(np.minimum(hi, pos[-1]), x)
    still = np.asarray(uu) == 0
    np.testing.assert_array_equal(got[still], w[still])
    if rounding == "nearest":
      np.testing.assert_array_equal(got, np.where(still, w, rn))
    else:
      assert np.all((got == lo) | (got == hi) | still)
    if rounding == "deadzone":
      moves = (rn != w) & ~still
      np.testing.assert_array_equal(got[moves], rn[moves])


@pytest.mark.parametrize("rounding, storage", HARNESS)
def test_jit_lands_exactly_compiles_once_and_advances_key(rounding, storage):
  fmt, store, apply = STORAGES[storage]
  params = _params(fmt, store)
  opt = lowprec.writeback(fmt, rounding, key=KEY)
  state = opt.init(params)
  traces = []

  @jax.jit
  def step(params, state, u):
    traces.append(None)
    deltas, state = opt.update(u, state, params)
    return apply(params, deltas), deltas, state

  keys = []
  for t in range(3):
    u = _proposals(params, t)
    new, deltas, state = step(params, state, u)
    _check_step(fmt, rounding, params, u, deltas, new)
    params = new
    keys.append(None if state.key is None else tuple(np.asarray(state.key)))
  assert len(traces) == 1
  assert lowprec.telemetry(state)["steps"] == 3
  if rounding != "nearest":
    assert len(set(keys)) == 3 and state.key.dtype == np.uint32
  # No master weights: the state is counters and a key, whatever the params.
  for leaf in jax.tree.leaves(state):
    assert leaf.shape in ((), (2,)), leaf.shape


@pytest.mark.parametrize("rounding, storage", HARNESS)
def test_composes_with_optax_wrappers(rounding, storage):
  fmt, store, _ = STORAGES[storage]
  params = _params(fmt, store)
  u = _proposals(params, 0)

  def wb():
    return lowprec.writeback(fmt, rounding, key=KEY)

  want, want_state = jax.jit(wb().update)(u, wb().init(params), params)
  want_tel = lowprec.telemetry(want_state)

  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  shapes = jax.eval_shape(wb().init, abstract)
  assert jax.tree.structure(shapes) == jax.tree.structure(wb().init(params))

  inject = optax.inject_hyperparams(
    lambda learning_rate: optax.chain(optax.scale(learning_rate), wb()),
    hyperparam_dtype=jnp.float32,
  )(learning_rate=1.0)
  got, state = jax.jit(inject.update)(u, inject.init(params), params)
  _assert_bits_equal(got, want)
  assert_telemetry_equal(lowprec.telemetry(state), want_tel)

  multi = optax.MultiSteps(wb(), 2, accumulator_dtype=jnp.float32)
  update = jax.jit(multi.update)
  first, state = update(u, multi.init(params), params)
  assert not any(np.any(x) for x in _f32(first))
  assert lowprec.telemetry(state)["steps"] == 0
  got, state = update(u, state, params)
  _assert_bits_equal(got, want)
  assert_telemetry_equal(lowprec.telemetry(state), want_tel)

  masked = optax.masked(wb(), {"dense": {"kernel": True, "bias": False}})
  got, state = jax.jit(masked.update)(u, masked.init(params), params)
  # Random streams are keyed by parameter path, so masking changes nothing
  # for the parameters that stay in.
  _assert_bits_equal(got["dense"]["kernel"], want["dense"]["kernel"])
  _assert_bits_equal(got["dense"]["bias"], u["dense"]["bias"])
  tel = lowprec.telemetry(state)
  assert "proposals/dense/bias" not in tel
  assert tel["moved/dense/kernel"] == want_tel["moved/dense/kernel"]


@pytest.mark.parametrize("rounding, storage", HARNESS)
def test_eight_devices_give_the_bits_of_one(rounding, storage):
  fmt, store, apply = STORAGES[storage]
  opt = lowprec.writeback(fmt, rounding, key=KEY)

  @jax.jit
  def two_steps(params, state, u):
    for _ in range(2):
      deltas, state = opt.update(u, state, params)
      params = apply(params, deltas)
    return params, state

  params = _params(fmt, store)
  u = _proposals(params, 1)
  one, one_state = two_steps(params, opt.init(params), u)
  assert len(jax.devices()) == 8
  rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
  params, u = jax.device_put((params, u), rows)
  eight, eight_state = two_steps(params, opt.init(params), u)
  assert len(eight["dense"]["kernel"].sharding.device_set) == 8
  _assert_bits_equal(eight, one)
  assert_telemetry_equal(
    lowprec.telemetry(eight_state), lowprec.telemetry(one_state)
  )


# ---- telemetry -------------------------------------------------------------


def _telemetry_data(fmt, rng, n=3000):
  """w on the grid and u: random, ties, powers of two, saturation, zeros."""
  f = lowprec.get_format(fmt)
  pos = _grid(f)
  w = _sample_grid(f, n, rng)
  up, down = _gaps(w, pos)
  up = np.where(np.isinf(up), pos[-1] - pos[-2], up)
  down = np.where(np.isinf(down), pos[-1] - pos[-2], down)
  frac = rng.uniform(-3, 3, n)
  u = np.where(frac > 0, frac * up, frac * down)
  tie = rng.random(n) < 0.2  # exactly half a gap, either way
  side = rng.random(n) < 0.5
  u = np.where(tie & side, up / 2, np.where(tie, -down / 2, u))
  # Powers of two: below them the binade is finer.
  k, ku = np.zeros(0), np.zeros(0)
  if f.is_float:
    p2 = pos[pos >= 2.0**-100]
    p2 = p2[np.log2(p2) == np.round(np.log2(p2))][1:-1]
    k = rng.choice(p2, 400) * rng.choice([-1, 1], 400)
    gu, gd = _gaps(k, pos)
    c = rng.choice([0.49, 0.5, 0.51, 0.75, 1.0], 400)
    toward = rng.random(400) < 0.5  # toward zero: the finer gap
    ku = np.where(
      toward,
      -np.sign(k) * c * np.where(k > 0, gd, gu),
      np.sign(k) * c * np.where(k > 0, gu, gd),
    )
  # Saturation: from the top values, push past the largest finite one.
  top = pos[-4:]
  s = rng.choice(top, 200) * rng.choice([-1, 1], 200)
  su = (
    np.sign(s)
    * rng.choice([0.3, 0.5, 0.6, 3.0, 1e3], 200)
    * (pos[-1] - pos[-2])
  )
  w = np.concatenate([w, k, s])
  u = np.concatenate([u, ku, su])
  u[rng.random(len(u)) < 0.05] = 0.0
  return w.astype(np.float32), u.astype(np.float32)


@pytest.mark.parametrize(
  "fmt",
  ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "e8m3", INT3],
  ids=str,
)
def test_telemetry_equals_numpy_recount(fmt):
  rng = np.random.default_rng(3)
  w, u = _telemetry_data(fmt, rng)
  # The oracle agrees with ml_dtypes' cast where there is one.
  x = w + u  # float32, as the transform adds
  q, over = _rn(x, _grid(fmt))
  f = lowprec.get_format(fmt)
  if f.native_dtype is not None:
    with np.errstate(over="ignore", invalid="ignore"):
      cast = x.astype(f.native_dtype).astype(np.float64)
    fin = np.isfinite(cast)
    np.testing.assert_array_equal(q[fin], cast[fin])
    assert np.array_equal(over, ~np.isfinite(cast))
  assert over.sum() > 20 and (np.abs(u) == 0).sum() > 20
  n = len(w) // 2
  params = {"a": jnp.asarray(w[:n]), "b": {"c": jnp.asarray(w[n:])}}
  props = {"a": jnp.asarray(u[:n]), "b": {"c": jnp.asarray(u[n:])}}
  opt = lowprec.writeback(fmt)
  deltas, state = jax.jit(opt.update)(props, opt.init(params), params)
  tel = lowprec.telemetry(state)
  got = np.concatenate(_f32(optax.apply_updates(params, deltas)))
  # Proposals past the float32 range arrive as inf: non-finite, so kept
  # (the default nonfinite="keep") and never counted as proposals.
  proposed = (u != 0) & np.isfinite(u)
  np.testing.assert_array_equal(got, np.where(proposed, q, w))
  moved = proposed & (q != w)
  for name, part in (("a", slice(0, n)), ("b/c", slice(n, None))):
    want = {
      "proposals": proposed[part].sum(),
      "moved": moved[part].sum(),
      "erased": (proposed & ~moved)[part].sum(),
      "saturated": (proposed & over)[part].sum(),
      "unreachable": 0,
      "nonfinite": (~np.isfinite(u))[part].sum(),
    }
    for key, value in want.items():
      assert tel[f"{key}/{name}"] == value, (key, name)
    frac = want["erased"] / want["proposals"]
    assert tel[f"erased_fraction/{name}"] == pytest.approx(frac, rel=1e-12)
  assert tel["proposals"] == proposed.sum()
  assert tel["erased"] == (proposed & ~moved).sum()
  assert tel["saturated"] == (proposed & over).sum()
  assert tel["erased_fraction"] == pytest.approx(
    (proposed & ~moved).sum() / proposed.sum(), rel=1e-12
  )
  # Ties went both ways: some erased, some moved.
  assert 0 < tel["erased"] < tel["proposals"]


@pytest.mark.parametrize("rounding", ["stochastic", "deadzone"])
def test_random_rounding_telemetry_equals_recount(rounding):
  rng = np.random.default_rng(4)
  w, u = _telemetry_data("float8_e4m3fn", rng)
  pos = _grid("float8_e4m3fn")
  opt = lowprec.writeback("float8_e4m3fn", rounding, key=KEY)
  params = {"w": jnp.asarray(w)}
  deltas, state = jax.jit(opt.update)(
    {"w": jnp.asarray(u)}, opt.init(params), params
  )
  got = np.asarray(optax.apply_updates(params, deltas)["w"])
  x = w + u
  _, lo, hi = _bracket(x, pos)
  _, over = _rn(x, pos)
  assert np.all(
    (got == np.copysign(lo, x))
    | (got == np.copysign(np.minimum(hi, pos[-1]), x))
    | (u == 0)
  )
  tel = lowprec.telemetry(state)
  proposed = u != 0
  moved = proposed & (got != w)
  assert tel["proposals"] == proposed.sum()
  assert tel["moved"] == moved.sum()
  assert tel["erased"] == (proposed & ~moved).sum()
  # An SR overflow is a draw; it happens only where |w + u| > max.
  assert 0 < tel["saturated"] <= (proposed & (np.abs(x) > pos[-1])).sum()
  assert (
    tel["saturated"]
    >= (proposed & over & (np.abs(x) > pos[-1] + (pos[-1] - pos[-2]))).sum()
  )


# ---- the rounding rules over many steps -------------------------------------


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_nearest_never_moves_on_a_sub_half_gap_proposal(fmt):
  """Every positive grid value below the top (bf16: a sample of 4096), a
  constant proposal of 0.499 gap up or down, 20 steps: never moves; 0.501
  gap moves at every step; the gap toward zero at a power of two is the
  finer one."""
  pos = _grid(fmt)
  pos = pos[(pos >= 2.0**-100) & (pos < pos[-1])]
  if len(pos) > 4096:
    pos = np.random.default_rng(5).choice(pos, 4096, replace=False)
  w = np.concatenate([pos, -pos]).astype(np.float32)
  up, down = _gaps(w, _grid(fmt))
  opt = lowprec.writeback(fmt)

  def run(u, steps=20):
    def body(carry, _):
      p, s = carry
      d, s = opt.update(u, s, p)
      p = optax.apply_updates(p, d)
      return (p, s), s.moved["w"]

    p = {"w": jnp.asarray(w)}
    (p, _), moved = jax.lax.scan(body, (p, opt.init(p)), None, length=steps)
    return p["w"], moved

  run = jax.jit(run, static_argnames="steps")
  for g in (up, -down):
    final, moved = run({"w": jnp.asarray(0.499 * g, jnp.float32)})
    np.testing.assert_array_equal(np.asarray(final), w)
    assert not np.asarray(moved).any()
    _, moved = run({"w": jnp.asarray(0.501 * g, jnp.float32)}, steps=1)
    assert int(moved[0]) == len(w)


def test_stochastic_mean_after_n_steps_is_w0_plus_n_u():
  """float8_e4m3fn, w0 = 0.875 and u = 0.0123 for n = 20 steps, crossing
  1.0 where the gap doubles (0.0625 -> 0.125). Eight seeds split from key
  0, 16384 coordinates each (131072 runs, sd of one run about 0.14):
  |mean - (w0 + n u)| < 5 standard errors (about 0.002, 0.8% of n u),
  while nearest rounding stays at 0.875, 0.246 away."""
  w0, u, n, coords = 0.875, 0.0123, 20, 16384
  params = {"w": jnp.full((coords,), w0, jnp.float32)}
  props = {"w": jnp.full((coords,), u, jnp.float32)}

  def final(rounding, key):
    opt = lowprec.writeback("float8_e4m3fn", rounding, key=key)

    def body(carry, _):
      p, s = carry
      d, s = opt.update(props, s, p)
      return (optax.apply_updates(p, d), s), None

    (p, _), _ = jax.lax.scan(body, (params, opt.init(params)), None, length=n)
    return p["w"]

  keys = jax.random.split(jax.random.key(0), 8)
  sr = np.asarray(jax.jit(jax.vmap(lambda k: final("stochastic", k)))(keys))
  target = np.float32(w0) + n * np.float32(u)
  se = sr.std() / np.sqrt(sr.size)
  assert abs(sr.mean() - target) < 5 * se, (sr.mean(), target, se)
  assert 5 * se < 0.0025
  rn = np.asarray(jax.jit(final, static_argnums=0)("nearest", keys[0]))
  assert np.all(rn == w0) and target - w0 > 0.2


def test_deadzone_is_nearest_wherever_nearest_moves():
  """Where nearest moves the weight, dead-zone lands on the same value;
  where nearest erases, dead-zone moves toward u with probability
  |u| / gap (seed 8, 20000 coordinates, 5 standard errors)."""
  fmt = "float8_e4m3fn"
  rng = np.random.default_rng(8)
  pos = _grid(fmt)
  w = _sample_grid(fmt, 20000, rng, lo=2.0**-6).astype(np.float32)
  w = w[np.abs(w) < pos[-2]]
  up, down = _gaps(w, pos)
  c = rng.uniform(-2, 2, len(w))
  u = np.where(c > 0, c * up, c * down).astype(np.float32)
  params = {"w": jnp.asarray(w)}
  opt = lowprec.writeback(fmt, "deadzone", key=KEY)
  d, _ = jax.jit(opt.update)({"w": jnp.asarray(u)}, opt.init(params), params)
  got = np.asarray(optax.apply_updates(params, d)["w"])
  rn, _ = _rn(w + u, pos)
  moves = rn != w
  assert moves.sum() > 1000
  np.testing.assert_array_equal(got[moves], rn[moves])
  erased = ~moves & (u != 0)
  p = np.abs(u[erased]) / np.where(u > 0, up, down)[erased]
  moved = (got != w)[erased]
  se = np.sqrt(np.sum(p * (1 - p))) / erased.sum()
  assert abs(moved.mean() - p.mean()) < 5 * se and moved.mean() > 0.1


def test_adamw_cosine_freezes_under_nearest_and_improves_under_stochastic():
  """Least squares in 64 unknowns, 256 rows, weights float32 on the
  bfloat16 grid, AdamW with cosine decay from 0.05 over 400 steps, seeds
  0 and 1. Nearest: the erased fraction rises to 1 and the loss stops
  changing; stochastic: the loss keeps falling after nearest froze."""
  kx, kw = jax.random.split(jax.random.key(0))
  xs = jax.random.normal(kx, (256, 64))
  ys = xs @ jax.random.normal(kw, (64,))
  steps = 400

  def loss(p):
    return jnp.mean((xs @ p["w"] - ys) ** 2)

  def train(rounding):
    opt = optax.chain(
      optax.adamw(optax.cosine_decay_schedule(0.05, steps), weight_decay=0),
      lowprec.writeback("bfloat16", rounding, key=jax.random.key(1)),
    )

    def body(carry, _):
      p, s = carry
      value, g = jax.value_and_grad(loss)(p)
      d, s = opt.update(g, s, p)
      tel = s[1]
      erased = tel.proposals["w"] - tel.moved["w"]
      frac = erased / jnp.maximum(tel.proposals["w"], 1)
      return (optax.apply_updates(p, d), s), (value, frac)

    p = lowprec.to_grid({"w": jnp.zeros(64)}, "bfloat16")
    scan = jax.jit(lambda c: jax.lax.scan(body, c, None, length=steps)[1])
    return [np.asarray(a) for a in scan((p, opt.init(p)))]

  rn_loss, rn_erased = train("nearest")
  sr_loss, _ = train("stochastic")
  frozen = int(np.argmax(rn_erased > 0.95))
  assert 0 < frozen < 0.8 * steps
  assert rn_erased[-100:].mean() > 0.99
  assert abs(rn_loss[-1] - rn_loss[frozen]) < 0.02 * rn_loss[frozen]
  assert sr_loss[-1] < 0.5 * sr_loss[frozen]
  assert sr_loss[-1] < 0.1 * rn_loss[-1]


# ---- exact landing at the edges ---------------------------------------------


@pytest.mark.parametrize(
  "fmt", ["bfloat16", "float16", "float8_e5m2", "e8m3", "e8m10"]
)
def test_unreachable_targets_take_the_neighbour_toward_w(fmt):
  """A power of two 2^k is out of reach of float32 addition from a weight
  of the other sign below about 2^(k - 22): w + d lands next to 2^k, never
  on it. The write-back lands one grid step toward w there, counts it, and
  is exact everywhere else (checked by trying every float32 delta near
  q - w)."""
  rng = np.random.default_rng(9)
  pos = _grid(fmt)
  p2 = pos[pos >= 2.0**-100]
  p2 = p2[np.log2(p2) == np.round(np.log2(p2))]
  q_target = rng.choice(p2[p2 > 2.0**-80], 3000) * rng.choice([-1, 1], 3000)
  w = -np.sign(q_target) * rng.choice(pos[pos >= 2.0**-100], 3000)
  w = w.astype(np.float32)
  u = (q_target - w).astype(np.float32)
  x = w + u
  q, _ = _rn(x, pos)
  q = q.astype(np.float32)
  # Oracle of reachability: some float32 delta within 3 steps of q - w.
  d0 = (q - w).astype(np.float32)
  cands = [d0]
  for direction in (np.inf, -np.inf):
    d = d0
    for _ in range(3):
      d = np.nextafter(d, np.float32(direction))
      cands.append(d)
  reach = np.any([(w + d) == q for d in cands], axis=0)
  assert 0 < (~reach).sum() < len(w)
  params = {"w": jnp.asarray(w)}
  opt = lowprec.writeback(fmt)
  d, state = jax.jit(opt.update)(
    {"w": jnp.asarray(u)}, opt.init(params), params
  )
  got = np.asarray(optax.apply_updates(params, d)["w"])
  np.testing.assert_array_equal(got[reach], q[reach])
  below = np.copysign(
    pos[np.searchsorted(pos, np.abs(q[~reach])) - 1], q[~reach]
  )
  np.testing.assert_array_equal(got[~reach], below)
  assert lowprec.telemetry(state)["unreachable"] == (~reach).sum()


def test_zero_proposals_keep_every_bit_and_zeros_land_as_plus_zero():
  w = jnp.array([0.0, -0.0, 1.0, -1.0, 0.5], jnp.float32)
  u = jnp.array([0.0, 0.0, -1.0, 1.0, 0.0], jnp.float32)
  opt = lowprec.writeback("bfloat16")
  d, _ = jax.jit(opt.update)({"w": u}, opt.init({"w": w}), {"w": w})
  got = np.asarray(optax.apply_updates({"w": w}, d)["w"])
  np.testing.assert_array_equal(
    got.view(np.uint32), np.float32([0, -0.0, 0, 0, 0.5]).view(np.uint32)
  )


# ---- no master weights, and errors -------------------------------------------


def test_adamw_chain_state_holds_moments_but_no_copy_of_params():
  params = _params("float8_e4m3fn", "float32")
  opt = optax.chain(optax.adamw(1e-2), lowprec.writeback("float8_e4m3fn"))
  state = opt.init(params)
  updates, state = jax.jit(opt.update)(_proposals(params, 0), state, params)
  new = optax.apply_updates(params, updates)
  shapes = [p.shape for p in jax.tree.leaves(params)]
  big = [x for x in jax.tree.leaves(state) if x.ndim and x.size > 2]
  # Exactly AdamW's two moments per parameter, and none is the parameter.
  assert sorted(x.shape for x in big) == sorted(shapes * 2)
  for x in big:
    for p in jax.tree.leaves(new) + jax.tree.leaves(params):
      assert x.shape != p.shape or not np.array_equal(x, p)
  assert all(x.shape in ((), (2,)) for x in jax.tree.leaves(state[1]))


def test_errors_name_the_fix():
  with pytest.raises(ValueError, match=r"needs a PRNG key: pass key="):
    lowprec.writeback("bfloat16", "stochastic")
  with pytest.raises(ValueError, match="valid: nearest, stochastic, deadzone"):
    lowprec.writeback("bfloat16", "sr")
  with pytest.raises(ValueError, match="valid: saturate, ieee"):
    lowprec.writeback("bfloat16", overflow="clip")
  with pytest.raises(ValueError, match="Did you mean 'float8_e4m3fn'"):
    lowprec.writeback("float8_e4m3f")
  opt = lowprec.writeback("bfloat16")
  params = {"w": jnp.array([0.5, 0.1])}
  with pytest.raises(ValueError, match=r"'w': 1 of 2 .*lowprec.to_grid"):
    opt.init(params)
  state = opt.init(lowprec.to_grid(params, "bfloat16"))
  with pytest.raises(ValueError, match="needs the current params"):
    opt.update(params, state)
  with pytest.raises(ValueError, match="stored as bfloat16"):
    lowprec.writeback("float8_e4m3fn").init({"w": jnp.zeros(2, jnp.bfloat16)})
  int3 = lowprec.get_format("int3", scale=0.1)
  with pytest.raises(ValueError, match=r"power-of-two scale.*scale=0.125"):
    lowprec.writeback(int3).init({"w": jnp.zeros(2)})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_update_shaped_unlike_its_parameter_names_leaf_and_shapes(jit):
  params = {"a": {"w": jnp.zeros((2, 3))}, "b": jnp.zeros(4)}
  opt = lowprec.writeback("bfloat16", "stochastic", key=jax.random.key(0))
  update = jax.jit(opt.update) if jit else opt.update
  state = opt.init(params)
  bad = {"a": {"w": jnp.zeros((3, 2))}, "b": jnp.zeros(4)}
  with pytest.raises(ValueError, match=r"'a/w' has shape \(3, 2\), the "):
    update(bad, state, params)
  with pytest.raises(ValueError, match=r"'b' has shape \(\), the param"):
    update({"a": {"w": jnp.zeros((2, 3))}, "b": jnp.float32(0)}, state, params)


def test_none_updates_and_leaves_that_are_not_arrays_pass_through():
  # An unfiltered Equinox-like tree: a function, a float, an int array.
  params = {
    "w": lowprec.to_grid(jnp.linspace(-1, 1, 8), "bfloat16"),
    "act": jax.nn.relu,
    "eps": 1e-6,
    "idx": jnp.arange(3),
  }
  rules = [("idx", None), (".*", "bfloat16")]
  opt = lowprec.writeback(rules, "stochastic", key=jax.random.key(0))
  state = opt.init(params)
  assert list(state.moved) == ["w"]  # the one parameter
  updates = {"w": jnp.full(8, 0.3), "act": None, "eps": None, "idx": None}
  deltas, state = opt.update(updates, state, params)
  assert deltas["act"] is None and deltas["eps"] is None
  assert deltas["idx"] is None
  new = lowprec.apply_updates(params, deltas)
  assert new["act"] is params["act"] and new["eps"] == 1e-6
  lowprec.check_on_grid(new, rules)
  assert lowprec.telemetry(state)["moved"] > 0
  # An int array that meets a format is refused at init, naming it.
  with pytest.raises(ValueError, match="'idx' holds int32 values"):
    lowprec.writeback("bfloat16").init(params)


def test_telemetry_off_keeps_only_the_step_count():
  opt = lowprec.writeback("bfloat16", telemetry=False)
  params = {"w": jnp.zeros(3)}
  _, state = jax.jit(opt.update)(params, opt.init(params), params)
  assert lowprec.telemetry(state) == {"steps": 1}


def test_telemetry_finds_the_state_inside_a_chain():
  params = {"w": jnp.array([1.0, 2.0])}
  opt = optax.chain(optax.sgd(1.0), lowprec.writeback("float8_e4m3fn"))
  grads = {"w": jnp.array([0.01, -1.0])}
  _, state = jax.jit(opt.update)(grads, opt.init(params), params)
  assert lowprec.telemetry(state) == {
    "steps": 1,
    "proposals": 2,
    "erased": 1,
    "moved": 1,
    "saturated": 0,
    "unreachable": 0,
    "nonfinite": 0,
    "erased_fraction": 0.5,
    "proposals/w": 2,
    "erased/w": 1,
    "moved/w": 1,
    "saturated/w": 0,
    "unreachable/w": 0,
    "nonfinite/w": 0,
    "erased_fraction/w": 0.5,
  }
  assert isinstance(state[1], lowprec.WritebackState)


@pytest.mark.parametrize("fmt", ["bfloat16", "float8_e4m3fn", "mxfp8_e4m3"])
def test_a_writeback_placed_first_is_refused_by_its_telemetry(fmt):
  # optax.chain(writeback, adam): adam's update lands after the rounding,
  # so the params leave the grid. The next update counts them (an
  # oracle: the values the format's ml_dtypes cast or the MX numpy
  # quantizer does not give back), and reading the telemetry raises,
  # naming the order that works; in the right order nothing is counted.
  from tests.scaled_test import _reference_mx

  w = jax.random.normal(jax.random.key(0), (32, 64))
  params = lowprec.to_grid({"w": w}, fmt)

  def run(first):
    wb = lowprec.writeback(fmt)
    adam = optax.adam(1e-2)
    tx = optax.chain(wb, adam) if first else optax.chain(adam, wb)
    state, p = tx.init(params), params
    update = jax.jit(tx.update)
    for t in range(3):
      before = p
      g = jax.tree.map(lambda x, t=t: 0.1 * x + 0.01 * (t + 1), p)
      updates, state = update(g, state, p)
      p = optax.apply_updates(p, updates)
    return before, state

  before, state = run(first=True)
  x = np.asarray(before["w"], np.float32)
  if fmt.startswith("mx"):
    back = _reference_mx(x, lowprec.get_scaled_format(fmt))[0]
  else:
    back = x.astype(getattr(ml_dtypes, fmt)).astype(np.float32)
  off = int(np.sum(back != x))
  assert off > 1900  # nearly all of the 2048
  assert int(state[0].offgrid["w"]) == off
  with pytest.raises(ValueError, match=rf"met {off} values of parameter 'w'"):
    lowprec.telemetry(state)
  with pytest.raises(ValueError, match=r"chain\(optax.adam\(1e-3\), lowpre"):
    lowprec.telemetry(state)
  arrays = jax.jit(lowprec.telemetry_arrays)(state)  # traceable: no check
  assert "offgrid" not in arrays
  _, good = run(first=False)
  assert int(good[1].offgrid["w"]) == 0 and lowprec.telemetry(good)["moved"]


def test_an_eager_update_on_params_off_the_grid_raises_at_once():
  params = {"w": jnp.asarray([1.0, 2.0, 3.0])}
  tx = lowprec.writeback("bfloat16")
  state = tx.init(params)
  params = {"w": params["w"] + 1e-3}  # changed behind the write-back's back
  with pytest.raises(ValueError, match="met 3 values of parameter 'w'"):
    tx.update({"w": jnp.zeros(3)}, state, params)
  off = lowprec.writeback("bfloat16", telemetry=False)  # no counts, no check
  off.update({"w": jnp.zeros(3)}, off.init({"w": jnp.ones(3)}), params)


@pytest.mark.parametrize("storage", ["native", "float32"])
def test_float8_params_warn_at_init_naming_lowprec_apply_updates(storage):
  # optax.apply_updates cannot add float32 deltas to float8 params, and
  # JAX's error does not say what to use: the write-back's init does.
  import warnings

  params = lowprec.to_grid(
    {"a": jnp.ones((4,)), "b": jnp.ones((2,))}, "float8_e4m3fn", storage=storage
  )
  tx = optax.chain(
    lowprec.in_float32(optax.sgd(0.1)), lowprec.writeback("float8_e4m3fn")
  )
  if storage == "float32":
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      tx.init(params)
    return
  with pytest.warns(
    lowprec.engine.weights.Float8ParamsWarning,
    match=r"'a' and 1 more stored as float8_e4m3fn.*lowprec.apply_updates",
  ):
    state = tx.init(params)
  grads = {"a": jnp.ones((4,)), "b": jnp.ones((2,))}
  updates, _ = tx.update(grads, state, params)
  with pytest.raises(jax.dtypes.TypePromotionError):
    optax.apply_updates(params, updates)
  new = lowprec.apply_updates(params, updates)
  assert new["a"].dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(new["a"], np.float32), 0.875)


# ---- non-finite proposals ----------------------------------------------------


def _nonfinite_run(mode, fmt="bfloat16", steps=6, bad_step=3):
  """SGD on a toy problem whose gradient has NaN and inf at one step."""
  w0 = lowprec.to_grid({"w": jnp.linspace(-1.0, 1.0, 12)}, fmt)
  opt = optax.chain(optax.sgd(0.1), lowprec.writeback(fmt, nonfinite=mode))
  state = opt.init(w0)
  update = jax.jit(opt.update)
  params, history = w0, []
  for t in range(steps):
    g = np.asarray(params["w"], np.float32) - 0.3
    if t == bad_step:
      g = g.copy()
      g[[1, 4]] = np.nan
      g[[7]] = np.inf
      g[[9]] = -np.inf
    before = np.asarray(params["w"], np.float32)
    updates, state = update({"w": jnp.asarray(g)}, state, params)
    params = optax.apply_updates(params, updates)
    history.append(
      (before, g, np.asarray(params["w"]), lowprec.telemetry(state))
    )
  return history


def test_nonfinite_proposals_are_counted_and_kept_by_default():
  for before, g, after, tel in _nonfinite_run("keep"):
    u = np.float32(-0.1) * g
    bad = ~np.isfinite(u)
    assert tel["nonfinite"] == bad.sum()
    # Kept, bit for bit, and never counted as proposals or moves.
    np.testing.assert_array_equal(after[bad], before[bad])
    prop = (u != 0) & ~bad
    assert tel["proposals"] == prop.sum()
    assert tel["moved"] == (prop & (after != before)).sum()
    want = (before + u).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(after[prop], want[prop])
    assert np.all(np.isfinite(after))
  assert sum(h[3]["nonfinite"] for h in _nonfinite_run("keep")) == 4


def test_nonfinite_proposals_propagate_when_asked():
  history = _nonfinite_run("propagate")
  before, g, after, tel = history[3]
  assert tel["nonfinite"] == 4 and tel["moved"] <= tel["proposals"]
  assert np.isnan(after[[1, 4]]).all()
  top = float(lowprec.get_format("bfloat16").max_finite)
  # sgd: u = -0.1 g, so +inf gradient -> -inf proposal -> saturates to -max.
  assert after[7] == -top and after[9] == top
  # NaN weights stay NaN, counted as non-finite, and never "move".
  _, _, after_next, tel_next = history[4]
  assert np.isnan(after_next[[1, 4]]).all()
  assert tel_next["nonfinite"] == 2
  with pytest.raises(ValueError, match=r"'w': 2 NaN of 12.*non-finite"):
    lowprec.check_on_grid({"w": jnp.asarray(after_next)}, "bfloat16")


def test_check_on_grid_names_infinities_a_format_lacks():
  w = jnp.array([1.0, jnp.inf, 0.1])
  with pytest.raises(ValueError, match=r"1 infinite \(float8_e4m3fn has no"):
    lowprec.check_on_grid({"w": w}, "float8_e4m3fn")
  # e5m2 has inf: only the off-grid 0.1 is reported, as off the grid.
  with pytest.raises(ValueError, match=r"1 of 3 values off the float8_e5m2"):
    lowprec.check_on_grid({"w": w}, "float8_e5m2")


def test_zero_size_leaves_tuple_rules_and_bad_keys():
  params = {"empty": jnp.zeros((0, 4)), "w": jnp.ones(3)}
  lowprec.check_on_grid(params, "bfloat16")
  opt = lowprec.writeback("bfloat16", "stochastic", key=jax.random.key(0))
  state = opt.init(params)
  updates, state = jax.jit(opt.update)(
    {"empty": jnp.zeros((0, 4)), "w": jnp.full(3, 0.5)}, state, params
  )
  assert updates["empty"].shape == (0, 4)
  tel = lowprec.telemetry(state)
  assert tel["proposals/empty"] == 0 and tel["moved/w"] == 3
  rules = ((r".*empty", None), (r".*", "float8_e4m3fn"))
  got = lowprec.to_grid({"empty": jnp.zeros(2), "w": jnp.array([0.1])}, rules)
  assert float(got["w"][0]) == 0.1015625 and float(got["empty"][0]) == 0.0
  assert list(lowprec.writeback(rules).init(params).moved) == ["w"]
  for bad in (None, "0", 3):
    with pytest.raises(TypeError, match=r"jax.random.key\(seed\)"):
      lowprec.round_stochastic(jnp.ones(2), "bfloat16", bad)
  with pytest.raises(TypeError, match=r"jax.random.key\(seed\)"):
    lowprec.writeback("bfloat16", "stochastic", key="0")


def test_version_and_typed_marker():
  import importlib.metadata
  import pathlib

  assert lowprec.__version__ == importlib.metadata.version("lowprec")
  assert (pathlib.Path(lowprec.__file__).parent / "py.typed").exists()

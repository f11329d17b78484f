"""Optimizer state stored in low precision, against independent oracles.

Expected stored values come from ml_dtypes casts and numpy; nothing below
uses lowprec's rounding to compute one. A "holder" transform whose new
state is the incoming update drives the storage with chosen values.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lowprec
from tests.telemetry_test import assert_telemetry_equal

KEY = jax.random.key(5)
NATIVE = {
  "bfloat16": ml_dtypes.bfloat16,
  "float16": np.float16,
  "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
  "float8_e5m2": ml_dtypes.float8_e5m2,
  "float8_e3m4": ml_dtypes.float8_e3m4,
}

SLOW = ("float16", "float8_e5m2", "float8_e3m4")  # default: bf16, e4m3fn


class HolderState(NamedTuple):
  s: dict  # float32, shaped like the params: the last update seen.


def holder() -> optax.GradientTransformation:
  """A transform whose new state is its input, and whose output is zero."""

  def init(params):
    return HolderState(jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, updates), HolderState(updates)

  return optax.GradientTransformation(init, update)


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _values(fmt, rng, n=20000):
  """float32 inputs: every code and every tie between neighbours (8-bit
  formats), a sample of them (16-bit), random magnitudes over the whole
  range, beyond the maximum, and zeros."""
  dt = NATIVE[fmt]
  width = np.dtype(dt).itemsize
  codes = np.arange(1 << (8 * width), dtype=np.uint8 if width == 1 else "u2")
  if width == 2:
    codes = rng.choice(codes, 8192, replace=False)
  with np.errstate(invalid="ignore", over="ignore"):
    grid = np.sort(codes.view(dt).astype(np.float64))
  grid = np.unique(grid[np.isfinite(grid)])
  ties = (grid[:-1] + grid[1:]) / 2
  top = float(ml_dtypes.finfo(dt).max)
  rand = np.exp(rng.uniform(np.log(1e-9), np.log(2 * top), n))
  beyond = top * rng.uniform(1, 3, 200)
  x = np.concatenate([grid, ties, rand, beyond, np.zeros(10)])
  x = x * rng.choice([-1.0, 1.0], len(x))
  return x.astype(np.float32)


def _stored(spec, x, overflow="saturate", key=None):
  """The stored leaf after one update that proposes the state `x`."""
  tx = lowprec.store_state(holder(), {"s": spec}, overflow=overflow, key=key)
  params = {"w": jnp.zeros(x.shape, jnp.float32)}
  _, state = jax.jit(tx.update)({"w": jnp.asarray(x)}, tx.init(params))
  return state


@pytest.mark.parametrize(
  "fmt",
  [
    pytest.param(f, marks=pytest.mark.slow if f in SLOW else (), id=f)
    for f in NATIVE
  ],
)
def test_nearest_state_rounding_equals_the_ml_dtypes_cast(fmt):
  x = _values(fmt, np.random.default_rng(0))
  dt = NATIVE[fmt]
  with np.errstate(over="ignore", invalid="ignore"):
    cast = x.astype(dt)
  got = _stored(fmt, x, overflow="ieee").inner.s["w"]
  assert got.dtype == np.dtype(dt)
  np.testing.assert_array_equal(_bits(got), _bits(cast))
  # Saturating: the cast wherever it is finite, +-max elsewhere.
  got = np.asarray(_stored(fmt, x).inner.s["w"])
  fin = np.isfinite(cast.astype(np.float32))
  assert (~fin).sum() >= 200
  np.testing.assert_array_equal(_bits(got[fin]), _bits(cast[fin]))
  top = float(ml_dtypes.finfo(dt).max)
  np.testing.assert_array_equal(
    got[~fin].astype(np.float32), np.copysign(top, x[~fin])
  )


def _pow2_scale(amax, top):
  """Smallest power of two p with amax / p <= top, in float64 (1 for 0)."""
  amax = np.asarray(amax, np.float64)
  p = 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, top) / top))
  p = np.where(amax > top * p, 2 * p, p)
  p = np.where(amax <= top * p / 2, p / 2, p)
  return np.where(amax > 0, p, 1.0)


@pytest.mark.parametrize(
  "scale",
  [
    pytest.param("tensor", marks=pytest.mark.slow, id="tensor"),
    pytest.param(128, id="block128"),
  ],
)
def test_scaled_state_is_the_cast_of_value_over_a_power_of_two(scale):
  rng = np.random.default_rng(1)
  # Rows of very different magnitudes; 300 columns: blocks 128, 128, 44.
  x = rng.standard_normal((6, 300)) * 10.0 ** rng.uniform(-8, 3, (6, 1))
  x = x.astype(np.float32)
  x[0, :128] = 0.0  # a block of zeros keeps scale 1
  spec = lowprec.StateFormat("float8_e4m3fn", "nearest", scale)
  state = _stored(spec, x)
  top = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  if scale == "tensor":
    p = _pow2_scale(np.abs(x).max(), top) * np.ones_like(x)
  else:
    pad = np.pad(np.abs(x), [(0, 0), (0, 84)]).reshape(6, 3, 128)
    per_block = _pow2_scale(pad.max(-1), top)
    p = np.repeat(per_block, 128, axis=-1)[:, :300]
    assert per_block[0, 0] == 1.0
    np.testing.assert_array_equal(state.scales["s/w"], per_block)
  code = (x / p).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
  got = state.inner.s["w"]
  np.testing.assert_array_equal(_bits(got), _bits(code))
  counts = lowprec.telemetry(state)
  assert counts["state/saturated"] == 0 and counts["state/changed"] > 1000
  if scale == 128:  # per block, the small rows do not flush to zero
    flat = lowprec.telemetry(_stored("float8_e4m3fn", x))
    assert flat["state/flushed"] > 500 and counts["state/flushed"] < 50


@pytest.mark.parametrize("block", [32, 128])
def test_block_scales_have_one_entry_per_block(block):
  """For every length of the last axis around multiples of the block
  (1 to 3 blocks, exact multiples included): ceil(n / block) scales per
  row, each the power of two of its block's largest value."""
  rng = np.random.default_rng(8)
  top = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  spec = lowprec.StateFormat("float8_e4m3fn", "nearest", block)
  for n in (1, block - 1, block, block + 1, 2 * block, 3 * block - 5):
    x = rng.standard_normal((3, n)) * 10.0 ** rng.uniform(-3, 3, (3, 1))
    x = x.astype(np.float32)
    got = np.asarray(_stored(spec, x).scales["s/w"])
    blocks = -(-n // block)
    assert got.shape == (3, blocks), n
    pad = np.pad(np.abs(x), [(0, 0), (0, blocks * block - n)])
    want = _pow2_scale(pad.reshape(3, blocks, block).max(-1), top)
    np.testing.assert_array_equal(got, want, err_msg=str(n))


def test_deadzone_is_nearest_wherever_nearest_moves_the_stored_value():
  """bfloat16, old values on the grid, new ones a fraction of a gap away
  (seed 9, 8000 values). Where nearest rounding changes the stored value,
  dead-zone stores exactly the nearest value; where nearest gives back
  the old value although the value changed, it stores one of the two
  neighbours, the far one with probability f, the fraction of the gap
  moved (0.1, 0.3 or 0.45: 0.28 on average, sd 0.01 over about 1900
  such values)."""
  rng = np.random.default_rng(9)
  n = 8000
  bf = ml_dtypes.bfloat16
  s_old = (rng.standard_normal(n) * 4).astype(bf).astype(np.float32)
  gap = np.abs(s_old) * 2.0**-7
  rel = rng.choice([0.0, 0.1, 0.3, 0.45, 0.55, 0.8, 1.3, 2.7], n)
  s_new = (s_old + rel * gap * rng.choice([-1, 1], n)).astype(np.float32)
  tx = lowprec.store_state(holder(), {"s": "bfloat16:deadzone"}, key=KEY)
  params = {"w": jnp.zeros(n)}
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.asarray(s_old)}, tx.init(params))
  np.testing.assert_array_equal(
    np.asarray(state.inner.s["w"], np.float32), s_old
  )
  _, state = update({"w": jnp.asarray(s_new)}, state)
  got = np.asarray(state.inner.s["w"], np.float32)
  nearest = s_new.astype(bf).astype(np.float32)
  moves = nearest != s_old
  assert moves.sum() > 2000
  np.testing.assert_array_equal(got[moves], nearest[moves])
  lost = ~moves & (s_new != s_old)
  assert lost.sum() > 1500
  # One of the two neighbours of s_new: within a gap, on the grid.
  assert np.all(np.abs(got[lost] - s_new[lost]) < gap[lost] * 2)
  np.testing.assert_array_equal(got.astype(bf).astype(np.float32), got)
  assert 0.24 < (got[lost] != s_old[lost]).mean() < 0.32
  np.testing.assert_array_equal(got[s_new == s_old], s_old[s_new == s_old])


def test_stochastic_bits_are_derived_as_the_write_back_derives_them():
  # Oracle: the derivation spelled out (split the state's key, fold in the
  # CRC32 of the state path, hash the element index), then SR with those
  # bits, which rounds up iff bits < the fixed-point fraction.
  import zlib

  x = np.random.default_rng(6).standard_normal(1000).astype(np.float32)
  state = _stored("bfloat16:stochastic", x, key=KEY)
  step_key = jax.random.split(KEY)[1]
  seed = zlib.crc32(b"s/w") & 0x7FFFFFFF
  bits = lowprec.grids.rng.random_bits(
    jax.random.fold_in(step_key, seed), x.shape
  )
  want = lowprec.grids.rounding.round_with_bits(
    jnp.asarray(x), "bfloat16", bits
  )
  got = np.asarray(state.inner.s["w"], np.float32)
  np.testing.assert_array_equal(got, np.asarray(want))
  # And the draws are SR's: every value is one of its two neighbours.
  lo = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  assert np.all(np.abs(got - x) < 2 * np.abs(x) * 2.0**-8)
  # SR differs from nearest with probability min(f, 1 - f), f the
  # position between neighbours: 1/4 on average (1000 draws, sd 0.014).
  assert 0.2 < (got != lo).mean() < 0.3


def test_int8_with_block_scales_is_the_rounded_multiple_of_a_power_of_two():
  x = np.random.default_rng(7).standard_normal((4, 256)).astype(np.float32)
  state = _stored("int8:nearest:block128", x)
  p = np.repeat(_pow2_scale(np.abs(x).reshape(4, 2, 128).max(-1), 127), 128, -1)
  got = np.asarray(state.inner.s["w"])
  assert got.dtype == np.float32  # no native dtype: float32 on the grid
  np.testing.assert_array_equal(got, np.round(x / p).astype(np.float32))


def _recount(s_old, s_new, dt):
  """Telemetry of storing s_new after s_old, from ml_dtypes casts."""
  with np.errstate(over="ignore", invalid="ignore"):
    old = s_old.astype(dt).astype(np.float32)
    cast = s_new.astype(dt).astype(np.float32)
  top = float(ml_dtypes.finfo(dt).max)
  finite = np.isfinite(s_new)
  over = finite & ~np.isfinite(cast)
  v = np.where(over, np.copysign(top, s_new), cast)
  changed = finite & (s_new != old)
  return {
    "changed": changed.sum(),
    "erased": (changed & (v == old)).sum(),
    "flushed": (finite & (s_new != 0) & (v == 0)).sum(),
    "saturated": over.sum(),
    "nonfinite": (~finite).sum(),
  }


@pytest.mark.parametrize("fmt", ["bfloat16", "float8_e4m3fn"])
def test_telemetry_equals_a_numpy_recount(fmt):
  rng = np.random.default_rng(2)
  dt = NATIVE[fmt]
  top = float(ml_dtypes.finfo(dt).max)
  n = 4000
  s_old = (rng.standard_normal(n) * 4).astype(dt).astype(np.float32)
  gap = np.abs(s_old) * 2.0 ** -ml_dtypes.finfo(dt).nmant
  rel = rng.choice([0.0, 0.1, 0.3, 0.49, 0.51, 1.0, 3.0], n)
  s_new = (s_old + rel * gap * rng.choice([-1, 1], n)).astype(np.float32)
  # Flushed: under half the smallest value. Below bfloat16's lie only
  # float32 subnormals, which XLA on CPU flushes in arithmetic already:
  # there, small normals that bfloat16 holds.
  tiny = float(ml_dtypes.finfo(dt).smallest_subnormal)
  tiny = tiny if tiny > 2.0**-100 else 2.0**-110
  s_new[:200] = tiny * rng.uniform(0.01, 0.49, 200)
  s_new[200:300] = top * rng.uniform(1.01, 2, 100)  # saturated
  s_new[300:310] = [np.nan, np.inf, -np.inf] * 3 + [np.nan]
  tx = lowprec.store_state(holder(), [("s/.*", fmt)])
  half = n // 2
  params = {"a": jnp.zeros(half), "b": jnp.zeros(n - half)}

  def split(v):
    return {"a": jnp.asarray(v[:half]), "b": jnp.asarray(v[half:])}

  update = jax.jit(tx.update)
  _, state = update(split(s_old), tx.init(params))
  _, state = update(split(s_new), state)
  tel = lowprec.telemetry(state)
  for name, part in (("a", slice(0, half)), ("b", slice(half, None))):
    want = _recount(s_old[part], s_new[part], dt)
    for k, v in want.items():
      assert tel[f"state/{k}/s/{name}"] == v, (k, name)
    assert tel[f"state/erased_fraction/s/{name}"] == pytest.approx(
      want["erased"] / want["changed"], rel=1e-12
    )
  total = _recount(s_old, s_new, dt)
  for k, v in total.items():
    assert tel[f"state/{k}"] == v, k
  assert 0 < total["erased"] < total["changed"]
  assert total["flushed"] >= (200 if fmt != "bfloat16" else 0)
  arrays = jax.jit(lowprec.telemetry_arrays)(state)
  assert set(arrays) == set(tel)
  assert int(arrays["state/erased"]) == total["erased"]
  assert arrays["state/erased_fraction"].dtype == jnp.float32


def test_ema_of_a_constant_stalls_under_nearest_and_tracks_under_sr():
  """Adam's second moment of a constant gradient g = 1, b2 = 0.999, stored
  in bfloat16, 3000 steps, 4096 coordinates, state seed 0. The float32
  EMA reaches 1 - 0.999^3000 = 0.950. Nearest stalls where the update is
  under half a gap (below 0.6); stochastic rounding's mean over the 4096
  coordinates is within 5 standard errors of it (the spread of one
  coordinate is about 0.02, so 5 se is about 0.002)."""
  steps, n = 3000, 4096
  params = {"w": jnp.zeros(n)}
  grads = {"w": jnp.ones(n)}

  def final_nu(spec):
    inner = optax.scale_by_adam(b1=0.9, b2=0.999)
    tx = (
      inner
      if spec is None
      else lowprec.store_state(inner, {"nu": spec}, key=jax.random.key(0))
    )

    def body(state, _):
      return tx.update(grads, state, params)[1], None

    state, _ = jax.lax.scan(body, tx.init(params), None, length=steps)
    inner_state = state if spec is None else state.inner
    return inner_state.nu["w"], state

  def run(spec):
    nu, state = jax.jit(final_nu, static_argnums=0)(spec)
    return np.asarray(nu, np.float64), state

  ref, _ = run(None)
  want = 1 - 0.999**steps
  np.testing.assert_allclose(ref, want, rtol=1e-4)
  rn, rn_state = run("bfloat16")
  assert np.all(rn == rn[0]) and rn[0] < 0.6 * want
  tel = lowprec.telemetry(rn_state)
  assert tel["state/erased_fraction/nu/w"] == 1.0  # stalled: all erased
  sr, sr_state = run("bfloat16:stochastic")
  assert sr_state.inner.nu["w"].dtype == jnp.bfloat16
  se = sr.std() / np.sqrt(n)
  assert abs(sr.mean() - want) < 5 * se and 5 * se < 0.003, (sr.mean(), se)
  # Near the end an update moves the stored value with probability about
  # 5e-5 / 2^-8 (1.3%): SR erases most updates too, but not in the mean.
  assert 0.9 < lowprec.telemetry(sr_state)["state/erased_fraction"] < 1.0


# ---- optax transforms, wrappers and training libraries ---------------------


def _transforms():
  """name -> (transform, rules); each rule stores every moment in bf16."""
  adam = optax.adam(1e-2)
  inject = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  bf = "bfloat16"
  return {
    "adam": (adam, {"mu": bf, "nu": bf}),
    "adamw": (optax.adamw(1e-2), {"mu": bf, "nu": bf}),
    "lion": (optax.lion(1e-3), {"mu": bf}),
    "adafactor": (optax.adafactor(1e-2), {"v_row|v_col|v": bf}),
    "muon": (optax.contrib.muon(1e-2), {"mu": bf}),
    "momentum": (optax.sgd(1e-2, momentum=0.9), {"trace": bf}),
    "inject_hyperparams": (inject, {"inner_state/0/(mu|nu)": bf}),
  }


# In the default run: adam, adafactor and inject_hyperparams(adam).
SLOW_TX = ("adamw", "lion", "muon", "momentum")


def _problem():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    "w": 0.5 * jax.random.normal(k1, (256, 160)),  # adafactor factors it
    "b": jnp.zeros(160),
  }
  return params, k2


def _grads(params, t):
  rng = np.random.default_rng(t)
  return jax.tree.map(
    lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
  )


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.slow if n in SLOW_TX else ())
    for n in _transforms()
  ],
)
def test_optax_transforms_run_in_float32_on_the_widened_state(name):
  inner, rules = _transforms()[name]
  tx = lowprec.store_state(inner, rules)
  params, _ = _problem()
  traces = []

  @jax.jit
  def step(params, state, g):
    traces.append(None)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for t in range(3):
    g = _grads(params, t)
    # Oracle: the inner update on the float32 view, then the casts.
    wide = jax.tree.map(
      lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x,
      state.inner,
    )
    _, want = jax.jit(inner.update)(g, wide, params)
    params, state = step(params, state, g)
    stored = jax.tree_util.tree_leaves_with_path(state.inner)
    wanted = jax.tree.leaves(want)
    n_stored = 0
    for (path, got), w in zip(stored, wanted, strict=True):
      if got.dtype == jnp.bfloat16:
        n_stored += 1
        cast = np.asarray(w, np.float32).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(_bits(got), _bits(cast), err_msg=path)
      else:
        assert got.dtype == w.dtype, path
  assert len(traces) == 1
  tel = lowprec.telemetry(state)
  assert n_stored == len(state.counts.changed) >= 1
  assert tel["state/steps"] == 3 and tel["state/changed"] > 0
  # Step counts stay integers, untouched.
  for path, x in jax.tree_util.tree_leaves_with_path(state.inner):
    if "count" in jax.tree_util.keystr(path):
      assert x.dtype == jnp.int32 and int(x) == 3


@pytest.mark.slow
def test_inject_hyperparams_outside_and_multisteps_around_it():
  params, _ = _problem()
  rules = {"mu": "bfloat16:stochastic", "nu": "bfloat16:stochastic"}

  def make(learning_rate):
    return lowprec.store_state(optax.adam(learning_rate), rules, key=KEY)

  plain = make(1e-2)
  injected = optax.inject_hyperparams(make)(learning_rate=1e-2)
  multi = optax.MultiSteps(make(1e-2), 2)
  g = _grads(params, 0)
  want, want_state = jax.jit(plain.update)(g, plain.init(params), params)
  got, state = jax.jit(injected.update)(g, injected.init(params), params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert_telemetry_equal(
    lowprec.telemetry(state), lowprec.telemetry(want_state)
  )
  update = jax.jit(multi.update)
  _, state = update(g, multi.init(params), params)
  assert lowprec.telemetry(state)["state/steps"] == 0
  got, state = update(g, state, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  assert lowprec.telemetry(state)["state/steps"] == 1


def _checkpointed(tmp_path, tree, target=True):
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path, tree)
  ckpt.wait_until_finished()
  out = ckpt.restore(tmp_path, tree if target else None)
  ckpt.close()
  return out


def test_native_state_resumes_bit_for_bit_through_orbax(tmp_path):
  params = {"w": jax.random.normal(jax.random.key(4), (8, 300))}
  rules = {"mu": "bfloat16:stochastic", "nu": "float8_e5m2:nearest:block128"}
  tx = optax.chain(lowprec.store_state(optax.adamw(1e-2), rules, key=KEY))

  @jax.jit
  def step(params, state, t):
    g = jax.tree.map(lambda p: jnp.sin(p * 7.0 + t), params)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  carry = (params, tx.init(params))
  for t in range(3):
    carry = step(*carry, t)
  restored = _checkpointed(tmp_path / "ckpt", carry)
  nu = restored[1][0].inner[0].nu["w"]
  assert nu.dtype == jnp.float8_e5m2 and restored[1][0].scales
  for a, b in zip(
    jax.tree.leaves(restored), jax.tree.leaves(carry), strict=True
  ):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))
  for t in range(3, 6):
    carry = step(*carry, t)
    restored = step(*restored, t)
  for a, b in zip(
    jax.tree.leaves(restored), jax.tree.leaves(carry), strict=True
  ):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  # A restore without a target (plain dicts) still gives the telemetry.
  plain = _checkpointed(tmp_path / "plain", carry[1], target=False)
  assert isinstance(plain, list)
  assert_telemetry_equal(lowprec.telemetry(plain), lowprec.telemetry(carry[1]))


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.tanh(self.l1(x)))


def test_nnx_optimizer_and_its_state_views():
  model = _MLP(nnx.Rngs(0))
  rules = {"mu": "bfloat16", "nu/.*kernel": "float8_e5m2:nearest:tensor"}
  tx = lowprec.store_state(optax.adam(1e-2), rules)
  opt = lowprec.nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(2), (32, 4))

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - 1) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(8)]
  assert losses[-1] < 0.8 * losses[0]
  pure = nnx.as_pure(opt.opt_state)
  assert pure.inner[0].mu["l1"]["kernel"].dtype == jnp.bfloat16
  assert pure.inner[0].nu["l1"]["kernel"].dtype == jnp.float8_e5m2
  assert pure.inner[0].nu["l1"]["bias"].dtype == jnp.float32
  want = lowprec.telemetry(opt.opt_state)
  assert want["state/steps"] == 8 and "state/changed/0/mu/l1/kernel" in want
  state = nnx.state(opt)
  for view in (state, nnx.to_pure_dict(state)):
    assert_telemetry_equal(lowprec.telemetry(view), want)


def test_linen_train_state_apply_gradients():
  params, _ = _problem()
  tx = lowprec.store_state(
    optax.adam(1e-2), {"mu|nu": "bfloat16:stochastic"}, key=KEY
  )
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  for t in range(2):
    state = step(state, _grads(params, t))
  assert state.opt_state.inner[0].mu["w"].dtype == jnp.bfloat16
  assert lowprec.telemetry(state.opt_state)["state/steps"] == 2


def test_vmap_ensemble_reseeded_stores_distinct_draws():
  params = {"w": jnp.zeros(64)}
  tx = lowprec.store_state(
    optax.scale_by_adam(), {"nu": "bfloat16:stochastic"}, key=KEY
  )
  keys = jax.random.split(jax.random.key(1), 2)
  ens = {"w": jnp.zeros((2, 64))}
  states = jax.vmap(lambda p, k: lowprec.reseed(tx.init(p), k))(ens, keys)
  g = {"w": jnp.full(64, 0.3)}
  update = jax.jit(jax.vmap(lambda s: tx.update(g, s, params)[1]))
  for _ in range(3):
    states = update(states)
  nu = np.asarray(states.inner.nu["w"], np.float32)
  assert not np.array_equal(nu[0], nu[1])
  assert lowprec.telemetry(states)["state/steps"] == [3, 3]


@pytest.mark.parametrize(
  "storage", ["native", pytest.param("float32", marks=pytest.mark.slow)]
)
def test_eight_devices_store_the_bits_of_one(storage):
  # Rows split over 8 devices; blocks of 128 cut the last axis.
  params = {"w": jax.random.normal(jax.random.key(3), (16, 300))}
  rules = {"mu": "float8_e4m3fn:stochastic:block128"}
  if storage == "float32":  # the slow run adds a second rule
    rules["nu"] = "float8_e5m2:deadzone:tensor"
  tx = lowprec.store_state(optax.adam(1e-2), rules, key=KEY, storage=storage)

  @jax.jit
  def two_steps(params, state, g):
    def body(carry, _):
      params, state = carry
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(body, (params, state), None, length=2)[0]

  g = _grads(params, 0)
  one = two_steps(params, jax.jit(tx.init)(params), g)
  assert len(jax.devices()) == 8
  rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
  params8, g8 = jax.device_put((params, g), rows)
  eight = two_steps(params8, jax.jit(tx.init)(params8), g8)
  assert len(eight[1].inner[0].mu["w"].sharding.device_set) == 8
  for a, b in zip(jax.tree.leaves(eight), jax.tree.leaves(one), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert_telemetry_equal(lowprec.telemetry(eight[1]), lowprec.telemetry(one[1]))
  if storage == "float32":
    assert one[1].inner[0].mu["w"].dtype == jnp.float32


# One spec per scale rule; the block sizes put one block, or a part of
# one, on each device of the column split below.
SCALE_RULES = {
  "block32": "float8_e5m2:stochastic:block32",
  "block16": "bfloat16:nearest:block16",
  "tensor": "float8_e5m2:stochastic:tensor",
  "none": "bfloat16:stochastic",
}


def one_and_eight(tx, params):
  """`(params, state)` after three scanned AdamW-like steps of `tx` on
  one device and with `w` and `v` split by columns, `b` by rows over 8."""

  @jax.jit
  def run(params, state):
    def body(carry, t):
      params, state = carry
      g = jax.tree.map(lambda p: jnp.sin(p * 7.0 + t), params)
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(body, (params, state), jnp.arange(3.0))[0]

  one = run(params, jax.jit(tx.init)(params))
  mesh = Mesh(np.array(jax.devices()), ("x",))
  split = {"w": P(None, "x"), "v": P(None, "x"), "b": P("x")}
  params8 = jax.device_put(
    params, {k: NamedSharding(mesh, v) for k, v in split.items()}
  )
  eight = run(params8, jax.jit(tx.init)(params8))
  return one, eight


@pytest.mark.parametrize("spec", SCALE_RULES.values(), ids=SCALE_RULES)
def test_eight_devices_split_along_the_blocks_store_the_bits_of_one(spec):
  """Adam, three scanned steps, the columns (the blocked axis) of two
  matrices and a vector split over 8 devices: params, stored state,
  scales and counts are the single device's bit for bit, whatever the
  scale rule."""
  ks = jax.random.split(jax.random.key(3), 3)
  params = {
    "w": jax.random.normal(ks[0], (16, 256)),
    "v": jax.random.normal(ks[1], (8, 128)),
    "b": jax.random.normal(ks[2], (256,)),
  }
  tx = lowprec.store_state(optax.adam(1e-3), {"nu": spec}, key=KEY)

  one, eight = one_and_eight(tx, params)
  assert len(eight[1].inner[0].nu["w"].sharding.device_set) == 8
  leaves = jax.tree_util.tree_leaves_with_path(one)
  for (path, a), b in zip(leaves, jax.tree.leaves(eight), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(
      _bits(b), _bits(a), err_msg=jax.tree_util.keystr(path)
    )
  assert_telemetry_equal(lowprec.telemetry(eight[1]), lowprec.telemetry(one[1]))


@pytest.mark.parametrize("spec", SCALE_RULES.values(), ids=SCALE_RULES)
def test_update_is_the_inner_update_of_the_widened_state(spec):
  """A stored run's update and new float32 state are what `inner.update`
  gives on the widened state as its own jitted input, bit for bit, under
  every scale rule (XLA may not fold the widening into the inner's
  arithmetic, e.g. into an FMA with one of Adam's products)."""
  ks = jax.random.split(jax.random.key(4))
  params = {
    "w": jax.random.normal(ks[0], (16, 256)),
    "b": jax.random.normal(ks[1], (256,)),
  }
  inner = optax.adam(1e-3)
  tx = lowprec.store_state(inner, {"nu": spec}, key=KEY)
  block = lowprec.optim.stored_state.parse_state_format(spec).scale
  step = jax.jit(tx.update)
  oracle = jax.jit(inner.update)
  state = tx.init(params)
  for t in range(3):
    g = jax.tree.map(lambda p, t=t: jnp.sin(p * 7.0 + t), params)
    want, want_state = oracle(g, _widened(state, block), params)
    got, state = step(g, state, params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"step {t}")
    for a, b in zip(
      jax.tree.leaves(state.inner[0].mu),
      jax.tree.leaves(want_state[0].mu),
      strict=True,
    ):
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"step {t}")
    params = optax.apply_updates(params, got)


def _widened(state, block=None):
  """The float32 inner state of `store_state`'s state, in numpy: the
  stored values times their block's (or the tensor's) scale."""

  def one(path, x):
    name = lowprec.engine.weights.path_name(path)
    x = np.asarray(x)
    if x.dtype == np.int32:  # the step count
      return x
    x = x.astype(np.float32)
    scale = state.scales.get(name)
    if scale is not None:
      scale = np.asarray(scale)
      if scale.ndim:
        scale = np.repeat(scale, block, -1)[..., : x.shape[-1]]
      x = x * scale
    return x

  return jax.tree_util.tree_map_with_path(one, state.inner)


def test_on_bfloat16_params_the_inner_runs_in_float32():
  """bfloat16 params, only `nu` stored: Adam's `mu` is float32 and
  computed in float32, as under `lowprec.in_float32`, bit for bit (plain
  optax would keep it in bfloat16, which `lowprec.writeback` refuses),
  and the write-back after it gets float32 proposals."""
  params = lowprec.to_grid(
    {"w": jax.random.normal(jax.random.key(6), (8, 64))},
    "bfloat16",
    storage="native",
  )
  rules = {"nu": "bfloat16"}
  wb = lowprec.writeback("bfloat16")
  tx = optax.chain(lowprec.store_state(optax.adam(1e-3), rules), wb)
  f32 = lowprec.in_float32(optax.adam(1e-3))
  want_tx = optax.chain(lowprec.store_state(f32, rules), wb)
  state, want_state = tx.init(params), want_tx.init(params)
  assert state[0].inner[0].mu["w"].dtype == jnp.float32
  step, want_step = jax.jit(tx.update), jax.jit(want_tx.update)
  for t in range(3):
    g = jax.tree.map(lambda p, t=t: jnp.sin(p * 7.0 + t), params)
    updates, state = step(g, state, params)
    want, want_state = want_step(g, want_state, params)
    for a, b in zip(
      jax.tree.leaves((updates, state)),
      jax.tree.leaves((want, want_state)),
      strict=True,
    ):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(_bits(a), _bits(b))
    params = lowprec.apply_updates(params, updates)
  assert params["w"].dtype == jnp.bfloat16
  assert state[0].inner[0].nu["w"].dtype == jnp.bfloat16
  assert lowprec.telemetry(state)["moved"] > 0


# ---- bad input -------------------------------------------------------------


class _OddState(NamedTuple):
  decay: float  # a Python number in the state
  trace: dict


def _odd() -> optax.GradientTransformation:
  def init(params):
    return _OddState(0.9, jax.tree.map(jnp.zeros_like, params))

  def update(u, state, params=None):
    return u, state

  return optax.GradientTransformation(init, update)


def test_bad_rules_are_errors_naming_the_leaf_and_the_fix():
  params = {"w": jnp.zeros(3)}
  with pytest.raises(
    ValueError,
    match=r"rule 'nuu' matches no state leaf.*"
    r"'0/count', '0/mu/w', '0/nu/w'",
  ):
    lowprec.store_state(
      optax.adam(1e-2), {"mu": "bfloat16", "nuu": "bfloat16"}
    ).init(params)
  with pytest.raises(
    ValueError,
    match=r"'\.\*' matches state leaf '0/count', which holds int32 values "
    r"\(a step count\).*put \('0/count', None\) before it",
  ):
    lowprec.store_state(optax.adam(1e-2), [(".*", "bfloat16")]).init(params)
  # The fix the message names works.
  fixed = [("0/count", None), (".*", "bfloat16")]
  state = lowprec.store_state(optax.adam(1e-2), fixed).init(params)
  assert state.inner[0].mu["w"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"leaf 'decay', which is a float, not"):
    lowprec.store_state(_odd(), {"decay|trace": "bfloat16"}).init(params)
  # A Python number that no rule matches is kept as it is.
  odd = lowprec.store_state(_odd(), {"trace": "bfloat16"}).init(params)
  assert odd.inner.decay == 0.9
  with pytest.raises(ValueError, match=r"needs a PRNG key: pass key="):
    lowprec.store_state(optax.adam(1e-2), {"mu": "bfloat16:stochastic"})
  with pytest.raises(ValueError, match=r"Did you mean 'stochastic'"):
    lowprec.store_state(optax.adam(1e-2), {"mu": "bfloat16:stochastc"})
  with pytest.raises(ValueError, match=r"Did you mean 'bfloat16'"):
    lowprec.store_state(optax.adam(1e-2), {"mu": "bfloat6"})
  with pytest.raises(ValueError, match=r"unknown state scale 'blockx'"):
    lowprec.StateFormat("bfloat16", scale="blockx")
  with pytest.raises(ValueError, match=r"dict or a list of \(regex, spec\)"):
    lowprec.store_state(optax.adam(1e-2), "bfloat16")
  with pytest.raises(ValueError, match="valid: native, float32"):
    lowprec.store_state(optax.adam(1e-2), {"mu": "bfloat16"}, storage="f8")
  with pytest.raises(
    TypeError,
    match=r"got function .*call the factory first: "
    r"lowprec.store_state\(optax.adam\(1e-3\), rules\)",
  ):
    lowprec.store_state(optax.adam, {"mu": "bfloat16"})

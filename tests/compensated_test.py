"""Compensated write-back against numpy oracles and a float32-master run.

Expected values are recomputed here in numpy: roundings by ml_dtypes casts
(round to nearest, ties to even), exact sums in float64, the remainder's
split on uint32 bit patterns. Nothing below uses lowprec's rounding to
compute an expected value.
"""

import re

import flax.linen as nn
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

BF16 = ml_dtypes.bfloat16
F32 = np.float32
KEY = jax.random.key(5)


def _remedies():
  return {
    "nearest": lowprec.writeback("bfloat16"),
    "kahan": lowprec.kahan_writeback("bfloat16"),
    "kahan-e5m2": lowprec.kahan_writeback("bfloat16", buffer="float8_e5m2"),
    "two_component": lowprec.two_component_writeback("bfloat16"),
    "remainder": lowprec.remainder_writeback(),
  }


def _bits(x):
  x = np.asarray(x)
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ---- a constant stream below half a gap --------------------------------


@pytest.mark.parametrize("name", list(_remedies()))
def test_a_sub_half_gap_stream_reaches_two_only_under_compensation(name):
  # 1e-3 is below half the bf16 gap at 1 (2^-8): nearest erases every step.
  tx = _remedies()[name]
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  u = {"w": jnp.full(4, 1e-3, jnp.float32)}

  def step(carry, _):
    p, s = carry
    d, s = tx.update(u, s, p)
    return (optax.apply_updates(p, d), s), lowprec.telemetry_arrays(s)

  (p, s), curves = jax.jit(lambda c: jax.lax.scan(step, c, length=1000))(
    (params, tx.init(params))
  )
  w = np.asarray(p["w"], np.float32)
  assert p["w"].dtype == jnp.bfloat16
  if name == "nearest":
    np.testing.assert_array_equal(w, 1.0)
    assert int(curves["moved"].sum()) == 0
  elif name == "kahan-e5m2":
    # The float8 buffer's own rounding (2^-3 relative) loses mass.
    assert np.all(np.abs(w - 2.0) < 4 * 2.0**-6) and np.all(w != 1.0)
  else:
    assert np.all(np.abs(w - 2.0) <= 2.0**-6), w  # one gap at 2
    assert int(curves["moved"].sum()) >= 4 * 100
  if name != "nearest":
    assert np.all(np.asarray(curves["lost"]) == 0)
    assert float(curves["carried"].max()) > 0


# ---- a proposal that cancels the buffer exactly --------------------------


def _compensators():
  return {
    "kahan": lowprec.kahan_writeback("bfloat16"),
    "two_component": lowprec.two_component_writeback("bfloat16"),
  }


@pytest.mark.parametrize("name", list(_compensators()))
def test_a_proposal_that_cancels_the_buffer_empties_it(name):
  # +2^-10 is erased from w = 1 and carried; -2^-10 makes y = 0: the
  # documented c' = Q_c(y - (w' - w)) is 0, and nothing was lost.
  tx = _compensators()[name]
  p = {"w": jnp.ones(3, jnp.bfloat16)}
  s = tx.init(p)
  for u in (2.0**-10, -(2.0**-10)):
    d, s = tx.update({"w": jnp.full(3, u, jnp.float32)}, s, p)
    p = optax.apply_updates(p, d)
  np.testing.assert_array_equal(np.asarray(p["w"], np.float32), 1.0)
  np.testing.assert_array_equal(np.asarray(s.buffer["w"], np.float32), 0.0)
  tel = lowprec.telemetry(s)
  assert tel["lost"] == 0 and tel["lost_mass"] == 0 and tel["carried"] == 0


def _dyadic_stream(rng, steps, n):
  """Lion-like proposals: +-2^-10 (lr 2^-10), and a stream of +-2^-10,
  +-2^-11 and +-2^-12 whose partial sums cancel the buffer as often."""
  lion = rng.choice([-1.0, 1.0], (steps, n)) * 2.0**-10
  mixed = lion * rng.choice([1.0, 0.5, 0.25], (steps, n))
  return {"lion": lion.astype(F32), "mixed": mixed.astype(F32)}


@pytest.mark.parametrize("stream", ["lion", "mixed"])
@pytest.mark.parametrize("name", list(_compensators()))
def test_weight_plus_buffer_tracks_the_exact_sum_of_the_proposals(name, stream):
  # Property: w_t + c_t = w_0 + sum(u) up to what the buffer's rounding
  # drops, `|r - bf16(r)|` per step with `r = y - (w' - w)` in float64
  # (plus float32's own rounding of y and r, 2^-23 relative, twice).
  # Seed 0, 1000 steps of 512 coordinates; the float64 oracle is numpy.
  steps, n = 1000, 512
  us = _dyadic_stream(np.random.default_rng(0), steps, n)[stream]
  tx = _compensators()[name]

  def step(carry, u):
    p, s = carry
    d, s = tx.update({"w": u}, s, p)
    p = optax.apply_updates(p, d)
    return (p, s), (p["w"], s.buffer["w"])

  p0 = {"w": jnp.ones(n, jnp.bfloat16)}
  _, (ws, cs) = jax.jit(lambda c, us: jax.lax.scan(step, c, us))(
    (p0, tx.init(p0)), jnp.asarray(us)
  )
  ws = np.asarray(ws, np.float64)
  cs = np.asarray(cs, np.float64)
  prev_w = np.concatenate([np.ones((1, n)), ws[:-1]])
  prev_c = np.concatenate([np.zeros((1, n)), cs[:-1]])
  y = us.astype(np.float64) + prev_c
  r = y - (ws - prev_w)
  slack = 2.0**-22 * (np.abs(y) + np.abs(r))
  bound = np.cumsum(np.abs(r - r.astype(BF16).astype(np.float64)) + slack, 0)
  err = np.abs(ws + cs - (1.0 + np.cumsum(us.astype(np.float64), 0)))
  assert np.all(err <= bound), (err.max() / 2.0**-10, np.mean(err > bound))
  assert np.any((y == 0) & (prev_c != 0))  # the stream cancels buffers


# ---- the remainder is a float32 master ----------------------------------


def _trunc(master):
  """The bfloat16 view: the top 16 bits of each float32."""
  top = (np.asarray(master, np.float32).view(np.uint32) >> 16).astype(np.uint16)
  return top.view(BF16)


def _mlp(p, x):
  h = jnp.tanh(x @ p["l1"]["kernel"] + p["l1"]["bias"])
  return h @ p["l2"]["kernel"] + p["l2"]["bias"]


def _mlp_problem():
  ks = jax.random.split(jax.random.key(0), 4)
  p = {
    "l1": {"kernel": 0.5 * jax.random.normal(ks[0], (8, 32)),
           "bias": jnp.zeros(32)},
    "l2": {"kernel": 0.2 * jax.random.normal(ks[1], (32, 1)),
           "bias": jnp.zeros(1)},
  }  # fmt: skip
  x = jax.random.normal(ks[2], (64, 8))
  y = jnp.sin(x @ jax.random.normal(ks[3], (8, 1)))
  return lowprec.to_grid(p, "bfloat16", storage="native"), x, y


def _loss(p, x, y):
  return jnp.mean((_mlp(p, x) - y) ** 2)


def _widen(tree):
  return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


@pytest.mark.parametrize(
  "decay",
  [0.0, pytest.param(0.1, marks=pytest.mark.slow)],
  ids=["adamw", "adamw-decay"],
)
def test_remainder_run_equals_a_float32_master_run_bit_for_bit(decay):
  params, x, y = _mlp_problem()
  adamw = optax.adamw(optax.cosine_decay_schedule(3e-3, 25), weight_decay=decay)
  tx = optax.chain(lowprec.in_float32(adamw), lowprec.remainder_writeback())

  @jax.jit
  def ours(p, s):
    d, s = tx.update(jax.grad(_loss)(p, x, y), s, p)
    return optax.apply_updates(p, d), s

  @jax.jit
  def master_update(m, s):
    view = jax.tree.map(
      lambda a: jax.lax.bitcast_convert_type(
        (jax.lax.bitcast_convert_type(a, jnp.uint32) >> 16).astype(jnp.uint16),
        jnp.bfloat16,
      ),
      m,
    )
    g = _widen(jax.grad(_loss)(view, x, y))
    # Without decay AdamW never reads params: this is the textbook master
    # run. With decay it multiplies what the chain hands it, the view.
    return adamw.update(g, s, _widen(view) if decay else m)

  # The master's addition on its own: in one program with the update,
  # XLA:CPU contracts AdamW's last multiply and this add into an FMA.
  add = jax.jit(optax.apply_updates)

  def master_step(m, s):
    u, s = master_update(m, s)
    return add(m, u), s

  master, ms = _widen(params), adamw.init(_widen(params))
  state = tx.init(params)
  for _ in range(25):
    params, state = ours(params, state)
    master, ms = master_step(master, ms)
    for name, m in (("l1/kernel", master["l1"]["kernel"]),
                    ("l2/bias", master["l2"]["bias"])):  # fmt: skip
      a, b = name.split("/")
      np.testing.assert_array_equal(_bits(params[a][b]), _bits(_trunc(m)))
      low = np.asarray(m).view(np.uint32) & 0xFFFF
      np.testing.assert_array_equal(state[1].buffer[name], low)
  for a in params:
    for b in params[a]:
      assert params[a][b].dtype == jnp.bfloat16
      np.testing.assert_array_equal(
        _bits(params[a][b]), _bits(_trunc(master[a][b]))
      )
  tel = lowprec.telemetry(state)
  assert tel["carried"] > 0 and tel["erased"] > 0 and tel["moved"] > 0


# ---- telemetry against a numpy recount ----------------------------------


def _data(rng, n=4000):
  """bf16 weights and float32 proposals from 1/20 of a gap to 3 gaps."""
  w = rng.standard_normal(n).astype(BF16).astype(np.float32)
  gap = np.abs(w) * 2.0**-7 + 1e-30
  u = (gap * rng.uniform(-3, 3, n) * rng.choice([1, 0.05], n)).astype(
    np.float32
  )
  u[rng.random(n) < 0.05] = 0.0
  return w, u


def _oracle(method, w, u, c, buf_dtype=BF16):
  """One step in numpy: (new weight, new buffer, telemetry words)."""
  f32 = np.float32
  if method == "remainder":
    m = (w.view(np.uint32) | c.astype(np.uint32)).view(f32)
    new = np.where(u != 0, m + u, m).astype(f32)
    nb = new.view(np.uint32)
    view = (nb & 0xFFFF0000).view(f32)
    exact = m.astype(np.float64) + u - new  # float64: exact
    held, dropped = new - view, np.where(u != 0, exact, 0)
    lost = (u != 0) & (new == m)
    return view, (nb & 0xFFFF).astype(np.uint16), lost, held, dropped
  y = (u + c.astype(f32)).astype(f32)
  s = (w + y).astype(f32)
  q = s.astype(BF16).astype(f32)
  q = np.where(y != 0, q, w)
  if method == "two_component":
    t = (w.astype(np.float64) + y - s).astype(f32)  # exact in float32
    r = ((s - q) + t).astype(f32)
  else:
    r = (y - (q - w)).astype(f32)
  r = np.where(y != 0, r, y)  # y == 0: the buffer empties
  new_c = r.astype(buf_dtype)
  nc = new_c.astype(f32)
  lost = (y != 0) & (r != 0) & (nc == 0)
  return q, new_c, lost, nc, np.where(y != 0, r - nc, 0)


@pytest.mark.parametrize(
  "method, buffer",
  [
    ("kahan", "bfloat16"),
    ("kahan", "float8_e4m3fn"),
    ("two_component", None),
    ("remainder", None),
  ],
  ids=["kahan-bf16", "kahan-e4m3fn", "two_component", "remainder"],
)
def test_telemetry_and_buffers_equal_a_numpy_recount(method, buffer):
  rng = np.random.default_rng(0)
  w, _ = _data(rng)
  if method == "kahan":
    tx = lowprec.kahan_writeback("bfloat16", buffer=buffer)
  elif method == "two_component":
    tx = lowprec.two_component_writeback("bfloat16")
  else:
    tx = lowprec.remainder_writeback()
  buf_dtype = ml_dtypes.float8_e4m3fn if buffer == "float8_e4m3fn" else BF16
  n = len(w) // 2
  params = {"a": jnp.asarray(w[:n]), "b": jnp.asarray(w[n:])}
  state = tx.init(params)
  update = jax.jit(tx.update)
  c = np.zeros(len(w), np.uint16 if method == "remainder" else buf_dtype)
  for t in range(3):  # later steps start from nonzero buffers
    _, u = _data(np.random.default_rng(t + 1))
    props = {"a": jnp.asarray(u[:n]), "b": jnp.asarray(u[n:])}
    deltas, state = update(props, state, params)
    params = optax.apply_updates(params, deltas)
    q, c_new, lost, held, dropped = _oracle(method, w, u, c, buf_dtype)
    got = np.concatenate([params["a"], params["b"]])
    np.testing.assert_array_equal(got.view(np.uint32), q.view(np.uint32))
    buf = np.concatenate([state.buffer["a"], state.buffer["b"]])
    np.testing.assert_array_equal(_bits(buf), _bits(c_new))
    tel = lowprec.telemetry(state)
    for name, part in (("a", slice(0, n)), ("b", slice(n, None))):
      prop = u[part] != 0
      moved = q[part] != w[part]
      want = {
        "proposals": prop.sum(),
        "erased": (prop & ~moved).sum(),
        "moved": moved.sum(),
        "saturated": 0,
        "unreachable": 0,
        "nonfinite": 0,
        "lost": lost[part].sum(),
      }
      for k, v in want.items():
        assert tel[f"{k}/{name}"] == v, (t, k, name)
      for k, v in (("carried", held), ("lost_mass", dropped)):
        exact = np.abs(v[part].astype(np.float64)).sum()
        assert tel[f"{k}/{name}"] == pytest.approx(exact, rel=1e-5), k
    assert tel["erased"] > 0 and tel["moved"] > 0
    assert tel["erased_fraction"] == pytest.approx(
      tel["erased"] / tel["proposals"], rel=1e-12
    )
    if buffer == "float8_e4m3fn":
      assert tel["lost"] > 0  # residuals below e4m3fn's 2^-10 flush
    w, c = q, c_new


@pytest.mark.parametrize("method", ["kahan", "two_component", "remainder"])
def test_an_adamw_chain_under_jit_follows_the_documented_arithmetic(method):
  # XLA:CPU contracts AdamW's last multiply (by -lr) with the add that
  # follows it (`u + c`, the master's `m + u`) into an FMA unless
  # something stops it, and the result then leaves the formula at
  # rounding ties. The oracle takes u from AdamW jitted alone (a
  # materialized output, nothing to contract it with) and applies the
  # documented steps in float32 numpy; weights and buffers must equal the
  # chain's bit for bit. Seed 0, 200,000 coordinates, 12 steps (without
  # the guard 136 Kahan buffers and about 25,000 remainders differ).
  n, steps = 200_000, 12
  rng = np.random.default_rng(0)
  w = (0.1 * rng.standard_normal(n)).astype(BF16).astype(F32)
  adamw = optax.adamw(1e-3, weight_decay=0.1)
  tx = optax.chain(adamw, _remedies()[method])
  params = {"w": jnp.asarray(w)}
  inner_update, update = jax.jit(adamw.update), jax.jit(tx.update)
  state, inner = tx.init(params), adamw.init(params)
  c = np.zeros(n, np.uint16 if method == "remainder" else BF16)
  for _ in range(steps):
    g = {"w": jnp.asarray(rng.standard_normal(n).astype(F32))}
    u, inner = inner_update(g, inner, params)
    d, state = update(g, state, params)
    params = optax.apply_updates(params, d)
    q, c, *_ = _oracle(method, w, np.asarray(u["w"]), c)
    np.testing.assert_array_equal(_bits(params["w"]), _bits(q))
    np.testing.assert_array_equal(_bits(state[1].buffer["w"]), _bits(c))
    w = q


def test_remainder_lost_mass_is_the_exact_float32_rounding_error():
  # lost_mass sums |(m + u) - fl(m + u)|, exactly; where |u| > |m| the
  # float32 u - (m' - m) is itself rounded. w = 3 * 2^-30 with u = 1 +
  # 2^-23: float32 drops all of w (2.79e-9), u - (m' - m) says 0.
  tx = lowprec.remainder_writeback()
  p = {"w": jnp.full(1, 3 * 2.0**-30, jnp.bfloat16)}
  _, s = tx.update({"w": jnp.full(1, 1 + 2.0**-23)}, tx.init(p), p)
  assert lowprec.telemetry(s)["lost_mass"] == 3 * 2.0**-30
  # Property against float64 numpy: bf16 weights from 2^-30 to 4 and
  # proposals from 2^-12 to 2 of either sign (seed 0, 20,000 coords).
  rng = np.random.default_rng(0)
  n = 20_000
  w = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-30, 2, n)).astype(BF16)
  u = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-12, 1, n)).astype(F32)
  p = {"w": jnp.asarray(w)}
  _, s = jax.jit(tx.update)({"w": jnp.asarray(u)}, tx.init(p), p)
  m = w.astype(np.float64)
  exact = np.abs((m + u) - (w.astype(F32) + u).astype(np.float64)).sum()
  got = lowprec.telemetry(s)["lost_mass"]
  assert got == pytest.approx(exact, rel=1e-6)


def test_two_component_error_is_the_rounded_exact_residual_for_small_weights():
  # Property: e' = RN_bf16((a + u) - a') with the residual exact (float64),
  # also where |a| < |u|, where Fast2Sum with the roles as given is
  # inexact and only TwoSum (or Fast2Sum swapped) is exact. Weights from
  # 2^-30 to 2^-5 under proposals near 0.1 (seed 0, 20,000 coordinates).
  n = 20_000
  rng = np.random.default_rng(0)
  a = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-30, -5, n)).astype(BF16)
  u = (rng.choice([-1, 1], n) * rng.uniform(0.05, 0.15, n)).astype(F32)
  tx = lowprec.two_component_writeback("bfloat16")
  p = {"w": jnp.asarray(a)}
  d, s = jax.jit(tx.update)({"w": jnp.asarray(u)}, tx.init(p), p)
  new_a = np.asarray(optax.apply_updates(p, d)["w"], np.float64)
  exact = a.astype(np.float64) + u.astype(np.float64) - new_a
  assert np.all(np.abs(a.astype(F32)) < np.abs(u))
  np.testing.assert_array_equal(_bits(s.buffer["w"]), _bits(exact.astype(BF16)))
  assert np.count_nonzero(exact) > n // 2


def test_compensation_keeps_nonfinite_proposals_out_as_writeback_does():
  w0 = lowprec.to_grid({"w": jnp.linspace(-1.0, 1.0, 12)}, "bfloat16")
  u = np.full(12, 1e-3, np.float32)
  u[[1, 4]], u[7], u[9] = np.nan, np.inf, -np.inf
  # two_component shares Kahan's path for non-finite values.
  for tx in (
    lowprec.kahan_writeback("bfloat16"),
    lowprec.remainder_writeback(),
  ):
    good = {"w": jnp.full(12, 3e-3)}
    _, state = tx.update(good, tx.init(w0), w0)  # fill the buffers
    before = np.asarray(state.buffer["w"])
    d, state = tx.update({"w": jnp.asarray(u)}, state, w0)
    tel = lowprec.telemetry(state)
    assert tel["nonfinite"] == 4 and tel["proposals"] == 8
    bad = ~np.isfinite(u)
    np.testing.assert_array_equal(np.asarray(d["w"])[bad], -0.0)
    np.testing.assert_array_equal(np.asarray(state.buffer["w"])[bad],
                                  before[bad])  # fmt: skip
    assert np.all(np.isfinite(np.asarray(state.buffer["w"], np.float32)))
  tx = lowprec.kahan_writeback("bfloat16", nonfinite="propagate")
  d, state = tx.update({"w": jnp.asarray(u)}, tx.init(w0), w0)
  new = np.asarray(optax.apply_updates(w0, d)["w"])
  assert np.isnan(new[[1, 4]]).all() and lowprec.telemetry(state)["moved"] > 0
  top = float(lowprec.get_format("bfloat16").max_finite)
  assert new[7] == top and new[9] == -top


# ---- state: dtypes, shardings, checkpoints, loops -------------------------


def test_buffers_are_native_and_sharded_like_the_params():
  assert len(jax.devices()) == 8
  rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
  params = jax.device_put(
    lowprec.to_grid(
      {"w": jax.random.normal(KEY, (16, 8)), "b": jnp.zeros(8)},
      "bfloat16",
      storage="native",
    ),
    rows,
  )
  rules = [(r"b", "float8_e5m2"), (r".*", "bfloat16")]
  cases = {
    "kahan": (lowprec.kahan_writeback("bfloat16", buffer=rules),
              {"w": jnp.bfloat16, "b": jnp.float8_e5m2}),
    "two_component": (lowprec.two_component_writeback("bfloat16"),
                      {"w": jnp.bfloat16, "b": jnp.bfloat16}),
    "remainder": (lowprec.remainder_writeback(),
                  {"w": jnp.uint16, "b": jnp.uint16}),
  }  # fmt: skip
  for name, (tx, dtypes) in cases.items():
    state = tx.init(params)
    for k, dtype in dtypes.items():  # zeros_like takes the sharding
      assert state.buffer[k].dtype == dtype, (name, k)
      assert state.buffer[k].sharding == params[k].sharding, (name, k)
  # And a jitted update keeps them (tests/transforms_test.py runs all
  # three through the 8-device harness).
  u = {"w": jnp.full((16, 8), 1e-3), "b": jnp.full(8, 1.001)}
  u = jax.device_put(u, rows)
  _, state = jax.jit(cases["kahan"][0].update)(
    u, cases["kahan"][0].init(params), params
  )
  for k, dtype in cases["kahan"][1].items():
    buf = state.buffer[k]
    assert buf.dtype == dtype and np.any(np.asarray(buf, np.float32) != 0)
    assert buf.sharding.is_equivalent_to(rows, buf.ndim), k
  # Float32 storage of the weights keeps native buffers all the same.
  f32 = lowprec.to_grid({"w": jnp.ones(3)}, "bfloat16")
  assert lowprec.kahan_writeback("bfloat16").init(f32).buffer["w"].dtype == (
    jnp.bfloat16
  )


def _stepper(tx):
  x = jnp.linspace(-1, 1, 8)

  @jax.jit
  def step(p, s):
    g = jax.grad(lambda p: jnp.sum((x * p["w"] - 0.3) ** 2))(p)
    d, s = tx.update(_widen(g), s, p)
    return optax.apply_updates(p, d), s

  def run(params, steps, state=None):
    state = tx.init(params) if state is None else state
    for _ in range(steps):
      params, state = step(params, state)
    return params, state

  return run


@pytest.mark.parametrize("name", ["kahan-e5m2", "remainder"])
def test_checkpoint_and_resume_bit_for_bit_buffers_included(name, tmp_path):
  tx = optax.chain(optax.sgd(3e-3), _remedies()[name])
  p0 = {"w": jnp.ones(8, jnp.bfloat16)}
  run = _stepper(tx)
  want_p, want_s = run(p0, 6)
  p, s = run(p0, 3)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "c", {"p": p, "s": s})
  ckpt.wait_until_finished()
  back = ckpt.restore(tmp_path / "c", {"p": p, "s": s})
  plain = ckpt.restore(tmp_path / "c")  # no target: dicts and lists
  ckpt.close()
  assert back["s"][1].buffer["w"].dtype == s[1].buffer["w"].dtype
  assert_telemetry_equal(lowprec.telemetry(plain["s"]), lowprec.telemetry(s))
  got_p, got_s = run(back["p"], 3, back["s"])
  for a, b in zip(
    jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s)),
    strict=True,
  ):  # fmt: skip
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert np.any(np.asarray(want_s[1].buffer["w"], np.float32) != 0)


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 16, dtype=jnp.float32, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.tanh(self.l1(x)))


def test_nnx_optimizer_loop_and_its_state_views():
  model = _MLP(nnx.Rngs(0))
  rules = [(r".*bias", None), (r".*", "bfloat16")]
  params = nnx.state(model, nnx.Param)
  nnx.update(model, lowprec.to_grid(params, rules, storage="native"))
  tx = optax.chain(
    lowprec.in_float32(optax.adam(1e-3)),
    lowprec.kahan_writeback(rules, buffer="bfloat16"),
  )
  opt = lowprec.nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(2), (32, 4))
  loss = lambda m: jnp.mean((m(x) - 1.0) ** 2)

  @nnx.jit
  def step(model, opt):
    value, grads = nnx.value_and_grad(loss)(model)
    opt.update(model, grads)
    return value

  losses = [float(step(model, opt)) for _ in range(10)]
  assert losses[-1] < losses[0]
  assert model.l1.kernel[...].dtype == jnp.bfloat16
  lowprec.check_on_grid(nnx.state(model, nnx.Param), rules)
  want = lowprec.telemetry(opt.opt_state)
  assert want["steps"] == 10 and want["carried"] > 0
  assert set(nnx.as_pure(opt.opt_state)[1].buffer) == {"l1/kernel", "l2/kernel"}
  state = nnx.state(opt)  # orbax restores: the checkpoint test above
  for view in (state, nnx.to_pure_dict(state)):
    assert_telemetry_equal(lowprec.telemetry(view), want)
  arrays = jax.jit(lowprec.telemetry_arrays)(nnx.as_pure(state))
  assert int(arrays["erased"]) == want["erased"]


def test_linen_train_state_loop():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(jnp.tanh(nn.Dense(16)(x)))

  x = jax.random.normal(jax.random.key(3), (32, 4))
  net = Net()
  params = net.init(jax.random.key(0), x)["params"]
  params = lowprec.to_grid(params, "bfloat16", storage="native")
  tx = optax.chain(
    lowprec.in_float32(optax.adam(1e-3)),
    lowprec.two_component_writeback("bfloat16"),
  )
  ts = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

  @jax.jit
  def step(ts):
    loss = lambda p: jnp.mean((ts.apply_fn({"params": p}, x) - 1.0) ** 2)
    value, grads = jax.value_and_grad(loss)(ts.params)
    return ts.apply_gradients(grads=grads), value

  losses = []
  for _ in range(20):
    ts, value = step(ts)
    losses.append(float(value))
  assert losses[-1] < losses[0]
  lowprec.check_on_grid(ts.params, "bfloat16")
  tel = lowprec.telemetry(ts.opt_state)
  # linen names modules in the order they are built: the inner is Dense_1.
  assert tel["steps"] == 20 and tel["proposals/Dense_1/kernel"] == 64


# ---- bytes per parameter ---------------------------------------------------


def test_bytes_per_param_counts_the_leaves():
  p32 = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
  bf = lowprec.to_grid(p32, "bfloat16", storage="native")

  def count(tx, params):
    return lowprec.bytes_per_param(params, jax.eval_shape(tx.init, params))

  f32 = lowprec.in_float32(optax.adamw(1e-3))
  assert count(optax.adamw(1e-3), p32)[:3] == (4.0, 8.0, 12.0)
  assert count(optax.chain(optax.adamw(1e-3), lowprec.writeback("bfloat16")),
               bf).total == 2 + 4  # fmt: skip
  assert count(optax.chain(f32, lowprec.kahan_writeback("bfloat16")),
               bf).total == 2 + 8 + 2  # fmt: skip
  # Moments in bf16 too (as plain optax keeps them for bf16 params).
  kahan = lowprec.kahan_writeback("bfloat16")
  assert count(optax.chain(optax.adamw(1e-3), kahan), bf).total == 8
  fp8 = lowprec.kahan_writeback("bfloat16", buffer="float8_e5m2")
  assert count(optax.chain(f32, fp8), bf).total == 2 + 8 + 1
  for tx in (
    lowprec.two_component_writeback("bfloat16"),
    lowprec.remainder_writeback(),
  ):
    got = count(optax.chain(f32, tx), bf)
    assert got.total == 12 and got.params == 2 and got.state == 10
  # Counters, keys and telemetry scalars are fixed bytes, not per param.
  sr = lowprec.kahan_writeback("bfloat16", "stochastic", key=KEY)
  got = count(sr, bf)
  assert got.state == 2 and got.fixed == 4 + 8 + 2 * 9 * 4
  with pytest.raises(ValueError, match="no array leaves"):
    lowprec.bytes_per_param({})


# ---- errors ----------------------------------------------------------------


_MX = lowprec.scaled.get_scaled_format("mxfp8_e4m3")


@pytest.mark.parametrize(
  "spec",
  [
    "mxfp8_e4m3",
    _MX,
    {"w": "mxfp8_e4m3", "b": None},
    [("b", None), (".*", "mxfp8_e4m3")],
  ],
  ids=["name", "format", "pytree", "rules"],
)
@pytest.mark.parametrize(
  "factory, fix",
  [
    (lowprec.kahan_writeback, r"kahan_writeback\('float8_e4m3fn'"),
    (lowprec.two_component_writeback, r"two_component_writeback\('float8"),
    (lowprec.remainder_writeback, r"remainder_writeback\('bfloat16'\)"),
  ],
  ids=["kahan", "two_component", "remainder"],
)
def test_scaled_weight_formats_are_refused_when_the_transform_is_built(
  factory, fix, spec
):
  # Refused in the factory call itself, with the reason and the fixes.
  with pytest.raises(ValueError, match="scaled format") as err:
    factory(spec)
  msg = str(err.value)
  assert "mxfp8_e4m3" in msg and "unscaled grids" in msg
  assert "lowprec.writeback('mxfp8_e4m3', rounding='stochastic'" in msg
  assert re.search(fix, msg), msg


@pytest.mark.parametrize(
  "buffer",
  [
    "int8",
    "int8:0.125",
    " int4",
    np.dtype("int8"),
    lowprec.get_format("int8", scale=2.0**-10),
    [(".*", "int8")],
  ],
  ids=["int8", "int8-colon", "int4", "dtype", "format", "rules"],
)
def test_an_integer_buffer_gets_one_message_naming_the_fix(buffer):
  with pytest.raises(ValueError) as err:
    lowprec.kahan_writeback("bfloat16", buffer=buffer)
  msg = str(err.value)
  assert "is an integer grid" in msg and "buffer='bfloat16'" in msg, msg
  assert "scale" not in msg, msg  # never asks for a scale it then refuses


def test_a_scaled_buffer_names_its_element_format():
  with pytest.raises(ValueError, match=r"buffer format 'mxfp8_e4m3' is a "
                     r"scaled format.*'float8_e4m3fn'"):  # fmt: skip
    lowprec.kahan_writeback("bfloat16", buffer="mxfp8_e4m3")


def test_errors_name_the_fix():
  with pytest.raises(ValueError, match="wider than float32.*buffer='float32"):
    lowprec.kahan_writeback("bfloat16", buffer="float64")
  with pytest.raises(ValueError, match="wider than float32"):
    lowprec.kahan_writeback("bfloat16", buffer=[(".*", np.dtype("float64"))])
  with pytest.raises(ValueError, match="integer grid.*buffer='bfloat16'"):
    int8 = lowprec.get_format("int8", scale=2.0**-10)
    lowprec.kahan_writeback("bfloat16", buffer=int8)
  with pytest.raises(ValueError, match="Did you mean 'float8_e5m2'"):
    lowprec.kahan_writeback("bfloat16", buffer="float8_e5m")
  for tx in (lowprec.kahan_writeback, lowprec.two_component_writeback):
    with pytest.raises(ValueError, match="rounding='deadzone'.*'nearest'"):
      tx("bfloat16", "deadzone")
    with pytest.raises(ValueError, match="needs a PRNG key"):
      tx("bfloat16", "stochastic")
  with pytest.raises(ValueError, match=r"'w' is on the float8_e4m3fn grid.*"
                     r"kahan_writeback"):  # fmt: skip
    lowprec.remainder_writeback("float8_e4m3fn").init({"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="'w'.*two-component float needs"):
    int3 = lowprec.get_format("int3", scale=0.125)
    lowprec.two_component_writeback(int3).init({"w": jnp.zeros(2)})
  rules = [("b", None), (".*", "bfloat16")]
  with pytest.raises(ValueError, match="'b' has a weight format but its buf"):
    lowprec.kahan_writeback("bfloat16", buffer=rules).init({"b": jnp.ones(2)})
  tx = lowprec.remainder_writeback()
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="remainder_writeback .*current params"):
    tx.update(params, tx.init(params))
  with pytest.raises(ValueError, match=r"'w': 1 of 2 .*lowprec.to_grid"):
    tx.init({"w": jnp.array([1.0, 0.1])})
  with pytest.raises(ValueError, match="arrives as bfloat16.*in_float32"):
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, tx.init(params), params)


def test_reseed_gives_a_stochastic_kahan_state_its_own_stream():
  params = {"w": jnp.ones(64, jnp.bfloat16)}
  tx = lowprec.kahan_writeback("bfloat16", "stochastic", key=KEY)
  state = tx.init(params)
  again = lowprec.reseed(state, jax.random.key(9))
  assert jax.tree.structure(again) == jax.tree.structure(state)
  assert not np.array_equal(again.key, state.key)
  u = {"w": jnp.full(64, 3e-3)}  # SR moves some of these, by its draw
  update = jax.jit(tx.update)
  a, _ = update(u, state, params)
  b, _ = update(u, again, params)
  assert not np.array_equal(np.asarray(a["w"]), np.asarray(b["w"]))

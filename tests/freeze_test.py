"""Freeze prediction: the reference trace, curve comparisons and audits.

Oracles are independent of the library's jax code where it matters: the
erasure rule is recomputed with ml_dtypes casts (and numpy frexp rounding for
`e8m3`), the analytic cases have freeze steps worked out by hand, and the
low-precision runs are real `lowprec.writeback` runs.
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lowprec
from lowprec import freeze
from lowprec.freeze import Target

BF16_GAP = 2.0**-7  # bfloat16 grid gap in [1, 2)


def _run(inner, loss, w0, steps, fmt):
  """A float32 reference run and a nearest write-back run from `w0`.

  Both record every coordinate (`sample=n`): the reference its `(w_t, u_t)`;
  the write-back run, with the same trace placed before `writeback`, its
  realized `(w_t, u_t)`. Returns `{run: (w [steps + 1, n], u [steps, n],
  curve [steps], telemetry of the last step)}`; the write-back run's curve
  is the measured `erased_fraction`, the reference's the prediction.
  """
  n = w0.size
  trace = freeze.reference_trace([fmt], sample=n, key=jax.random.key(0))
  opts = {
    "ref": optax.chain(inner, trace),
    "lp": optax.chain(inner, trace, lowprec.writeback(fmt)),
  }
  curve_key = {"ref": f"pred/{fmt}/erased_fraction", "lp": "erased_fraction"}
  out = {}
  for name, opt in opts.items():

    @jax.jit
    def step(w, state, opt=opt):
      u, state = opt.update(jax.grad(loss)(w), state, w)
      return optax.apply_updates(w, u), state

    w = jnp.asarray(w0)
    state = jax.jit(opt.init)(w)
    ws, us, curve = [], [], []
    for _ in range(steps):
      w, state = step(w, state)
      tel = lowprec.telemetry(state)
      ws.append(tel["pred/sample/w"])
      us.append(tel["pred/sample/u"])
      curve.append(tel[curve_key[name]])
    ws.append(np.asarray(w))
    out[name] = (
      np.array(ws, np.float32),
      np.array(us, np.float32),
      np.array(curve),
      tel,
    )
  return out


# ---- analytic cases --------------------------------------------------------
#
# Ten bfloat16 coordinates in four groups of sizes 1, 2, 3, 4 that freeze at
# different steps, so the erased fraction climbs 0.1, 0.3, 0.6, 1.0 and
# crosses 0.5 when the third group freezes. The learning rate falls by 4x
# every 3 steps, lr_t = 2^-5 * 4^-floor(t/3), so each proposal is a whole
# number of grid gaps (the low-precision weight lands exactly where the
# float32 one does) until it drops straight below half a gap: no ties.

_LR = optax.piecewise_constant_schedule(2.0**-5, {3: 0.25, 6: 0.25, 9: 0.25})
_GROUPS = np.array([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
_SIGNS = np.array([1, -1, 1, -1, 1, -1, 1, -1, 1, -1], np.float32)


def _sgd_linear():
  # L(w) = <a, w>, a_i = s_i 4^(k_i), k = group - 2; w in [1, 2), gap 2^-7.
  # SGD proposes u_t = -lr_t a_i, |u_t| = 2^(-5 + 2k - 2j) with j = t // 3:
  # a multiple of the gap while the exponent is >= -7, erased (< 2^-8) once
  # it is <= -9, i.e. from j = k + 2 = group: t = 3 * group.
  a = _SIGNS * 4.0 ** (_GROUPS - 2)
  w0 = np.full(10, 1.5, np.float32)
  return optax.sgd(_LR), lambda w: jnp.sum(a * w), w0, 12, 3 * _GROUPS, 6


# Weights in four binades, group g at |w| with gap 2^(-3 - 2g): 24, 6, 1.5,
# 0.2578125, moving away from zero. Adam's step is lr_t times m/sqrt(v) =
# +-1 for a constant (or slowly varying) gradient, so |u_t| = lr_t = 2^(-5-2j)
# to within 0.3% (weight decay 1e-4 at |w| <= 24 included): one or more
# whole gaps, landing on the grid point the float32 weight rounds to, until
# lr_t < gap / 2 = 2^(-4 - 2g), i.e. j >= g: t = 3 * group.
_ADAM_W0 = _SIGNS * np.array([24.0, 6, 6, 1.5, 1.5, 1.5] + [0.2578125] * 4)


def _adamw_linear():
  a = -np.sign(_ADAM_W0)
  w0 = _ADAM_W0.astype(np.float32)
  return optax.adamw(_LR), lambda w: jnp.sum(a * w), w0, 12, 3 * _GROUPS, 6


def _adamw_quadratic():
  # L(w) = |w - c|^2 / 2 with c 16 further out: the gradient shrinks by
  # < 1% over the run, so Adam's normalized step stays +-1 well within the
  # factor-of-2 margins of the schedule.
  c = (_ADAM_W0 + 16 * np.sign(_ADAM_W0)).astype(np.float32)
  w0 = _ADAM_W0.astype(np.float32)
  loss = lambda w: 0.5 * jnp.sum((w - c) ** 2)
  return optax.adamw(_LR), loss, w0, 12, 3 * _GROUPS, 6


def _sgd_quadratic():
  # L(w) = |w - c|^2 / 2, SGD with lr 1/2 halves the distance to c every
  # step. c = c0 + s * delta, c0 on the grid, delta = gap / 64 off it, and
  # w0 = c0 + s 2^a gap with a = 2 * group. The weight goes c0 + s 2^(a-t)
  # gap exactly (the delta / 2 offset rounds away) while the proposal
  # |u_t| = (2^(a-t) gap - delta) / 2 is at least a gap; at t = a it is
  # (gap - delta) / 2 < gap / 2 and the coordinate freezes one gap from c0,
  # with a nonzero gradient: freeze at t = a = 2 * group.
  a = 2 * _GROUPS
  c0 = np.where(_SIGNS > 0, 1.25, 1.75)
  w0 = (c0 + _SIGNS * 2.0**a * BF16_GAP).astype(np.float32)
  c = (c0 + _SIGNS * BF16_GAP / 64).astype(np.float32)
  loss = lambda w: 0.5 * jnp.sum((w - c) ** 2)
  return optax.sgd(0.5), loss, w0, 10, a, 4


@pytest.mark.parametrize(
  "case",
  [_sgd_linear, _sgd_quadratic, _adamw_linear, _adamw_quadratic],
  ids=["sgd-linear", "sgd-quadratic", "adamw-linear", "adamw-quadratic"],
)
def test_analytic_freeze_step_is_hit_exactly(case):
  inner, loss, w0, steps, frozen, cross = case()
  runs = _run(inner, loss, w0, steps, "bfloat16")
  ref_w, ref_u, predicted, ref_tel = runs["ref"]
  lp_w, lp_u, measured, _ = runs["lp"]
  assert freeze.crossing(predicted) == (cross, "post_init")
  assert freeze.crossing(measured) == (cross, "post_init")
  np.testing.assert_array_equal(predicted, measured)
  assert ref_tel["pred/bfloat16/crossing"] == cross
  audit = freeze.audit_coordinates(ref_w, ref_u, lp_w, lp_u, "bfloat16")
  np.testing.assert_array_equal(audit.predicted_frozen_from, frozen)
  np.testing.assert_array_equal(audit.measured_frozen_from, frozen)
  assert audit.agreement == 1.0
  # The trajectories coincide on the grid until each coordinate freezes.
  div = audit.diverged_at
  assert np.all((div == -1) | (div > frozen)), (div, frozen)
  if case is _sgd_linear:  # and bit for bit: every step is whole gaps
    for i, t in enumerate(frozen):
      np.testing.assert_array_equal(ref_w[: t + 1, i], lp_w[: t + 1, i])


# ---- the rule against an ml_dtypes oracle ----------------------------------

NATIVE = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def _ml_round(x, fmt):
  """Saturating nearest rounding by an ml_dtypes cast (clip first)."""
  dt = np.dtype(getattr(ml_dtypes, fmt, fmt))
  top = float(ml_dtypes.finfo(dt).max)
  return np.clip(x, -top, top).astype(dt).astype(np.float32)


def _ml_gaps(q, fmt):
  """Grid gaps above and below grid values `q` (ml_dtypes nextafter)."""
  dt = np.dtype(getattr(ml_dtypes, fmt, fmt))
  top = float(ml_dtypes.finfo(dt).max)
  qd = q.astype(dt)
  up = np.nextafter(qd, np.full_like(qd, top)).astype(np.float64) - q
  down = q - np.nextafter(qd, np.full_like(qd, -top)).astype(np.float64)
  up = np.where(q >= top, down, up)  # at the top, step sizes from below
  down = np.where(q <= -top, up, down)
  return up, down


def _edge_cases(fmt, seed=0):
  """Grid points (powers of two, zero, subnormals, +-max, odd and even
  mantissas), reference weights on and just off them, and proposals of
  0, 1/4, 1/2 (ties), 1/2 + 2^-10, 3/4, 1, 3/2 gaps either way."""
  dt = np.dtype(getattr(ml_dtypes, fmt, fmt))
  fi = ml_dtypes.finfo(dt)
  rng = np.random.default_rng(seed)
  if fmt == "bfloat16":  # stay clear of float32 subnormals (flushed on CPU)
    q = (rng.uniform(1, 2, 600) * 2.0 ** rng.integers(-100, 100, 600)).astype(
      dt
    )
    q = np.concatenate([q, [1, 2, 0.5, fi.max]]).astype(dt)
  else:
    bits = np.arange(256 if dt.itemsize == 1 else 1 << 16, dtype=np.uint16)
    q = bits.astype(np.uint8 if dt.itemsize == 1 else np.uint16).view(dt)
    q = q[np.isfinite(q.astype(np.float32))]
    if dt.itemsize == 2:
      q = rng.choice(q, 1500, replace=False)
  q = np.unique(q.astype(np.float32))
  q = np.concatenate([q, -q])
  up, down = _ml_gaps(q, fmt)
  fr = np.array([0, 0.25, 0.5, 0.5 + 2**-10, 0.75, 1, 1.5])
  w_off = np.array([0.0, 0.2, -0.2])  # off-grid reference weights
  grid = np.meshgrid(np.arange(q.size), fr, w_off, [1, -1], indexing="ij")
  i, f, off, s = (g.ravel() for g in grid)
  u = (s * f * np.where(s > 0, up[i], down[i])).astype(np.float32)
  w = (q[i] + off * np.minimum(up[i], down[i])).astype(np.float32)
  ok = np.isfinite(u) & np.isfinite(w)
  return w[ok], u[ok]


def _oracle_erased(w, u, fmt):
  q = _ml_round(w, fmt)
  return (u != 0) & (_ml_round(q + u, fmt) == q)


@pytest.mark.parametrize("fmt", NATIVE)
def test_rule_matches_ml_dtypes_oracle_elementwise(fmt):
  w, u = _edge_cases(fmt)
  opt = freeze.reference_trace([fmt])

  def one(w, u):
    _, state = opt.update(u, opt.init(w), w)
    return state.erased[0, 0]

  got = np.asarray(jax.jit(jax.vmap(one))(w, u)).astype(bool)
  want = _oracle_erased(w, u, fmt)
  bad = np.flatnonzero(got != want)
  assert not bad.size, list(
    zip(w[bad[:5]], u[bad[:5]], got[bad[:5]], strict=True)
  )
  # The cases are not one-sided: both outcomes occur, ties included.
  assert 0.2 < want.mean() < 0.8


def test_powers_of_two_use_the_gap_in_the_direction_of_u():
  # Below 2.0 the bf16 grid is twice as fine as above: a step of 3/4 of the
  # lower gap moves the weight down, the same step up is erased.
  opt = freeze.reference_trace(["bfloat16"])
  w = jnp.array([2.0, 2.0, 2.0], jnp.float32)
  u = jnp.array([-0.75, 0.75, -0.375], jnp.float32) * 2.0**-7
  run = jax.jit(lambda w, u: opt.update(u, opt.init(w), w)[1].erased[0, 0])
  assert int(run(w, u)) == 2  # up by 3/4 of the lower gap, down by 3/8
  assert int(run(w[:1], u[:1])) == 0  # down by 3/4 of the lower gap moves


# ---- several targets, offline recomputation --------------------------------


def _mlp_params(key, sizes, std):
  keys = jax.random.split(key, len(sizes) - 1)
  return {
    f"dense_{i}": {
      "kernel": std * jax.random.normal(k, (a, b)),
      "bias": jnp.zeros(b),
    }
    for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
  }


def _mlp(params, x):
  n = len(params)
  for i in range(n):
    x = x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"]
    if i < n - 1:
      x = jax.nn.gelu(x)
  return x


@functools.partial(jax.jit, static_argnums=(0,))
def _task(seed=0):
  """Teacher-student regression: 512 inputs and a teacher MLP's outputs."""
  kx, kt = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (512, 16))
  return x, _mlp(_mlp_params(kt, [16, 32, 1], 1.0), x)


def _mse(params, x, y):
  return jnp.mean((_mlp(params, x) - y) ** 2)


def _batch(data, t, size=64):
  x, y = data
  i = (t % (x.shape[0] // size)) * size
  return (
    jax.lax.dynamic_slice_in_dim(x, i, size),
    jax.lax.dynamic_slice_in_dim(y, i, size),
  )


def _train(opt, params, steps, data, *, every=1, keep=False):
  """float32 training; telemetry every `every` steps, (w_t, u_t) if keep."""

  @jax.jit
  def step(p, state, t):
    g = jax.grad(_mse)(p, *_batch(data, t))
    u, state = opt.update(g, state, p)
    return optax.apply_updates(p, u), state, u

  state = jax.jit(opt.init)(params)
  logs, traj = [], []
  for t in range(steps):
    new, state, u = step(params, state, t)
    if keep:
      traj.append((params, u))
    params = new
    if (t + 1) % every == 0:
      logs.append(lowprec.telemetry(state))
  return logs, traj


def _same(a: dict, b: dict):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _same_tree(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


MULTI = {
  "bfloat16": "bfloat16",
  "e8m3": "e8m3",
  "e4m3_dzsr": Target("float8_e4m3fn", "deadzone"),
  "fp8_kernels": [(r".*kernel", "float8_e4m3fn"), (r".*", None)],
}


def test_several_targets_equal_separate_runs():
  """One trace with several targets against single-target traces side by
  side in another chain (each sees the same proposals: a trace passes its
  updates through bit for bit), over 4 AdamW steps."""
  data = _task()
  params = _mlp_params(jax.random.key(1), [16, 32, 1], 0.3)
  inner = optax.adamw(1e-2)
  together, _ = _train(
    optax.chain(inner, freeze.reference_trace(MULTI)), params, 4, data
  )
  singles = [freeze.reference_trace({n: spec}) for n, spec in MULTI.items()]
  apart, _ = _train(optax.chain(inner, *singles), params, 4, data)
  for a, b in zip(together, apart, strict=True):
    _same(a, b)
  assert together[-1]["pred/bfloat16/proposals"] == 16 * 32 + 32 + 32 + 1
  # A per-parameter rule counts only the leaves it names.
  assert together[-1]["pred/fp8_kernels/proposals"] == 16 * 32 + 32
  assert "pred/fp8_kernels/erased_fraction/dense_0/bias" not in together[-1]
  assert 0 < together[-1]["pred/bfloat16/erased_fraction"] < 1


def _rn_e8m(x, m):
  """Nearest rounding to m mantissa bits, 8 exponent bits, normal range."""
  mant, exp = np.frexp(np.asarray(x, np.float64))
  return np.ldexp(np.round(np.ldexp(mant, m + 1)), exp - m - 1)


_OFFLINE = {
  "bfloat16": lambda x: _ml_round(x, "bfloat16"),
  "float16": lambda x: _ml_round(x, "float16"),
  "float8_e4m3fn": lambda x: _ml_round(x, "float8_e4m3fn"),
  "e8m3": lambda x: _rn_e8m(x, 3),
}


def test_online_curve_equals_offline_recomputation():
  """Full (w_t, u_t) stored for 12 AdamW steps of a 641-parameter MLP; the
  erased counts recomputed with numpy / ml_dtypes equal the logged ones."""
  data = _task(seed=3)
  params = _mlp_params(jax.random.key(4), [16, 32, 1], 0.2)
  opt = optax.chain(
    optax.adamw(optax.cosine_decay_schedule(3e-3, 12)),
    freeze.reference_trace(list(_OFFLINE)),
  )
  logs, traj = _train(opt, params, 12, data, keep=True)
  fractions = []
  for log, (w_t, u_t) in zip(logs, traj, strict=True):
    paths = freeze.leaf_paths(w_t)
    ws = [np.asarray(x) for x in jax.tree_util.tree_leaves(w_t)]
    us = [np.asarray(x) for x in jax.tree_util.tree_leaves(u_t)]
    for name, rn in _OFFLINE.items():
      total_e = total_n = 0
      for path, w, u in zip(paths, ws, us, strict=True):
        q = np.float32(rn(w))
        erased = (u != 0) & (rn(q + u) == q)  # q + u in float32
        n = int((u != 0).sum())
        total_e, total_n = total_e + int(erased.sum()), total_n + n
        got = log[f"pred/{name}/erased_fraction/{path}"]
        assert got == erased.sum() / n, (name, path)
      assert log[f"pred/{name}/erased"] == total_e
      assert log[f"pred/{name}/proposals"] == total_n
      assert log[f"pred/{name}/erased_fraction"] == total_e / total_n
      fractions.append(total_e / total_n)
  # Not a degenerate curve: erasure varies across steps and formats.
  # Not degenerate: bf16 erasure climbs from 0 past 0.5 as the cosine
  # schedule decays, and the four targets' curves all differ.
  f = np.array(fractions).reshape(-1, len(_OFFLINE)).T
  assert f[0, 0] == 0 and f[0, -1] > 0.5
  assert len({tuple(row) for row in f}) == len(_OFFLINE)


# ---- a small MLP: AdamW + cosine, measured against predicted ---------------

_MLP_STEPS = 100


def _mlp_cell(fmt, std, lr=5e-4, seed=0):
  """Predicted and measured erased-fraction curves of one MLP cell.

  A 16-64-64-1 GELU MLP (5,313 parameters), weights N(0, std^2) rounded to
  the `fmt` grid and stored in float32, AdamW (weight decay 1e-4) with a
  cosine decay from `lr` over 100 steps, batches of 64 in a fixed order.
  The reference trains in float32 from the same init; the measured run
  writes back with nearest rounding.
  """
  data = _task(seed)
  params = jax.jit(
    lambda k: lowprec.to_grid(_mlp_params(k, [16, 64, 64, 1], std), fmt)
  )(jax.random.key(seed + 1))
  inner = optax.adamw(optax.cosine_decay_schedule(lr, _MLP_STEPS))
  ref_logs, _ = _train(
    optax.chain(inner, freeze.reference_trace([fmt])),
    params,
    _MLP_STEPS,
    data,
  )
  lp_logs, _ = _train(
    optax.chain(inner, lowprec.writeback(fmt)), params, _MLP_STEPS, data
  )
  predicted = np.array([r[f"pred/{fmt}/erased_fraction"] for r in ref_logs])
  measured = np.array([r["erased_fraction"] for r in lp_logs])
  return predicted, measured, ref_logs[-1][f"pred/{fmt}/crossing"]


def test_mlp_bf16_measured_crossing_within_4_steps_of_predicted():
  predicted, measured, online = _mlp_cell("bfloat16", std=0.1)
  cell = freeze.compare(predicted, measured)
  assert cell.predicted_category == cell.measured_category == "post_init"
  assert abs(cell.error_steps) <= 4, cell
  # Just past mid-run, where the cosine schedule has decayed enough.
  assert 45 <= cell.measured_step <= 75, cell
  assert cell.rmse < 0.03, cell
  assert online == cell.predicted_step


def test_mlp_e4m3fn_both_at_init():
  # At std 0.02 the e4m3fn gap (>= 2^-9) is above twice AdamW's first step.
  predicted, measured, online = _mlp_cell("float8_e4m3fn", std=0.02)
  cell = freeze.compare(predicted, measured)
  assert cell.predicted_category == cell.measured_category == "at_init"
  assert cell.predicted_step == cell.measured_step == online == 0


# ---- stochastic rounding ---------------------------------------------------


@pytest.mark.parametrize("rounding", ["stochastic", "deadzone"])
def test_move_probability_matches_writeback_monte_carlo(rounding):
  """Seed 0, 4000 coordinates, 200 write-back draws: the measured moved
  share (standard error < 0.0006) matches the predicted move probability
  within 0.003; ignoring the cap at one gap would be off by > 0.1."""
  fmt = "float8_e4m3fn"
  kw, ku, kk = jax.random.split(jax.random.key(0), 3)
  w = 0.05 * jax.random.normal(kw, (4000,))
  q = lowprec.to_grid(w, fmt)
  gap = jnp.maximum(_gap(q, fmt), 2.0**-9)
  u = gap * jax.random.uniform(ku, (4000,), minval=-2.5, maxval=2.5)
  target = Target(fmt, rounding)
  opt = freeze.reference_trace([target])
  state = jax.jit(lambda u, w: opt.update(u, opt.init(w), w)[1])(u, w)
  tel = lowprec.telemetry(state)
  name = target.default_name
  predicted = tel[f"pred/{name}/move_prob"]
  assert "pred/" + name + "/erased_fraction" not in tel  # no freeze predicted
  wb = lowprec.writeback(fmt, rounding, key=kk)

  def draw(state, _):
    _, state = wb.update(u, state, q)
    return state, sum(state.moved.values())

  draws = jax.jit(lambda s: jax.lax.scan(draw, s, None, length=200)[1])
  moved = draws(jax.jit(wb.init)(q))
  measured = float(jnp.mean(moved)) / int((u != 0).sum())
  assert abs(measured - predicted) < 0.003, (measured, predicted)
  x = q + u
  uncapped = float(jnp.mean(jnp.abs(x - q) / gap))
  assert uncapped - predicted > 0.1


def _gap(q, fmt):
  f = lowprec.get_format(fmt)
  return jnp.minimum(f.gap_up(q), f.gap_down(q))


# ---- transform properties --------------------------------------------------


def test_updates_pass_through_and_state_is_constant_size():
  params = _mlp_params(jax.random.key(0), [8, 16, 4], 0.3)
  grads = jax.tree.map(lambda x: 1e-3 * jnp.cos(x * 7), params)
  opt = freeze.reference_trace(
    ["bfloat16", "float8_e4m3fn"], sample=5, key=jax.random.key(1)
  )
  state = opt.init(params)
  update = jax.jit(opt.update)
  sizes = []
  for _ in range(3):
    out, state = update(grads, state, params)
    _same_tree(out, grads)  # bit for bit
    sizes.append([x.shape for x in jax.tree_util.tree_leaves(state)])
  assert update._cache_size() == 1  # no recompile after the first update
  assert sizes[0] == sizes[-1]
  # Memory: counters per (target, leaf) and the sample, not O(params).
  n_state = sum(x.size for x in jax.tree_util.tree_leaves(state))
  assert n_state == 1 + 4 + 2 * (2 * 4) + 2 + 3 * 5


def test_sample_is_fixed_deterministic_and_spread():
  params = _mlp_params(jax.random.key(0), [8, 16, 4], 0.3)
  total = 8 * 16 + 16 + 16 * 4 + 4
  opt = freeze.reference_trace(["bfloat16"], sample=20, key=jax.random.key(7))
  eager = np.asarray(opt.init(params).sample_index)
  jitted = np.asarray(jax.jit(opt.init)(params).sample_index)
  np.testing.assert_array_equal(eager, jitted)
  assert np.all(np.diff(eager) > 0) and 0 <= eager[0] and eager[-1] < total
  other = freeze.reference_trace(["bfloat16"], sample=20, key=jax.random.key(8))
  assert not np.array_equal(eager, np.asarray(other.init(params).sample_index))
  grads = jax.tree.map(lambda x: x * 0 + 1e-3, params)
  state = jax.jit(lambda g, p: opt.update(g, opt.init(p), p)[1])(grads, params)
  flat = {
    p: np.asarray(x).ravel()
    for p, x in zip(
      freeze.leaf_paths(params), jax.tree_util.tree_leaves(params), strict=True
    )
  }
  pos = state.sample_positions()
  np.testing.assert_array_equal(
    np.asarray(state.sample_w), [flat[p][i] for p, i in pos]
  )
  assert {p for p, _ in pos} == set(flat)  # every leaf is represented


def test_same_shaped_leaves_are_sampled_and_counted_as_alone():
  # Leaves of one shape are traced stacked: the sample must still be the
  # numpy ravel's values at its positions, and each leaf's counts those
  # of a trace of that leaf alone.
  rs = np.random.default_rng(3)
  params = {f"h_{i}": {"w": rs.standard_normal((6, 10))} for i in range(5)}
  params["b"] = rs.standard_normal(7)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  grads = jax.tree.map(lambda x: 2e-3 * jnp.cos(7 * x), params)
  targets = ["bfloat16", Target("float8_e4m3fn", "stochastic")]
  opt = freeze.reference_trace(targets, sample=40, key=jax.random.key(2))
  state = jax.jit(lambda g, p: opt.update(g, opt.init(p), p)[1])(grads, params)
  flat_w = {
    p: np.asarray(x).ravel()
    for p, x in zip(
      freeze.leaf_paths(params), jax.tree_util.tree_leaves(params), strict=True
    )
  }
  flat_u = dict(
    zip(
      flat_w,
      [np.asarray(x).ravel() for x in jax.tree.leaves(grads)],
      strict=True,
    )
  )
  pos = state.sample_positions()
  assert {p for p, _ in pos} == set(flat_w)
  np.testing.assert_array_equal(
    np.asarray(state.sample_w), [flat_w[p][i] for p, i in pos]
  )
  np.testing.assert_array_equal(
    np.asarray(state.sample_u), [flat_u[p][i] for p, i in pos]
  )
  report = state.report()
  for name in params:
    alone = freeze.reference_trace(targets)
    one = {name: params[name]}
    st = alone.update({name: grads[name]}, alone.init(one), one)[1].report()
    (leaf,) = freeze.leaf_paths(one)
    for key, value in st.items():
      if not key.endswith("/" + leaf):
        continue
      if "move_prob" in key:
        # A float32 sum: XLA may order the stacked reduction otherwise.
        assert report[key] == pytest.approx(value, rel=1e-6), key
      else:
        assert report[key] == value, key  # exact counts


def _small_tree():
  params = {
    "a": 0.3 * jax.random.normal(jax.random.key(0), (8, 16)),
    "b": jnp.linspace(-1.0, 1.0, 8),
  }
  return params, jax.tree.map(lambda x: 1e-3 * jnp.sin(x * 5), params)


def test_multisteps_and_inject_hyperparams():
  params, grads = _small_tree()
  trace = freeze.reference_trace("bfloat16")
  inner = optax.chain(optax.inject_hyperparams(optax.adamw)(1e-3), trace)
  opt = optax.MultiSteps(inner, every_k_schedule=2)
  state = opt.init(params)
  for _ in range(2):
    _, state = jax.jit(opt.update)(grads, state, params)
  tel = lowprec.telemetry(state)
  plain = optax.chain(optax.adamw(1e-3), trace)
  ref_state = jax.jit(lambda g, p: plain.update(g, plain.init(p), p)[1])(
    grads, params
  )
  _same(tel, lowprec.telemetry(ref_state))
  assert 0 < tel["pred/bfloat16/erased_fraction"] < 1


def test_sharded_over_8_devices_gives_the_same_numbers():
  params, grads = _small_tree()
  mesh = jax.make_mesh((8,), ("d",))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  put = lambda t: jax.tree.map(lambda x: jax.device_put(x, spec), t)
  traced = freeze.reference_trace(
    ["bfloat16", "float8_e4m3fn"], sample=6, key=jax.random.key(0)
  )
  s1 = traced.init(params)
  _, s1 = jax.jit(traced.update)(grads, s1, params)
  s8 = traced.init(put(params))
  _, s8 = jax.jit(traced.update)(put(grads), s8, put(params))
  _same(lowprec.telemetry(s1), lowprec.telemetry(s8))


def test_errors_name_the_fix():
  with pytest.raises(ValueError, match="needs params"):
    opt = freeze.reference_trace("bfloat16")
    opt.update(jnp.ones(2), opt.init(jnp.ones(2)))
  with pytest.raises(ValueError, match="needs a key"):
    freeze.reference_trace("bfloat16", sample=3)
  with pytest.raises(ValueError, match="duplicate"):
    freeze.reference_trace(["bfloat16", lowprec.get_format("bfloat16")])
  with pytest.raises(ValueError, match="needs a name"):
    freeze.reference_trace([[(".*", "bfloat16")]])
  with pytest.raises(ValueError, match="unknown rounding"):
    Target("bfloat16", "up")
  with pytest.raises(ValueError, match="Did you mean"):
    freeze.reference_trace("bfloat61")
  with pytest.raises(ValueError, match="exceeds"):
    freeze.reference_trace("bfloat16", sample=9, key=jax.random.key(0)).init(
      jnp.ones(8)
    )


@pytest.mark.parametrize(
  "spec, fix",
  [
    ("mxfp8_e4m3:stochastic", "Target('mxfp8_e4m3', 'stochastic')"),
    ("bfloat16:deadzone", "Target('bfloat16', 'deadzone')"),
    ("mxfp8_e4m", "Did you mean 'mxfp8_e4m3'?"),
    ("mxfp4", "mxfp4_e2m1"),
  ],
  ids=["mx-with-rounding", "grid-with-rounding", "mx-typo", "mx-short"],
)
def test_an_unknown_target_names_the_mx_formats_and_the_fix(spec, fix):
  # Trace targets take MX names: the error lists them next to the grids,
  # and a "name:rounding" spec points to Target's rounding argument.
  with pytest.raises(ValueError) as e:
    freeze.reference_trace([spec])
  msg = str(e.value)
  assert fix in msg, msg
  assert "mxfp8_e4m3" in msg and "mxfp4_e2m1" in msg and "bfloat16" in msg
  assert "nvfp4" not in msg  # refused as a target: not offered


# ---- curves ----------------------------------------------------------------

nan = float("nan")


@pytest.mark.parametrize(
  "curve, theta, want",
  [
    ([0.1, 0.2, 0.6, 0.9], 0.5, (2, "post_init")),
    ([0.6, 0.7, 0.9], 0.5, (0, "at_init")),
    ([0.1, 0.6, 0.4, 0.7, 0.9], 0.5, (3, "post_init")),  # re-crossing
    ([0.6, 0.9, 0.4], 0.5, (None, "never")),  # falls back at the end
    ([0.1, 0.2, 0.3], 0.5, (None, "never")),
    ([0.2, 0.5, 0.5], 0.5, (1, "post_init")),  # >= theta
    ([nan, 0.6, nan, 0.8], 0.5, (1, "at_init")),  # no proposals: skipped
    ([0.2, nan, 0.9], 0.5, (2, "post_init")),
    ([0.9, 0.1, nan], 0.5, (None, "never")),  # a last step without any
    ([0.2, 0.3, 0.1], 0.15, (None, "never")),
    ([0.2, 0.3, 0.4], 0.15, (0, "at_init")),
  ],
  ids=[
    "plain",
    "at_init",
    "re-crossing",
    "falls-back",
    "never",
    "equal-theta",
    "nan-lead",
    "nan-gap",
    "nan-tail",
    "theta-never",
    "theta-at-init",
  ],
)
def test_crossing(curve, theta, want):
  assert freeze.crossing(curve, theta) == want


@pytest.mark.parametrize(
  "curve",
  [[nan, nan], [nan], []],
  ids=["all-nan", "one-nan", "empty"],
)
def test_crossing_refuses_a_curve_without_values(curve):
  # Not "never": nothing was proposed, so nothing can be said.
  with pytest.raises(ValueError, match="no value") as e:
    freeze.crossing(curve)
  assert "erased_fraction" in str(e.value)  # what to pass instead
  with pytest.raises(ValueError, match="no value"):
    freeze.compare(curve, curve)


def test_crossing_refuses_infinite_entries():
  with pytest.raises(ValueError, match="infinite entry .first at index 1"):
    freeze.crossing([0.1, float("inf"), 0.9])


def test_crossing_with_step_numbers():
  assert freeze.crossing([0.1, 0.9, 0.8], steps=[10, 20, 30]) == (
    20,
    "post_init",
  )


def test_compare_fields():
  c = freeze.compare([0.1, 0.2, 0.6, 0.9], [0.1, 0.3, 0.4, 0.8])
  assert (c.predicted_step, c.measured_step, c.error_steps) == (2, 3, -1)
  assert c.relative_error == pytest.approx(1 / 3)
  assert c.within_tol is False and c.category_agrees
  assert c.rmse == pytest.approx(math.sqrt((0.01 + 0.04 + 0.01) / 4))
  assert freeze.compare([0.1, 0.6], [0.1, 0.6], tol=0.0).within_tol is True
  # A never-crossing prediction against a post-init measurement.
  c = freeze.compare([0.1, 0.2, 0.3], [0.1, 0.6, 0.7])
  assert c.predicted_category == "never" and c.measured_step == 1
  assert c.error_steps is None and c.within_tol is None
  assert not c.category_agrees
  # Both at init: no relative error, categories agree.
  c = freeze.compare([0.9, 0.9], [0.7, 1.0])
  assert c.error_steps == 0 and c.relative_error is None and c.category_agrees
  with pytest.raises(ValueError, match="length"):
    freeze.compare([0.1, 0.2], [0.1])


def test_summarize_by_hand():
  cells = {
    "a": ([0.0, 1.0], [0.0, 1.0]),  # post_init / post_init, rmse 0
    "b": ([0.0, 0.0], [1.0, 1.0]),  # never / at_init, rmse 1
    "c": ([1.0, 1.0], [1.0, 1.0]),  # at_init / at_init, rmse 0
  }
  s = freeze.summarize(cells)
  assert s.within_tol == "1/1" and s.category_disagree == "1/3"
  np.testing.assert_array_equal(
    s.confusion, [[1, 0, 1], [0, 1, 0], [0, 0, 0]]
  )  # rows measured, columns predicted: at_init, post_init, never
  assert s.macro_rmse == pytest.approx(1 / 3)
  # Leave-one-out baselines: a <- mean(b, c) = [1, 1], b and c <- [0.5, 1].
  base = (math.sqrt(0.5) + 2 * math.sqrt(0.125)) / 3
  assert s.baseline_rmse == pytest.approx(base)
  assert s.skill == pytest.approx(1 - (1 / 3) / base)
  assert "| a | 1 (post_init) | 1 (post_init) | 0 | 0.0% |" in s.to_markdown()


def test_summarize_counts_within_tolerance():
  rng = np.random.default_rng(0)
  cells = {}
  for i, (p, m) in enumerate([(20, 20), (22, 20), (40, 50), (10, 11)]):
    steps = np.arange(60)
    cells[str(i)] = (
      (steps >= p) * 0.9 + 0.05 * rng.random(60),
      (steps >= m) * 0.9 + 0.05 * rng.random(60),
    )
  s = freeze.summarize(cells, tol=0.15)
  # Errors 0, 2/20, 10/50, 1/11: three within 15%.
  assert s.within_tol == "3/4"
  assert s.n_category_disagree == 0 and s.skill > 0


def _seeds_around_common_time(steps=60):
  """Three seeds' curves: a shared sigmoid plus deviations summing to 0."""
  t = np.arange(steps)
  common = 1 / (1 + np.exp(-(t - 20) / 5))
  d1 = 0.05 * np.sin(t / 4)
  d2 = 0.03 * np.cos(t / 7)
  dev = np.stack([d1, d2, -(d1 + d2)])
  return common, dev, common + dev


def test_common_time_share_by_hand_and_against_the_residual_identity():
  # c = [1, 3], grand mean 2: common 2 * (1 + 1) = 4 of a total 8.
  assert freeze.common_time_share([[0.0, 2.0], [2.0, 4.0]]) == 0.5
  assert freeze.common_time_share([[0.1, 0.9]] * 3) == pytest.approx(1.0)
  # Seeds offset by constants around a flat common time: share 0.
  assert freeze.common_time_share([[1.0, 1.0], [3.0, 3.0]]) == 0.0
  _, _, e = _seeds_around_common_time()
  e = e + np.random.default_rng(0).normal(0, 0.02, e.shape)
  resid = np.sum((e - e.mean(0)) ** 2)  # total = common + residual
  want = 1 - resid / np.sum((e - e.mean()) ** 2)
  assert freeze.common_time_share(e) == pytest.approx(want, rel=1e-12)
  # A step without a value in one curve drops that step for every seed.
  holed = e.copy()
  holed[1, 7] = nan
  assert freeze.common_time_share(holed) == pytest.approx(
    freeze.common_time_share(np.delete(e, 7, axis=1)), rel=1e-12
  )
  np.testing.assert_allclose(freeze.common_time(e), e.mean(0))
  assert math.isnan(freeze.common_time_share([[0.5, 0.5], [0.5, 0.5]]))
  with pytest.raises(ValueError, match="length"):
    freeze.common_time_share([[0.1, 0.2], [0.1]])


def _corr(a, b):
  return float(np.corrcoef(a, b)[0, 1])


def test_directional_specificity_passes_for_matched_predictions():
  common, dev, e = _seeds_around_common_time()
  noise = np.random.default_rng(1).normal(0, 0.01, e.shape)
  p = common + 0.5 * dev + noise  # each seed's own departure, damped
  s = freeze.directional_specificity(p, e)
  c = e.mean(0)
  want = [_corr(p[k] - c, e[k] - c) for k in range(3)]
  np.testing.assert_allclose(s.correlations, want, rtol=1e-12)
  assert s.specific and min(s.correlations) > 0.5


def test_directional_specificity_fails_for_one_reused_trace():
  common, dev, e = _seeds_around_common_time()
  trace = common + 0.5 * dev[0]  # right for seed 0, reused for all
  s = freeze.directional_specificity(trace, e)
  assert not s.specific
  assert s.correlations[0] > 0.5 and min(s.correlations) < 0
  # The covariances with one fixed p - c sum to zero over the seeds.
  c = e.mean(0)
  covs = [np.cov(trace - c, e[k] - c)[0, 1] for k in range(3)]
  assert abs(sum(covs)) < 1e-12 * max(map(abs, covs))
  # Right for two seeds, wrong for the third: not specific either.
  p = common + 0.5 * dev
  p[2] = common - 0.5 * dev[2]
  s = freeze.directional_specificity(p, e)
  assert not s.specific and s.correlations[2] == pytest.approx(-1.0)
  assert s.correlations[0] == pytest.approx(1.0)
  # The common time course itself has no deviation to correlate.
  s = freeze.directional_specificity(c, e)
  assert all(math.isnan(r) for r in s.correlations) and not s.specific


def test_directional_specificity_errors_and_missing_steps():
  common, dev, e = _seeds_around_common_time()
  with pytest.raises(ValueError, match="two seeds"):
    freeze.directional_specificity(common, e[:1])
  with pytest.raises(ValueError, match="one per seed"):
    freeze.directional_specificity(np.stack([common] * 2), e)
  p = common + 0.5 * dev
  holed = e.copy()
  holed[0, 3] = nan
  got = freeze.directional_specificity(p, holed).correlations
  want = freeze.directional_specificity(
    np.delete(p, 3, axis=1), np.delete(e, 3, axis=1)
  ).correlations
  np.testing.assert_allclose(got, want, rtol=1e-12)


# ---- coordinate audit ------------------------------------------------------


def test_frozen_from_and_events_by_hand():
  erased = np.array(
    [[0, 1, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 0]], bool
  )
  proposed = np.array(
    [[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 0], [1, 1, 1, 0]], bool
  )
  # Col 0: moved at t=0, u == 0 at t=2 does not break: frozen from 1.
  # Col 1: always erased: 0. Col 2: from 2. Col 3: only t=0 proposed: 0.
  np.testing.assert_array_equal(
    freeze.frozen_from(erased, proposed), [1, 0, 2, 0]
  )
  np.testing.assert_array_equal(
    freeze.frozen_from(~erased & proposed, proposed), [-1, -1, -1, -1]
  )
  # Events from a realized trajectory (one more row of w than of u).
  w = np.array([[1.0, 1.0], [1.0, 1.5], [1.0, 1.5]], np.float32)
  u = np.array([[0.001, 0.5], [0.0, 0.001]], np.float32)
  e, p = freeze.measured_events(w, u)
  np.testing.assert_array_equal(e, [[True, False], [False, True]])
  np.testing.assert_array_equal(p, [[True, True], [False, True]])
  # The same from the nearest rule, given the format.
  e2, _ = freeze.measured_events(w[:2], u, "bfloat16")
  np.testing.assert_array_equal(e2, e)
  with pytest.raises(ValueError, match="fmt"):
    freeze.measured_events(w[:2], u)


def test_audit_flags_a_wrong_prediction():
  # Reference weights one binade up (coarser grid) than the realized ones:
  # the same downward proposals are predicted erased (3/8 of the gap below
  # 2) but move in the run (3/4 of the gap below 1).
  w = np.full((3, 2), 1.0, np.float32)
  u = np.full((3, 2), -0.75 * 2.0**-8, np.float32)
  a = freeze.audit_coordinates(2 * w, u, w, u, "bfloat16")
  assert a.agreement == 0.0 and a.confusion["predicted_only"] == 6
  np.testing.assert_array_equal(a.predicted_frozen_from, [0, 0])
  np.testing.assert_array_equal(a.measured_frozen_from, [-1, -1])
  np.testing.assert_array_equal(a.diverged_at, [0, 0])
  assert a.freeze_agreement == 0.0


# ---- scaled (MX) targets ----------------------------------------------------


def _np_mxfp8_e4m3(x):
  """float64 numpy oracle of mxfp8_e4m3 (OCP rule, blocks of 32 along the
  last axis): the scales come from `x` itself."""
  xb = np.asarray(x, np.float64).reshape(*np.shape(x)[:-1], -1, 32)
  amax = np.max(np.abs(xb), axis=-1, keepdims=True)
  with np.errstate(divide="ignore"):
    k = np.where(amax > 0, np.clip(np.floor(np.log2(amax)) - 8, -127, 127), 0)
  e = np.clip(xb / np.exp2(k), -448, 448).astype(ml_dtypes.float8_e4m3fn)
  return (e.astype(np.float64) * np.exp2(k)).reshape(np.shape(x))


def test_scaled_rule_matches_a_numpy_oracle_elementwise():
  # Proposals from a hundredth of the weight to past the block max: some
  # move their block's maximum, and with it every gap of the block.
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 64)) * np.exp2(rng.integers(-6, 3, (64, 1)))
  w = w.astype(np.float32)
  u = w * rng.choice([0.0, 0.003, -0.02, 0.07, 0.4, 3.0], w.shape)
  u = u.astype(np.float32)
  opt = freeze.reference_trace(["mxfp8_e4m3"], at_init=True)
  state = jax.jit(lambda u, w: opt.update(u, opt.init(w), w)[1])(u, w)
  tel = lowprec.telemetry(state)
  q = _np_mxfp8_e4m3(w).astype(np.float32)
  x = (q + u).astype(np.float32)
  erased = (u != 0) & (_np_mxfp8_e4m3(x) == q)
  assert tel["pred/mxfp8_e4m3/proposals"] == int((u != 0).sum())
  assert tel["pred/mxfp8_e4m3/erased"] == int(erased.sum())
  assert 0 < erased.sum() < (u != 0).sum()
  # After one step, still at the initial grid value: all but the moved.
  moved = (u != 0) & ~erased
  assert tel["pred/mxfp8_e4m3/at_init"] == w.size - int(moved.sum())


def test_scaled_move_probability_matches_writeback_monte_carlo():
  """Seed 0, 4096 coordinates, 200 stochastic write-back draws: the
  measured moved share (standard error < 0.0006) matches the predicted
  move probability within 0.003, with proposals up to 15% of each weight
  (a gap is 6-12%), which change the scale of about 10% of the blocks."""
  fmt = "mxfp8_e4m3"
  kw, ku, kk = jax.random.split(jax.random.key(0), 3)
  w = 0.05 * jax.random.normal(kw, (128, 32))
  q = lowprec.to_grid(w, fmt)
  u = jnp.abs(q) * jax.random.uniform(ku, q.shape, minval=-0.15, maxval=0.15)
  opt = freeze.reference_trace([Target(fmt, "stochastic")])
  state = jax.jit(lambda u, w: opt.update(u, opt.init(w), w)[1])(u, q)
  predicted = lowprec.telemetry(state)["pred/mxfp8_e4m3_sr/move_prob"]
  assert 0.3 < predicted < 0.9
  wb = lowprec.writeback(fmt, "stochastic", key=kk)

  def draw(state, _):
    _, state = wb.update(u, state, q)
    return state, (sum(state.moved.values()), sum(state.rescaled.values()))

  run = jax.jit(lambda s: jax.lax.scan(draw, s, None, length=200)[1])
  moved, rescaled = run(jax.jit(wb.init)(q))
  measured = float(jnp.mean(moved)) / int((u != 0).sum())
  assert abs(measured - predicted) < 0.003, (measured, predicted)
  assert float(jnp.mean(rescaled)) > 5  # measured: 13 of 128 blocks a draw


def _mx_mlp_cell(steps=100, lr=2e-2, std=0.1, seed=0):
  """Predicted and measured curves of the MLP cell on mxfp8_e4m3 grids.

  The `_mlp_cell` task and schedule (16-64-64-1 GELU MLP, AdamW, cosine
  from `lr`), with the two kernels whose last axis holds blocks of 32 on
  the mxfp8_e4m3 grid and the rest in float32; nearest write-back
  recomputing the block scales each step.
  """
  rules = [(r"dense_[01]/kernel", "mxfp8_e4m3"), (".*", None)]
  data = _task(seed)
  params = jax.jit(
    lambda k: lowprec.to_grid(_mlp_params(k, [16, 64, 64, 1], std), rules)
  )(jax.random.key(seed + 1))
  inner = optax.adamw(optax.cosine_decay_schedule(lr, steps))
  trace = freeze.reference_trace({"mx": rules})
  ref_logs, _ = _train(optax.chain(inner, trace), params, steps, data)
  lp_logs, _ = _train(
    optax.chain(inner, lowprec.writeback(rules)), params, steps, data
  )
  return ref_logs, lp_logs


def test_mlp_mxfp8_prediction_tracks_the_measured_curve():
  ref, lp = _mx_mlp_cell()
  # Step 1: the same w0 on the grid and the same u0, so the same count.
  assert ref[0]["pred/mx/proposals"] == lp[0]["proposals"]
  assert ref[0]["pred/mx/erased"] == lp[0]["erased"]
  predicted = np.array([r["pred/mx/erased_fraction"] for r in ref])
  measured = np.array([r["erased_fraction"] for r in lp])
  # Early, while the trajectories still agree: within 0.03 (measured
  # largest gap 0.019 over the first 5 steps).
  assert np.max(np.abs(predicted[:5] - measured[:5])) < 0.03
  cell = freeze.compare(predicted, measured)
  assert cell.predicted_category == cell.measured_category == "post_init"
  assert abs(cell.error_steps) <= 4 and cell.rmse < 0.04, cell
  assert ref[-1]["pred/mx/crossing"] == cell.predicted_step

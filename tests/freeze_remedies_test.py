"""The compensated-write-back prediction against numpy and measured runs.

Expected values are recomputed in numpy: roundings by ml_dtypes casts
(nearest, ties to even), the two-sum's error in float64. Nothing below
uses lowprec's rounding to compute an expected value.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lowprec
from lowprec import freeze
from tests.freeze_test import _mlp, _mlp_params  # the same MLP

BF16 = ml_dtypes.bfloat16
E5M2 = ml_dtypes.float8_e5m2
F32 = np.float32

REMEDIES = {
  "kahan_bf16": ("bfloat16", "kahan", "bfloat16"),
  "kahan_e5m2": ("bfloat16", "kahan", "float8_e5m2"),
  "two_component": ("bfloat16", "two_component"),
}
BUFFERS = {"kahan_bf16": BF16, "kahan_e5m2": E5M2, "two_component": BF16}


def _rn(x, dtype=BF16):
  return np.asarray(x, F32).astype(dtype).astype(F32)


class _Oracle:
  """The predicted compensated write-back of one remedy, in numpy."""

  def __init__(self, n, buffer, two_sum):
    self.c = np.zeros(n, F32)
    self.buffer, self.two_sum = buffer, two_sum
    self.frozen = np.ones(n, bool)
    self.went = np.zeros(n, bool)
    self.seen = np.zeros(n, bool)
    self.held = np.zeros(n, bool)

  def step(self, w, u):
    """This step's counts and masses at `q = RN(w)`."""
    q, c = _rn(w), self.c
    drift = np.abs(w.astype(np.float64) - (q.astype(np.float64) + c)).sum()
    y = (u + c).astype(F32)
    s = (q + y).astype(F32)
    new_w = np.where(y != 0, _rn(s), q)
    if self.two_sum:
      t = (q.astype(np.float64) + y - s).astype(F32)  # exact in float32
      r = ((s - new_w).astype(F32) + t).astype(F32)
    else:
      r = (y - (new_w - q).astype(F32)).astype(F32)
    r = np.where(y != 0, r, y)  # y == 0: the buffer empties
    new_c = _rn(r, self.buffer)
    prop, moved = u != 0, new_w != q
    lost = (y != 0) & (r != 0) & (new_c == 0)
    self.frozen &= ~(prop & (_rn(q + u) != q))
    self.went |= moved
    self.seen |= prop
    self.held |= (y != 0) & (new_c != 0)
    self.c = new_c
    frozen = self.seen & self.frozen
    return {
      "proposals": int(prop.sum()),
      "erased": int((prop & ~moved).sum()),
      "moved": int(moved.sum()),
      "lost": int(lost.sum()),
      "nearest_frozen": int(frozen.sum()),
      "late": int((frozen & self.went).sum()),
      "drained": int((self.seen & ~self.went & ~self.held).sum()),
      "carried": np.abs(new_c.astype(np.float64)).sum(),
      "lost_mass": np.abs(np.where(y != 0, r - new_c, 0.0)).sum(),
      "drift": drift,
    }


def _stream(rng, n):
  """float32 weights (some tiny) and proposals from 1/20 of a bf16 gap to
  3 gaps, some zero."""
  w = rng.standard_normal(n).astype(F32)
  w[: n // 8] *= 1e-4  # residuals there fall below e5m2's subnormals
  gap = np.abs(w) * 2.0**-7
  u = gap * rng.uniform(-3, 3, n) * rng.choice([1, 0.05], n)
  u[rng.random(n) < 0.05] = 0.0
  return w, u.astype(F32)


def test_counts_masses_and_buffers_equal_a_numpy_oracle():
  rng = np.random.default_rng(0)
  w, _ = _stream(rng, 3000)
  n = len(w) // 3
  parts = {"a": slice(0, n), "b": slice(n, None)}
  tx = freeze.compensated_trace(REMEDIES)
  params = {k: jnp.asarray(w[p]) for k, p in parts.items()}
  state = tx.init(params)
  update = jax.jit(tx.update)
  oracles = {
    k: _Oracle(len(w), BUFFERS[k], k == "two_component") for k in REMEDIES
  }
  for t in range(4):  # later steps start from nonzero buffers
    _, u = _stream(np.random.default_rng(t + 1), len(w))
    props = {k: jnp.asarray(u[p]) for k, p in parts.items()}
    out, state = update(props, state, params)
    np.testing.assert_array_equal(out["a"], props["a"])  # passes through
    tel = lowprec.telemetry(state)
    for j, (name, o) in enumerate(oracles.items()):
      want = o.step(w, u)
      for k, v in want.items():
        if isinstance(v, int):
          assert tel[f"pred/{name}/{k}"] == v, (t, name, k)
        else:
          assert tel[f"pred/{name}/{k}"] == pytest.approx(v, rel=1e-5), k
      buf = np.concatenate([np.asarray(b, F32) for b in state.buffer[j]])
      np.testing.assert_array_equal(buf, o.c)
      assert state.buffer[j][0].dtype == BUFFERS[name]
      assert tel[f"pred/{name}/erased_fraction"] == pytest.approx(
        want["erased"] / want["proposals"], rel=1e-12
      )
      assert tel[f"pred/{name}/lost_fraction"] == pytest.approx(
        want["lost"] / want["proposals"], rel=1e-12
      )
    assert tel["pred/kahan_e5m2/lost"] > 0  # flushed below 2^-16
    assert tel["pred/kahan_bf16/lost"] < tel["pred/kahan_e5m2/lost"]
    assert tel["pred/kahan_bf16/moved"] > 0
    w = (w + u).astype(F32)  # the float32 reference trajectory
    params = {k: jnp.asarray(w[p]) for k, p in parts.items()}


def test_an_adamw_chain_under_jit_predicts_with_the_documented_arithmetic():
  # As tests/compensated_test.py checks the arms: u from AdamW jitted alone
  # (nothing to fuse it with), the oracle in numpy; the chain's predicted
  # buffers and counts must equal it, though XLA:CPU would fuse AdamW's
  # last multiply with `u + c` (seed 0, 200,000 coordinates, 8 steps).
  n, steps = 200_000, 8
  rng = np.random.default_rng(0)
  w = (0.1 * rng.standard_normal(n)).astype(F32)
  remedies = {k: v for k, v in REMEDIES.items() if k != "kahan_e5m2"}
  adamw = optax.adamw(1e-3, weight_decay=0.1)
  tx = optax.chain(adamw, freeze.compensated_trace(remedies))
  params = {"w": jnp.asarray(w)}
  inner_update, update = jax.jit(adamw.update), jax.jit(tx.update)
  state, inner = tx.init(params), adamw.init(params)
  oracles = {k: _Oracle(n, BF16, k == "two_component") for k in remedies}
  for _ in range(steps):
    g = {"w": jnp.asarray(rng.standard_normal(n).astype(F32))}
    u, inner = inner_update(g, inner, params)
    d, state = update(g, state, params)
    tel = lowprec.telemetry(state[1])
    for j, (name, o) in enumerate(oracles.items()):
      want = o.step(w, np.asarray(u["w"]))
      np.testing.assert_array_equal(np.asarray(state[1].buffer[j][0], F32), o.c)
      for k in ("proposals", "erased", "moved", "lost", "nearest_frozen"):
        assert tel[f"pred/{name}/{k}"] == want[k], (name, k)
    params = optax.apply_updates(params, d)
    w = np.asarray(params["w"])


# ---- constant streams: moved late, and a float8 buffer that freezes ------


def _constant(w0, u0, steps, remedies):
  """Predicted per-step telemetry of a constant stream `u0` from `w0`,
  under jit and scan, and the measured telemetry of each Kahan arm."""
  params = {"w": jnp.full(4, w0, jnp.float32)}
  u = {"w": jnp.full(4, u0, jnp.float32)}
  tx = freeze.compensated_trace(remedies)

  def step(carry, _):
    p, s = carry
    d, s = tx.update(u, s, p)
    return (optax.apply_updates(p, d), s), lowprec.telemetry_arrays(s)

  _, pred = jax.jit(lambda c: jax.lax.scan(step, c, length=steps))(
    (params, tx.init(params))
  )
  measured = {}
  for name, (fmt, _, buf) in remedies.items():
    kahan = lowprec.kahan_writeback(fmt, buffer=buf)
    grid = lowprec.to_grid(params, fmt)

    def step_lp(carry, _, kahan=kahan):
      p, s = carry
      d, s = kahan.update(u, s, p)
      return (optax.apply_updates(p, d), s), lowprec.telemetry_arrays(s)

    _, measured[name] = jax.jit(
      lambda c, f=step_lp: jax.lax.scan(f, c, length=steps)
    )((grid, kahan.init(grid)))
  return jax.device_get(pred), jax.device_get(measured)


def test_a_sub_half_gap_stream_moves_late_under_a_bf16_buffer():
  # 1e-3 below half the bf16 gap at 1 (2^-8): nearest erases every step,
  # the buffer reaches half a gap at the 4th step and the weight moves.
  remedies = {"kb": ("bfloat16", "kahan", "bfloat16")}
  pred, meas = _constant(1.0, 1e-3, 30, remedies)
  moved = pred["pred/kb/moved"]
  assert moved[:3].tolist() == [0, 0, 0] and moved[3] == 4
  assert pred["pred/kb/nearest_frozen"][-1] == 4
  assert pred["pred/kb/late"].tolist() == [0] * 3 + [4] * 27
  assert np.all(pred["pred/kb/late_fraction"][3:] == 1.0)
  assert np.all(pred["pred/kb/lost"] == 0)
  assert np.all(pred["pred/kb/drained"] == 0)
  # The arm's weight stays the reference's grid value: equal counts.
  for k in ("proposals", "erased", "moved", "lost"):
    np.testing.assert_array_equal(pred[f"pred/kb/{k}"], meas["kb"][k], k)


def test_an_e5m2_buffer_loses_what_its_own_gap_erases():
  # At w = 8 half the bf16 gap is 2^-5. An e5m2 buffer's gap at |c| in
  # [2^-6, 2^-5) is 2^-8, so c stops at 2^-6 and each further 1e-3 is
  # rounded away by the buffer itself: lost mass, no lost count (the
  # buffer is not zero), and the weight never moves. A bf16 buffer
  # carries on and moves the weight at step 32 (32e-3 > 2^-5).
  remedies = {
    "kb": ("bfloat16", "kahan", "bfloat16"),
    "ke": ("bfloat16", "kahan", "float8_e5m2"),
  }
  pred, meas = _constant(8.0, 1e-3, 40, remedies)
  assert np.all(pred["pred/ke/moved"] == 0)
  assert pred["pred/ke/nearest_frozen"][-1] == 4
  assert pred["pred/ke/late"][-1] == 0 and pred["pred/ke/drained"][-1] == 0
  assert np.all(pred["pred/ke/lost"] == 0)
  assert pred["pred/ke/carried"][-1] == 4 * 2.0**-6
  np.testing.assert_allclose(pred["pred/ke/lost_mass"][20:], 4e-3, rtol=1e-6)
  # A bf16 buffer's rounding drops at most half its gap, 2^-8 |c'|.
  kb_lost, kb_carried = pred["pred/kb/lost_mass"], pred["pred/kb/carried"]
  assert np.all(kb_lost <= 2.0**-8 * kb_carried)
  first = int(np.argmax(pred["pred/kb/moved"] > 0))
  assert first == 31 and pred["pred/kb/late"][-1] == 4
  # The measured e5m2 arm freezes the same way, losing the same mass.
  assert np.all(meas["ke"]["moved"] == 0)
  np.testing.assert_allclose(
    meas["ke"]["lost_mass"][20:], pred["pred/ke/lost_mass"][20:], rtol=1e-6
  )
  np.testing.assert_array_equal(meas["kb"]["moved"], pred["pred/kb/moved"])


def test_proposals_below_e5m2_subnormals_drain_the_buffer():
  # 1e-6 is below half of e5m2's smallest subnormal (2^-17): the buffer
  # flushes every residual, so a float8 buffer freezes as nearest does.
  remedies = {
    "kb": ("bfloat16", "kahan", "bfloat16"),
    "ke": ("bfloat16", "kahan", "float8_e5m2"),
  }
  pred, meas = _constant(1.0, 1e-6, 10, remedies)
  assert np.all(pred["pred/ke/lost"] == 4)
  assert np.all(pred["pred/ke/lost_fraction"] == 1.0)
  assert np.all(pred["pred/ke/drained"] == 4)
  assert np.all(pred["pred/ke/carried"] == 0)
  assert np.all(pred["pred/kb/drained"] == 0)
  assert pred["pred/kb/carried"][-1] > 0
  np.testing.assert_array_equal(meas["ke"]["lost"], pred["pred/ke/lost"])


def test_a_sign_stream_that_cancels_the_buffer_leaves_no_drift():
  # Lion-like +-2^-10 from 1.0 (seed 0, 1000 steps, 256 coordinates): the
  # float32 reference is exact, so is every residual in a bf16 buffer,
  # and the predicted pair q + c equals the reference at every step,
  # also where a proposal cancels the buffer (y == 0: c' = 0).
  steps, n = 1000, 256
  rng = np.random.default_rng(0)
  us = (rng.choice([-1.0, 1.0], (steps, n)) * 2.0**-10).astype(F32)
  remedies = {k: v for k, v in REMEDIES.items() if k != "kahan_e5m2"}
  tx = freeze.compensated_trace(remedies)

  def step(carry, u):
    p, s = carry
    d, s = tx.update({"w": u}, s, p)
    return (optax.apply_updates(p, d), s), lowprec.telemetry_arrays(s)

  p0 = {"w": jnp.ones(n, jnp.float32)}
  _, curves = jax.jit(lambda c, us: jax.lax.scan(step, c, us))(
    (p0, tx.init(p0)), jnp.asarray(us)
  )
  for name in remedies:
    drift = np.asarray(curves[f"pred/{name}/drift"])
    assert np.all(drift == 0), (name, drift.max() / 2.0**-10)
    assert np.all(np.asarray(curves[f"pred/{name}/lost_mass"]) == 0), name


# ---- an MLP: predicted against measured ---------------------------------

_STEPS = 60


def _run(opt, params, data):
  """`_STEPS` steps of full-batch float32 regression under one jitted
  scan; the telemetry of every step, stacked."""
  x, y = data

  def step(carry, _):
    p, s = carry
    g = jax.grad(lambda p: jnp.mean((_mlp(p, x) - y) ** 2))(p)
    u, s = opt.update(g, s, p)
    return (optax.apply_updates(p, u), s), lowprec.telemetry_arrays(s)

  run = jax.jit(lambda p: jax.lax.scan(step, (p, opt.init(p)), None, _STEPS))
  (_, state), curves = run(params)
  return state, jax.device_get(curves)


@pytest.fixture(scope="module")
def mlp_runs():
  """A 16-32-32-1 GELU MLP on bf16-grid initial weights, AdamW with a
  cosine decay from 1e-3: the float32 run with the prediction, and the
  Kahan runs with bf16 and e5m2 buffers."""
  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (256, 16))
  data = (x, _mlp(_mlp_params(kt, [16, 32, 1], 1.0), x))
  params = lowprec.to_grid(_mlp_params(kp, [16, 32, 32, 1], 0.1), "bfloat16")
  inner = optax.adamw(optax.cosine_decay_schedule(1e-3, _STEPS))
  arms = {k: v for k, v in REMEDIES.items() if k != "two_component"}
  ref_state, pred = _run(
    optax.chain(
      inner,
      freeze.reference_trace(["bfloat16"]),
      freeze.compensated_trace(arms),
    ),
    params,
    data,
  )
  measured = {
    name: _run(
      optax.chain(inner, lowprec.kahan_writeback("bfloat16", buffer=buf)),
      params,
      data,
    )[1]
    for name, (_, _, buf) in arms.items()
  }
  return ref_state, pred, measured


# The MLP runs take about 20 s to compile: slow tests (CI runs them).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["kahan_bf16", "kahan_e5m2"])
def test_mlp_first_step_counts_equal_the_measured_ones(mlp_runs, name):
  # Same initial weights, same first proposal, zero buffer: the same step.
  _, pred, meas = mlp_runs
  for k in ("proposals", "erased", "moved", "lost"):
    assert pred[f"pred/{name}/{k}"][0] == meas[name][k][0], k
  for k in ("carried", "lost_mass"):
    assert pred[f"pred/{name}/{k}"][0] == pytest.approx(
      meas[name][k][0], rel=1e-6
    )
  assert pred[f"pred/{name}/drift"][0] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kahan_bf16", "kahan_e5m2"])
def test_mlp_predicted_curves_follow_the_measured_ones(mlp_runs, name):
  # Measured (seed 0, 60 steps): erased fraction within 0.002 over the
  # first 10 steps and RMSE 0.0035 over the run, for both buffers; lost
  # fraction equal (all 0) with the bf16 buffer, within 0.005 over the
  # first 10 steps and RMSE 0.0065 with the e5m2 buffer (which loses
  # about 10% of the residuals: those of the small weights, below its
  # smallest subnormal). Tolerances: about 3x those.
  _, pred, meas = mlp_runs
  p = pred[f"pred/{name}/erased_fraction"]
  m = meas[name]["erased_fraction"]
  assert np.max(np.abs(p[:10] - m[:10])) < 0.01, (p[:10], m[:10])
  assert np.sqrt(np.mean((p - m) ** 2)) < 0.01
  assert p[-1] > 0.5 and m[-1] > 0.5  # the cosine decay's freeze is there
  lp = pred[f"pred/{name}/lost_fraction"]
  lm = meas[name]["lost"] / meas[name]["proposals"]
  assert np.max(np.abs(lp[:10] - lm[:10])) < 0.015, (lp[:10], lm[:10])
  assert np.sqrt(np.mean((lp - lm) ** 2)) < 0.02
  if name == "kahan_bf16":
    assert np.all(lp == 0) and np.all(lm == 0)
  else:
    assert np.all(lp[:10] > 0.05)


@pytest.mark.slow
def test_mlp_host_report_equals_the_arrays(mlp_runs):
  state, pred, _ = mlp_runs
  host = lowprec.telemetry(state)
  arrays = jax.device_get(lowprec.telemetry_arrays(state))
  assert {k for k in host if k.startswith("pred/kahan")} == {
    k for k in arrays if k.startswith("pred/kahan")
  }
  for k, v in arrays.items():
    if k.startswith("pred/kahan"):
      np.testing.assert_allclose(host[k], v, rtol=1e-6, err_msg=k)
      np.testing.assert_allclose(pred[k][-1], v, rtol=1e-6, err_msg=k)
  assert host["pred/kahan_bf16/erased_fraction/dense_0/kernel"] >= 0
  assert "pred/kahan_e5m2/late/dense_2/bias" in host


# ---- names, errors ------------------------------------------------------


def test_default_names_and_spec_forms():
  tx = freeze.compensated_trace(
    [
      ("bfloat16", "kahan", "float8_e5m2"),
      freeze.Remedy("bfloat16", "two_component"),
      ("float16", "kahan"),
    ]
  )
  state = tx.init({"w": jnp.ones(3)})
  assert state.layout.targets == (
    "bfloat16_kahan_float8_e5m2",
    "bfloat16_two_component",
    "float16_kahan_bfloat16",
  )
  assert freeze.remedy_name("bfloat16", "kahan", "bfloat16") == (
    "bfloat16_kahan_bfloat16"
  )
  one = freeze.compensated_trace(("bfloat16", "two_component"))
  assert one.init({"w": jnp.ones(3)}).layout.targets == (
    "bfloat16_two_component",
  )
  rules = [(".*bias", None), (".*", "bfloat16")]
  tx = freeze.compensated_trace({"k": (rules, "kahan", "bfloat16")})
  p = {"bias": jnp.ones(2), "kernel": jnp.ones(3)}
  state = tx.init(p)
  _, state = tx.update(p, state, p)
  assert lowprec.telemetry(state)["pred/k/proposals"] == 3


@pytest.mark.parametrize(
  "spec, match",
  [
    ([], "at least one remedy"),
    ({"a": ("bfloat16", "remainder")}, "not one of"),
    ({"a": ("bfloat16", "kahan", "float64")}, "wider than float32"),
    (
      {"a": ("bfloat16", "kahan", lowprec.get_format("int8", scale=1.0))},
      "integer grid",
    ),
    ({"a": ("bfloat16", "two_component", "bfloat16")}, "only 'kahan'"),
    ({"a": "bfloat16"}, r"is a string.*\('bfloat16', 'kahan', 'bfloat16'\)"),
    ({"a": 3}, "not a Remedy or a tuple"),
    ({"a": ("bfloat16", "kahan", None)}, "needs a buffer format"),
    ({"a/b": ("bfloat16", "kahan")}, "no '/'"),
    ([([(".*", "bfloat16")], "kahan")], "needs a name"),
    ("bfloat16:kahan", r"^remedy 'bfloat16:kahan' is a string.*"
     r"\('bfloat16', 'kahan'\)$"),
    (["bfloat16:kahan:float8_e5m2"], r"is a string.*\('bfloat16', 'kahan', "
     r"'float8_e5m2'\)"),
    ({"a": ("bfloat16", "kahan", "int8")}, "integer grid.*'bfloat16'"),
    ({"a": ("bfloat16", "kahan", "int8:0.5")}, "integer grid.*'bfloat16'"),
    ({"a": ("mxfp8_e4m3", "kahan")}, "scaled format.*'float8_e4m3fn'"),
  ],
  ids=[
    "empty", "kind", "wide", "int", "buffer", "bare", "number", "none",
    "slash",
    "rules", "string", "string-in-list", "int8", "int8-colon", "mx",
  ],
)  # fmt: skip
def test_errors_name_the_fix(spec, match):
  with pytest.raises(ValueError, match=match):
    freeze.compensated_trace(spec)


def test_update_errors():
  int4 = lowprec.get_format("int4", scale=0.125)
  tx = freeze.compensated_trace({"t": (int4, "two_component")})
  with pytest.raises(ValueError, match="floating-point grid"):
    tx.init({"w": jnp.ones(3)})
  tx = freeze.compensated_trace({"t": ("bfloat16", "kahan")})
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="needs params"):
    tx.update({"w": jnp.ones(3)}, state)


def test_a_plain_view_is_refused_with_the_fix():
  tx = optax.chain(optax.sgd(0.1), freeze.compensated_trace(REMEDIES))
  p = {"w": jnp.ones(3)}
  _, state = tx.update(p, tx.init(p), p)
  view = {"1": {k: v for k, v in state[1]._asdict().items() if k != "layout"}}
  with pytest.raises(ValueError, match="compensated_trace at '1'"):
    lowprec.telemetry(view)

"""`progress_trace` and `forward_cost`: what a grid costs, in nats,
against float64 numpy and ml_dtypes oracles."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lowprec

F32 = np.float32
GRIDS = {
  "bfloat16": ml_dtypes.bfloat16,
  "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}


def _params():
  ks = jax.random.split(jax.random.key(0), 2)
  return {
    "h": {"kernel": 0.1 * jax.random.normal(ks[0], (32, 16))},
    "ln": {"scale": 1.0 + 0.01 * jax.random.normal(ks[1], (16,))},
  }


def _on(x, name):
  """Nearest rounding onto the grid, ml_dtypes' cast (saturating: the
  values here are far inside the range)."""
  return np.asarray(x, F32).astype(GRIDS[name]).astype(F32)


def test_lost_progress_is_minus_g_u_over_the_erased_proposals():
  # Seed 0, three AdamW steps on two leaves: each step's per-leaf sums
  # of -g u, in total and over the proposals nearest rounding would
  # erase (ml_dtypes' cast, at the grid value of w), in float64, equal
  # the trace's to float32 summation (rtol 1e-5); the updates are
  # AdamW's own, bit for bit.
  params = _params()
  tx = lowprec.freeze.progress_trace(optax.adamw(3e-3), list(GRIDS))
  plain = optax.adamw(3e-3)
  st, ps = tx.init(params), plain.init(params)
  for i in range(3):
    g = jax.tree.map(lambda p, i=i: jnp.cos(p * 40.0 + i), params)
    u, st = jax.jit(tx.update)(g, st, params)
    u_plain, ps = jax.jit(plain.update)(g, ps, params)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_plain), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rep = lowprec.telemetry(st)
    for path in ("h/kernel", "ln/scale"):
      top, leaf = path.split("/")
      w = np.asarray(params[top][leaf], F32)
      gv = np.asarray(g[top][leaf], np.float64)
      uv = np.asarray(u[top][leaf], F32)
      gain = -gv * uv.astype(np.float64)
      np.testing.assert_allclose(
        rep[f"progress/total/{path}"], gain.sum(), rtol=1e-5
      )
      for name in GRIDS:
        q = _on(w, name)
        erased = (uv != 0) & (_on(q + uv, name) == q)
        want = gain[erased].sum()
        got = rep[f"progress/{name}/lost/{path}"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)
    params = optax.apply_updates(params, u)
  # e4m3 erases more than bfloat16 here: the test sees both cases.
  assert rep["progress/float8_e4m3fn/lost"] > rep["progress/bfloat16/lost"]


def test_forward_cost_nearest_is_the_loss_of_the_rounded_group():
  params = _params()
  c = jnp.float32(0.03)
  loss = jax.jit(
    lambda p: (
      jnp.sum((p["h"]["kernel"] - c) ** 2)
      + jnp.sum((p["ln"]["scale"] - 1) ** 2)
    )
  )
  got = lowprec.freeze.forward_cost(loss, params, list(GRIDS), draws=0)
  base = float(loss(params))
  for name in GRIDS:
    rounded = dict(
      params, ln={"scale": jnp.asarray(_on(params["ln"]["scale"], name))}
    )
    assert got["norms"][name].mean == float(loss(rounded)) - base
    rounded = dict(
      params, h={"kernel": jnp.asarray(_on(params["h"]["kernel"], name))}
    )
    assert got["other"][name].mean == float(loss(rounded)) - base
    assert got["other"][name].draws == 1 and got["other"][name].se == 0.0


def test_forward_cost_of_stochastic_rounding_is_its_variance_on_a_quadratic():
  # loss = sum (w - c)^2: an unbiased rounding adds its variance,
  # sum (hi - w)(w - lo), to the loss in expectation (float64 from the
  # ml_dtypes grid neighbours). Seed 1, 64 draws: the mean is within 4
  # standard errors of it.
  params = {
    "h": {"kernel": 0.1 * jax.random.normal(jax.random.key(2), (64, 64))}
  }
  loss = jax.jit(lambda p: jnp.sum((p["h"]["kernel"] - 0.01) ** 2))
  got = lowprec.freeze.forward_cost(
    loss, params, ["float8_e4m3fn"], key=jax.random.key(1), draws=64
  )["other"]["float8_e4m3fn_sr"]
  w = np.asarray(params["h"]["kernel"], np.float64)
  codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
  grid = np.unique(codes.astype(np.float64)[np.isfinite(codes.astype(F32))])
  hi = grid[np.searchsorted(grid, w, side="left")]
  lo = grid[np.searchsorted(grid, w, side="right") - 1]
  want = np.sum((hi - w) * (w - lo))  # 0 where w is on the grid
  assert got.draws == 64 and got.se > 0
  assert abs(got.mean - want) < 4 * got.se, (got, want)


def test_bad_input_names_the_fix():
  with pytest.raises(ValueError, match="needs targets"):
    lowprec.freeze.progress_trace(optax.sgd(0.1), [])
  with pytest.raises(ValueError, match="needs a key"):
    lowprec.freeze.forward_cost(lambda p: 0.0, _params(), ["bfloat16"])
  tx = lowprec.freeze.progress_trace(optax.sgd(0.1), ["bfloat16"])
  with pytest.raises(ValueError, match="needs them"):
    tx.update(_params(), tx.init(_params()))

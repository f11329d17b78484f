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


def _trained(steps=4):
  """Four AdamW steps with a progress trace last in the chain: params,
  state, and the numpy oracle's erased displacement per grid and leaf
  (ml_dtypes' cast, at the grid value of each step's w), added in
  float32 in step order as the trace adds them."""
  params = _params()
  tx = optax.chain(
    optax.adamw(3e-3), lowprec.freeze.progress_trace(list(GRIDS))
  )
  st = tx.init(params)
  want = {
    name: {
      p: np.zeros(params[p.split("/")[0]][p.split("/")[1]].shape, F32)
      for p in PATHS
    }
    for name in GRIDS
  }
  for i in range(steps):
    g = jax.tree.map(lambda p, i=i: jnp.cos(p * 40.0 + i), params)
    u, st = jax.jit(tx.update)(g, st, params)
    for path in PATHS:
      top, leaf = path.split("/")
      w = np.asarray(params[top][leaf], F32)
      uv = np.asarray(u[top][leaf], F32)
      for name in GRIDS:
        q = _on(w, name)
        erased = (uv != 0) & (_on(q + uv, name) == q)
        want[name][path] = want[name][path] + np.where(erased, uv, F32(0))
    params = optax.apply_updates(params, u)
  return params, st, want


PATHS = ("h/kernel", "ln/scale")


def test_progress_trace_adds_up_the_proposals_each_grid_erases():
  # Seed 0, four AdamW steps on two leaves: the trace's displacement per
  # grid and leaf is the oracle's sum of the erased proposals bit for
  # bit, and the telemetry's norms are its norms (float64, rtol 1e-5).
  params, st, want = _trained()
  trace = st[1]
  rep = lowprec.telemetry(st)
  for name in GRIDS:
    for path in PATHS:
      got = np.asarray(trace.displaced[name][path])
      np.testing.assert_array_equal(got, want[name][path])
      np.testing.assert_allclose(
        rep[f"progress/{name}/displaced/{path}"],
        np.sqrt(np.sum(want[name][path].astype(np.float64) ** 2)),
        rtol=1e-5,
      )
  # e4m3 erases more than bfloat16 here, and bfloat16 something: the
  # test sees both cases.
  e4m3 = sum(np.abs(want["float8_e4m3fn"][p]).sum() for p in PATHS)
  bf16 = sum(np.abs(want["bfloat16"][p]).sum() for p in PATHS)
  assert e4m3 > bf16 > 0


def test_lost_cost_is_the_loss_without_the_erased_proposals_on_the_grid():
  params, st, want = _trained()
  loss = jax.jit(
    lambda p: (
      jnp.sum((p["h"]["kernel"] - 0.03) ** 2)
      + jnp.sum((p["ln"]["scale"] - 1) ** 2)
    )
  )
  got = lowprec.freeze.lost_cost(loss, params, st)
  base = float(loss(params))
  for name in GRIDS:
    for group, (top, leaf) in (
      ("other", ("h", "kernel")),
      ("norms", ("ln", "scale")),
    ):
      moved = np.asarray(params[top][leaf], F32) - np.asarray(
        st[1].displaced[name][f"{top}/{leaf}"], F32
      )
      other = dict(params, **{top: {leaf: jnp.asarray(_on(moved, name))}})
      assert got[group][name].mean == float(loss(other)) - base
      assert got[group][name].draws == 1


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
    lowprec.freeze.progress_trace([])
  with pytest.raises(ValueError, match="needs a key"):
    lowprec.freeze.forward_cost(lambda p: 0.0, _params(), ["bfloat16"])
  tx = lowprec.freeze.progress_trace(["bfloat16"])
  with pytest.raises(ValueError, match="needs them"):
    tx.update(_params(), tx.init(_params()))
  with pytest.raises(ValueError, match="holds 0"):
    lowprec.freeze.lost_cost(
      lambda p: 0.0, _params(), optax.sgd(0.1).init(_params())
    )

"""ops.ScaledDense: block-scaled GEMMs of a recipe, read use by use.

Oracles: `jax.grad` of the plain `x @ W + b` (no rounding, or inputs exact
on the grid), a float64 numpy / ml_dtypes MX quantizer for the block
orientations, and Monte Carlo (`audit.verify`) for the predictions.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from experiments import block_checks
from lowprec import audit, ops, policy, scaled
from lowprec import nn as lpnn
from lowprec.backward.ops.scaled_dense import (
  ScaledDense,
  hadamard_matrix,
  random_hadamard,
  recipe,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "sdense.in@dw=requantized,sdense.kernel@dx=requantized"
REUSE = "sdense.in@dw=rounded,sdense.kernel@dx=rounded"  # the reference


def _plain_grads(x, w, b, c):
  return jax.grad(lambda x, w, b: jnp.sum(c * (x @ w + b)), (0, 1, 2))(x, w, b)


def _grads(op, x, w, b, c, policy=None, key=0):
  def f(x, w, b):
    return jnp.sum(c * op(x, w, b, policy=policy, key=jax.random.key(key)))

  return jax.grad(f, (0, 1, 2))(x, w, b)


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape)


# ---- oracles: no rounding, exact inputs -------------------------------------


@pytest.mark.parametrize("hadamard", [0, 16])
def test_without_rounding_it_is_the_plain_dense_layer(hadamard):
  x, w = _normal(0, (4, 16, 32)), _normal(1, (32, 48), 0.1)
  b, c = _normal(2, (48,)), _normal(3, (4, 16, 48))
  got = _grads(ScaledDense(hadamard=hadamard), x, w, b, c)
  want = _plain_grads(x, w, b, c)
  for g, r in zip(got, want, strict=True):
    # The Hadamard transform is orthogonal: the weight gradient moves by
    # float32 roundoff only.
    np.testing.assert_allclose(
      g, r, rtol=0, atol=2e-6 * float(jnp.abs(r).max())
    )


@pytest.mark.parametrize("rule", ["ocp", "noclip"])
@pytest.mark.parametrize("blocks", ["1d", "2d"])
def test_inputs_on_every_grid_give_the_plain_gradients_bit_for_bit(
  rule, blocks
):
  # Small integers are exact in e4m3 under any power-of-two scale that
  # keeps the block's largest one below 448, in every orientation.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(-8, 9, (64, 64)), jnp.float32)
  w = jnp.asarray(rng.integers(-8, 9, (64, 32)), jnp.float32)
  c = jnp.asarray(rng.integers(-8, 9, (64, 32)), jnp.float32)
  b = jnp.zeros(32)
  op = ScaledDense.mxfp8(rule=rule, kernel_blocks=blocks)
  got = _grads(op, x, w, b, c, policy=RECIPE)
  for g, r in zip(got, _plain_grads(x, w, b, c), strict=True):
    assert np.array_equal(np.asarray(g), np.asarray(r))


def _mx_e4m3_oracle(a: np.ndarray, rule: str) -> np.ndarray:
  """Nearest MXFP8 (e4m3) of each row of `a` (blocks = rows), float64
  scales from the definition, elements cast by ml_dtypes."""
  amax = np.abs(a).max(axis=-1, keepdims=True)
  e = np.floor(np.log2(np.where(amax > 0, amax, 1.0)))
  if rule == "noclip":
    e = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 448.0)) + 8
  scale = 2.0 ** (e - 8)
  q = np.clip(a / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  return q.astype(np.float64) * scale


@pytest.mark.parametrize("rule", ["ocp", "noclip"])
def test_block_orientations_match_a_numpy_oracle(rule):
  x = np.asarray(_normal(4, (32, 64)), np.float64)
  w = np.asarray(_normal(5, (64, 64)), np.float64)
  op = ScaledDense.mxfp8(rule=rule, grad=None, grad_dw=None)
  y = op(jnp.float32(x), jnp.float32(w), None)
  xq = _mx_e4m3_oracle(x.reshape(32, 2, 32), rule).reshape(32, 64)
  # The kernel is blocked along K: columns of 32.
  wq = _mx_e4m3_oracle(w.T.reshape(64, 2, 32), rule).reshape(64, 64).T
  np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-5)
  # Square tiles: one scale per 32 x 32 tile, from the tile's amax.
  tiles = w.reshape(2, 32, 2, 32).transpose(0, 2, 1, 3).reshape(2, 2, 1024)
  wt = _mx_e4m3_oracle(tiles, rule).reshape(2, 2, 32, 32)
  wt = wt.transpose(0, 2, 1, 3).reshape(64, 64)
  y2 = ScaledDense.mxfp8(
    rule=rule, grad=None, grad_dw=None, kernel_blocks="2d"
  )(jnp.float32(x), jnp.float32(w), None)
  np.testing.assert_allclose(y2, xq @ wt, rtol=1e-5, atol=1e-5)


def _along_tokens(a: np.ndarray, rule: str) -> np.ndarray:
  """`_mx_e4m3_oracle` of `a [M, C]` with blocks of 32 along M (columns)."""
  m, c = a.shape
  cols = a.T.reshape(c, m // 32, 32)
  return _mx_e4m3_oracle(cols, rule).reshape(c, m).T


@pytest.mark.parametrize("rule", ["ocp", "noclip"])
def test_the_weight_gradient_blocks_x_and_dy_along_the_tokens(rule):
  # dW = Q(x)^T Q(dy), both quantized along M, the axis the weight
  # gradient contracts. Each row of x and dy has its own magnitude
  # (2^-6 .. 2^6), so a block along M holds 32 magnitudes and one along
  # K or N a single one: blocked along the wrong axis, dW differs by the
  # quantization error itself (about 2^-4 relative), not by roundoff.
  rng = np.random.default_rng(7)
  m, k, n = 64, 32, 32
  rows = 2.0 ** rng.integers(-6, 7, (m, 1))
  x = (rng.standard_normal((m, k)) * rows).astype(np.float32)
  dy = (rng.standard_normal((m, n)) * rows[::-1]).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  op = ScaledDense.mxfp8(rule=rule, grad=None)
  _, dw, _ = _grads(op, x, w, jnp.zeros(n), dy, policy=RECIPE)
  xq = _along_tokens(x.astype(np.float64), rule)
  gq = _along_tokens(dy.astype(np.float64), rule)
  want = xq.T @ gq
  # float32 accumulation of 64 exact products: roundoff of the sum only.
  bound = 64 * 2.0**-24 * (np.abs(xq.T) @ np.abs(gq))
  assert np.all(np.abs(np.asarray(dw, np.float64) - want) <= bound)
  assert not np.allclose(xq, x) and not np.allclose(gq, dy)  # it rounds


def test_ocp_floor_scales_saturate_what_rounded_up_scales_keep():
  # A block whose largest value is 1.9 * 2^k: the floor rule's grid tops
  # out at 448 * 2^(k-8) = 1.75 * 2^k, so it saturates; rounding up does not.
  x = jnp.full((1, 32), 0.5).at[0, 0].set(1.9)
  floor = scaled.fake_quantize(x, scaled.get_scaled_format("mxfp8_e4m3"))
  up = scaled.fake_quantize(
    x, scaled.get_scaled_format("mxfp8_e4m3", rule="noclip")
  )
  assert float(floor[0, 0]) == 1.75 and float(up[0, 0]) == 1.875


# ---- what each read gives ---------------------------------------------------


def test_square_tiles_give_the_data_gradient_the_forward_copy():
  x, w = _normal(6, (64, 32)), _normal(7, (32, 48), 0.1)
  b, c = jnp.zeros(48), _normal(8, (64, 48))
  two = ScaledDense.nvfp4(kernel_blocks="2d")
  one = ScaledDense.nvfp4(kernel_blocks="1d")
  for op, same in ((two, True), (one, False)):
    req = _grads(op, x, w, b, c, policy=RECIPE)
    fwd = _grads(
      op, x, w, b, c,
      policy="sdense.in@dw=requantized,sdense.kernel@dx=rounded",
    )  # fmt: skip
    assert np.array_equal(req[0], fwd[0]) == same
    assert np.array_equal(req[1], fwd[1])  # the weight gradient: same reads


def test_weights_on_the_2d_grid_are_their_own_copies_in_both_orientations():
  # Weights stored on the 2D grid (as a write-back without a master would
  # keep them): the forward's rounding, the data gradient's re-quantization
  # and the original are one array. On a 1D grid along K they are not.
  tiled = scaled.get_scaled_format("mxfp8_e4m3", block=16)
  w = _normal(9, (32, 32)).reshape(2, 16, 2, 16).transpose(0, 2, 1, 3)
  w = scaled.fake_quantize(
    w.reshape(2, 2, 256), scaled.get_scaled_format("mxfp8_e4m3", block=256)
  )
  w = w.reshape(2, 2, 16, 16).transpose(0, 2, 1, 3).reshape(32, 32)
  x, c, b = _normal(10, (16, 32)), _normal(11, (16, 32)), jnp.zeros(32)

  def dx(op, w, value):
    pol = f"sdense.in@dw=rounded,sdense.kernel@dx={value}"
    return _grads(op, x, w, b, c, policy=pol)[0]

  two = ScaledDense(kernel=tiled, kernel_blocks="2d")
  got = {v: dx(two, w, v) for v in ("rounded", "requantized", "original")}
  assert np.array_equal(got["rounded"], got["requantized"])
  assert np.array_equal(got["rounded"], got["original"])
  one = ScaledDense(kernel=tiled)
  w1 = scaled.fake_quantize(
    w, scaled.get_scaled_format("mxfp8_e4m3", block=16, axis=0)
  )
  assert np.array_equal(dx(one, w1, "rounded"), dx(one, w1, "original"))
  assert not np.array_equal(dx(one, w1, "rounded"), dx(one, w1, "requantized"))


def test_hadamard_matrix_is_orthogonal_and_the_transform_cancels():
  h = hadamard_matrix(16)
  np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
  a, c = _normal(12, (64, 8)), _normal(13, (64, 5))
  s = jnp.where(jax.random.bernoulli(jax.random.key(1), 0.5, (16,)), 1.0, -1.0)
  np.testing.assert_allclose(
    random_hadamard(a, s, 16).T @ random_hadamard(c, s, 16), a.T @ c,
    rtol=1e-5, atol=1e-5,
  )  # fmt: skip


# ---- predictions, verified by Monte Carlo -----------------------------------

X = _normal(20, (64, 32))
W = _normal(21, (32, 32), 0.1)
B = jnp.zeros(32)
SR16 = block_checks.SR16
# The one prediction that does not hold: MXFP8's copy along N is another
# rounding in general, but with power-of-two scales rounded up it differs
# only at elements below e4m3's normal range for one of the two block
# scales (below about 2^-14 of a block's largest): under float32 roundoff here.
DOES_NOT_HOLD = "W in 1x32 blocks, re-quantized along N (two copies)"


@pytest.mark.parametrize(
  "choice", block_checks.CHOICES, ids=lambda c: c.name.replace(" ", "_")
)
def test_monte_carlo_verifies_the_predictions_of_every_recipe_choice(choice):
  # Seed 0, 256 forward draws, |z| >= 4 biased (audit.verify).
  r = block_checks.check(choice, 256, jax.random.key(7), rms=False)
  assert r.predicted == choice.predicted
  if choice.name == DOES_NOT_HOLD:
    assert r.verdict == "exact" and not r.agrees
  else:
    assert r.agrees, str(r.verification)


def test_hadamard_keeps_the_mean_and_lowers_the_variance():
  # Seed 0, 512 backward draws on one forward (x not rounded), x with one
  # outlier per 16 rows: the transform spreads it over the block.
  rng = np.random.default_rng(0)
  x = rng.standard_normal((128, 32))
  x[::16] *= 20.0
  x, c = jnp.float32(x), _normal(31, (128, 32))
  exact = x.T @ c

  def draws(hadamard):
    op = ScaledDense(grad_dw=SR16, x_dw=SR16, hadamard=hadamard)
    pol = "sdense.in@dw=requantized,sdense.kernel@dx=rounded"

    def dw(k):
      f = lambda w: jnp.sum(c * op(x, w, None, policy=pol, key=k))
      return jax.grad(f)(W)

    return jax.vmap(dw)(jax.random.split(jax.random.key(5), 512))

  with_h, without = draws(16), draws(0)
  for d in (with_h, without):
    # Unbiased: the mean's error is within 5 standard errors everywhere.
    se = d.std(0) / np.sqrt(d.shape[0])
    assert float(jnp.max(jnp.abs(d.mean(0) - exact) / se)) < 5.0
  var = lambda d: float(jnp.mean(jnp.sum((d - exact) ** 2, (1, 2))))
  assert var(with_h) < 0.8 * var(without)  # measured 0.63


def test_the_derived_table_of_the_forward_is_the_operator_table():
  def fwd(x, w, read):
    return read("sdense.in@dw", x) @ read("sdense.kernel@dx", w)

  mirror = ops.Custom(
    "block_mirror", fwd, args=("x", "kernel"),
    saved={"sdense.in": "nvfp4", "sdense.kernel": "float8_e4m3fn"},
    uses=("sdense.in@dw", "sdense.kernel@dx"),
  )  # fmt: skip
  d = audit.derive(mirror, (X, W), jax.random.key(0), n_forward=64)
  assert d.agrees
  for got, want in zip(d.table, ScaledDense.table, strict=True):
    assert (got.use, got.must_read, got.linear, got.feeds) == (
      want.use, want.must_read, want.linear, want.feeds,
    )  # fmt: skip


# ---- bad input ---------------------------------------------------------------


@pytest.mark.parametrize(
  "make, call, match",
  [
    (lambda: ScaledDense.nvfp4(), ((64, 24), (24, 32)), "multiple of 16"),
    (lambda: ScaledDense(hadamard=32), ((16, 32), (32, 32)), "hadamard=32"),
    (lambda: ScaledDense.mxfp8(), ((64, 32), (32, 48)), "multiple of 32"),
    (lambda: ScaledDense(kernel_blocks="3d"), None, "kernel_blocks"),
    (
      lambda: ScaledDense.mxfp8(),
      ((32, 64), (32, 32)),
      r"x \(32, 64\) and kernel \(32, 32\) do not contract.*\[64, N\]",
    ),
    (lambda: ScaledDense(x="mxfp8"), None, "also valid here: mxfp8_e4m3"),
    (lambda: ScaledDense(grad="nvfp5"), None, r"mxfp4_e2m1, nvfp4"),
    (lambda: ScaledDense(hadamard=12), None, "power of two"),
    (lambda: recipe("nvfp8"), None, "nvfp4"),
    (lambda: recipe("nvfp4", "kernel_blocks"), None, "field=value"),
    (lambda: recipe("nvfp4", "rule=ocp"), None, "recipe field"),
  ],
)
def test_bad_input_is_answered_with_the_fix(make, call, match):
  with pytest.raises(ValueError, match=match):
    op = make()
    xs, ws = call
    op(jnp.ones(xs), jnp.ones(ws), None, key=jax.random.key(0),
       policy=RECIPE)  # fmt: skip


def test_the_reference_checks_the_contraction_before_it_multiplies():
  with pytest.raises(ValueError, match=r"K = 48\) must equal"):
    ScaledDense.mxfp8().reference(jnp.ones((32, 48)), jnp.ones((32, 32)))


@pytest.mark.parametrize(
  "make, top", [(ScaledDense.mxfp8, 1.75), (ScaledDense.nvfp4, 1.0)]
)
def test_an_infinite_operand_is_saturated_and_counted(make, top):
  # The formats put inf on their grid (a block of ones around it keeps
  # 1.75 in MXFP8, 1.0 in NVFP4): y is finite where x @ W is not, and
  # the telemetry counts what the rounding hid, under jit.
  op = make()
  x = jnp.ones((32, 32)).at[3, 5].set(jnp.inf)
  w = jnp.ones((32, 32)).at[0, 1].set(-jnp.inf).at[2, 2].set(jnp.nan)
  y = op(x, jnp.ones((32, 32)), None, key=jax.random.key(0))
  assert bool(jnp.isinf((x @ jnp.ones((32, 32)))[3]).all())
  assert bool(jnp.isfinite(y).all())
  assert float(y[3, 0]) == 31 + top  # 31 ones and the saturated inf
  tel = jax.jit(op.telemetry)(x, w)
  assert {k: int(v) for k, v in tel.items()} == {
    "nonfinite": 3,
    "nonfinite/x": 1,
    "nonfinite/kernel": 2,
  }
  clean = op.telemetry(jnp.ones((32, 32)), jnp.ones((32, 32)))
  assert int(clean["nonfinite"]) == 0


def test_requantized_is_refused_by_operators_that_cannot_read_it():
  with pytest.raises(ValueError, match="block-scaled operators"):
    ops.Dense().resolve("dense.in@dw=requantized,dense.kernel@dx=rounded")
  assert "requantized" in policy.VALUES


# ---- in users' code ---------------------------------------------------------


def test_a_linen_model_trains_with_the_recipe_in_numerics():
  import flax.linen as fnn
  import optax

  num = lpnn.Numerics(
    policy=ops.REFERENCE.override(RECIPE), compute=ScaledDense.nvfp4()
  )

  class Net(fnn.Module):
    @fnn.compact
    def __call__(self, x):
      h = jax.nn.gelu(lpnn.Dense(64, numerics=num)(x))
      return lpnn.Dense(16, numerics=num)(h)

  x = _normal(40, (32, 32))
  y = _normal(41, (32, 16))
  net = Net()
  params = net.init(jax.random.key(0), x)
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, k):
    def loss(p):
      return jnp.mean((net.apply(p, x, rngs={"lowprec": k}) - y) ** 2)

    val, g = jax.value_and_grad(loss)(params)
    upd, opt = tx.update(g, opt)
    return optax.apply_updates(params, upd), opt, val

  losses = []
  for i in range(60):
    params, opt, val = step(params, opt, jax.random.key(i))
    losses.append(float(val))
  assert losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_one_and_eight_devices_train_the_same_bits(tmp_path):
  def run(devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    out = tmp_path / str(devices)
    p = subprocess.run(
      [sys.executable, "-m", "experiments.run",
       "--config=configs/fp4_recipe.py:scale=smoke,arm=nvfp4_all",
       f"--config.log.results_dir={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    d = out / "fp4_recipe" / "nvfp4_all" / "seed0"
    summary = json.loads((d / "summary.json").read_text())
    return summary["param_digest"], (d / "metrics.jsonl").read_text()

  one, eight = run(1), run(8)
  assert one[0] == eight[0]

  def records(text):
    return [json.loads(line) for line in text.splitlines()]

  def training(r):
    keep = ("step", "loss", "val_loss", "grad_norm")
    return {k: v for k, v in r.items() if k in keep}

  def probe(r):
    return {k: v for k, v in r.items() if k.startswith("probe/")}

  # The training bits are equal. The gradient probe's are not: it takes
  # the gradient of its whole batch in one pass, and XLA:CPU splits a
  # matmul with a small output and a long contraction (the 64 x 64 kernel
  # gradients over the batch's tokens) across threads in a way that
  # depends on the number of host devices (docs/scaling.md). They agree to
  # float32 rounding.
  ones, eights = records(one[1]), records(eight[1])
  assert [training(r) for r in ones] == [training(r) for r in eights]
  probes_1, probes_8 = [probe(r) for r in ones], [probe(r) for r in eights]
  assert [sorted(r) for r in probes_1] == [sorted(r) for r in probes_8]
  assert any(probes_1), "no probe statistics"
  for a, b in zip(probes_1, probes_8, strict=True):
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-9, err_msg=k)


@pytest.mark.parametrize("fmt", ["mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"])
def test_narrow_mx_formats_round_each_operand_along_its_contraction_axis(fmt):
  x, w = _normal(50, (32, 64)), _normal(51, (64, 32))
  y = ScaledDense(x=fmt, kernel=fmt)(x, w, None)
  f = scaled.get_scaled_format(fmt)
  want = scaled.fake_quantize(x, f) @ scaled.fake_quantize(
    w, scaled.get_scaled_format(f, axis=0)
  )
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


# ---- in users' own modules: NNX, Equinox, plain JAX ------------------------


def _plain_mlp_loss(params, x, y, key):
  """The two-layer model in plain JAX: the oracle for the modules below."""
  op = ScaledDense.nvfp4()
  pol = ops.REFERENCE.override(RECIPE)
  (w1, b1), (w2, b2) = params
  k1, k2 = jax.random.split(key)
  h = jax.nn.gelu(op(x, w1, b1, key=k1, policy=pol))
  return jnp.mean((op(h, w2, b2, key=k2, policy=pol) - y) ** 2)


def _mlp_data():
  x = _normal(50, (32, 32))
  return x, jnp.tanh(x[:, :16])


def test_an_nnx_module_calling_the_op_trains_with_the_plain_jax_gradients():
  import optax
  from flax import nnx

  op = ScaledDense.nvfp4()
  pol = ops.REFERENCE.override(RECIPE)

  class Linear(nnx.Module):
    def __init__(self, k, n, rngs):
      init = nnx.initializers.lecun_normal()
      self.kernel = nnx.Param(init(rngs(), (k, n)))
      self.bias = nnx.Param(jnp.zeros(n))

    def __call__(self, x, key):
      return op(x, self.kernel[...], self.bias[...], key=key, policy=pol)

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.l2 = Linear(32, 64, rngs), Linear(64, 16, rngs)

    def __call__(self, x, key):
      k1, k2 = jax.random.split(key)
      return self.l2(jax.nn.gelu(self.l1(x, k1)), k2)

  x, y = _mlp_data()
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  def params(m):
    return [
      (m.l1.kernel[...], m.l1.bias[...]),
      (m.l2.kernel[...], m.l2.bias[...]),
    ]

  # The module's gradients are those of the same function in plain JAX.
  key = jax.random.key(7)
  _, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x, key) - y) ** 2))(model)
  want = jax.grad(_plain_mlp_loss)(params(model), x, y, key)
  for got, exp in zip(
    jax.tree.leaves(params(grads)), jax.tree.leaves(want), strict=True
  ):
    np.testing.assert_array_equal(got, exp)

  @nnx.jit
  def step(model, opt, key):
    loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x, key) - y) ** 2))(
      model
    )
    opt.update(model, g)
    return loss

  losses = [float(step(model, opt, jax.random.key(i))) for i in range(60)]
  assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_an_equinox_module_calling_the_op_trains_with_the_plain_jax_gradients():
  eqx = pytest.importorskip("equinox")
  import optax

  op = ScaledDense.nvfp4()
  pol = ops.REFERENCE.override(RECIPE)

  class Linear(eqx.Module):
    kernel: jax.Array
    bias: jax.Array

    def __init__(self, k, n, key):
      self.kernel = jax.random.normal(key, (k, n)) / np.sqrt(k)
      self.bias = jnp.zeros(n)

    def __call__(self, x, key):
      return op(x, self.kernel, self.bias, key=key, policy=pol)

  class MLP(eqx.Module):
    l1: Linear
    l2: Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.l1, self.l2 = Linear(32, 64, k1), Linear(64, 16, k2)

    def __call__(self, x, key):
      k1, k2 = jax.random.split(key)
      return self.l2(jax.nn.gelu(self.l1(x, k1)), k2)

  def loss(model, x, y, key):
    return jnp.mean((model(x, key) - y) ** 2)

  x, y = _mlp_data()
  model = MLP(jax.random.key(0))
  key = jax.random.key(7)
  grads = eqx.filter_grad(loss)(model, x, y, key)
  params = [(model.l1.kernel, model.l1.bias), (model.l2.kernel, model.l2.bias)]
  want = jax.grad(_plain_mlp_loss)(params, x, y, key)
  got = [(grads.l1.kernel, grads.l1.bias), (grads.l2.kernel, grads.l2.bias)]
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g, w)

  tx = optax.adam(1e-2)
  opt = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def step(model, opt, key):
    val, g = eqx.filter_value_and_grad(loss)(model, x, y, key)
    upd, opt = tx.update(g, opt)
    return eqx.apply_updates(model, upd), opt, val

  losses = []
  for i in range(60):
    model, opt, val = step(model, opt, jax.random.key(i))
    losses.append(float(val))
  assert losses[-1] < 0.1 * losses[0], losses[::10]

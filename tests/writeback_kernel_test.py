"""`lowprec.writeback(kernel=)`: the one-pass kernel against the XLA path.

The reference is the same `lowprec.writeback` with `kernel="xla"`: the
kernel (Pallas's interpreter on this CPU) must give its deltas, counts
and keys bit for bit, over several steps, leaves it does not take
included. The Triton lowering is checked by exporting for CUDA, which
needs no GPU.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import export

import lowprec
from lowprec.engine.weights import Float8ParamsWarning
from lowprec.optim import writeback_kernel
from tests.fused_adam_test import _assert_same

# Leaves the kernel takes (two whole tiles, a ragged last tile, three
# axes) and one it leaves to XLA (a size that is no whole number of
# 128-element rows).
SHAPES = {
  "tiles": (64, 256),
  "ragged": (3, 128),
  "three_axes": (2, 5, 384),
  "odd": (7,),
}
TAKEN = 3
# Shapes an MX format's blocks of 32 divide.
BLOCKED = {n: s for n, s in SHAPES.items() if n != "odd"}


def _params(fmt, dtype, shapes=SHAPES):
  rng = np.random.default_rng(0)
  p = {
    n: jnp.asarray(rng.standard_normal(s) * 2.0, jnp.float32)
    for n, s in shapes.items()
  }
  return jax.tree.map(lambda x: x.astype(dtype), lowprec.to_grid(p, fmt))


def _proposals(t, rng, shapes=SHAPES):
  """Proposals of mixed magnitudes (1e-9 to 1e3: erased, moved and
  saturating), a run of zeros, and at step 1 a NaN and an infinity."""
  out = {}
  for name, shape in shapes.items():
    u = rng.standard_normal(shape) * 10.0 ** rng.integers(-9, 4, shape)
    u = np.asarray(u, np.float32)
    u.reshape(-1)[:5] = 0.0
    if t == 1 and u.size > 40:
      u.reshape(-1)[17] = np.nan
      u.reshape(-1)[-1] = np.inf
    out[name] = jnp.asarray(u)
  return out


def _run(fmt, rounding, dtype, kernel, steps=3, shapes=SHAPES, **options):
  """`steps` updates (seed 0) of the write-back alone: its deltas, the
  params they land and the state after each."""
  tx = lowprec.writeback(
    fmt, rounding, key=jax.random.key(5), kernel=kernel, **options
  )
  params = _params(fmt, dtype, shapes)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", Float8ParamsWarning)
    state = tx.init(params)
  step = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  out = []
  for t in range(steps):
    deltas, state = step(_proposals(t, rng, shapes), state, params)
    params = lowprec.apply_updates(params, deltas)
    out.append((deltas, params, state))
  return out


CASES = [
  ("bfloat16", "nearest", jnp.float32, {}),
  ("bfloat16", "stochastic", jnp.bfloat16, {}),
  ("float8_e4m3fn", "deadzone", jnp.float8_e4m3fn, {}),
  ("float8_e5m2", "stochastic", jnp.float32, {"overflow": "ieee"}),
  ("e5m3", "nearest", jnp.float32, {"nonfinite": "propagate"}),
  ("bfloat16", "stochastic", jnp.float32, {"telemetry": False}),
]


@pytest.mark.parametrize(
  "fmt, rounding, dtype, options",
  CASES,
  ids=[f"{f}-{r}-{jnp.dtype(d).name}-{len(o)}" for f, r, d, o in CASES],
)
def test_kernel_bits_equal_the_xla_path(fmt, rounding, dtype, options):
  """Three updates: deltas, landed params, counts and keys equal the XLA
  path's bit for bit, a NaN and an inf included, weights stored as
  float32 or in the format's own dtype; and the proposals were such that
  some coordinates moved and some were erased."""
  ref = _run(fmt, rounding, dtype, "xla", **options)
  got = _run(fmt, rounding, dtype, "pallas", **options)
  _assert_same(ref, got)
  if options.get("telemetry", True):
    report = lowprec.telemetry(ref[-1][2])
    assert 0 < report["erased_fraction"] < 1
    assert report["moved"] > 0
    if options.get("nonfinite") != "propagate":  # else NaN weights stay
      assert report["nonfinite"] == 0
    with_nonfinite = sum(np.prod(s) > 40 for s in SHAPES.values())
    assert lowprec.telemetry(ref[1][2])["nonfinite"] == 2 * with_nonfinite


def test_counting_every_k_updates_keeps_the_bits():
  """`telemetry=2`: counted and uncounted updates by the kernel equal
  the XLA path's (4 updates)."""
  ref = _run("bfloat16", "stochastic", jnp.float32, "xla", 4, telemetry=2)
  got = _run("bfloat16", "stochastic", jnp.float32, "pallas", 4, telemetry=2)
  _assert_same(ref, got)


def _calls(tx, params):
  u = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", Float8ParamsWarning)
    state = tx.init(params)
  return str(jax.make_jaxpr(tx.update)(u, state, params)).count("pallas_call")


def test_the_kernel_runs_once_a_leaf_it_takes():
  """One kernel per leaf on a plain float grid with whole rows (a call
  for CUDA and one interpreted, picked by platform), none for MX scaled
  or integer grids, none with "xla" or (on this CPU) "auto"."""
  params = _params("bfloat16", jnp.float32)
  for kernel, n in (("pallas", 2 * TAKEN), ("xla", 0), ("auto", 0)):
    assert _calls(lowprec.writeback("bfloat16", kernel=kernel), params) == n
  for fmt in ("mxfp8_e4m3", lowprec.get_format("int4", scale=0.25)):
    p = _params(fmt, jnp.float32, BLOCKED)
    assert _calls(lowprec.writeback(fmt, kernel="pallas"), p) == 0


def test_grids_the_kernel_does_not_take_give_the_xla_paths_bits():
  """An MX scaled format and an integer grid under kernel="pallas" run
  on the XLA path: the same deltas and counts as kernel="xla"."""
  for fmt in ("mxfp8_e4m3", lowprec.get_format("int4", scale=0.25)):
    ref = _run(fmt, "stochastic", jnp.float32, "xla", 2, BLOCKED)
    got = _run(fmt, "stochastic", jnp.float32, "pallas", 2, BLOCKED)
    _assert_same(ref, got)


def test_auto_off_cuda_takes_the_xla_path(monkeypatch):
  """Where "auto" would take the kernel but the platform is not CUDA
  (another GPU; here the CPU standing in for one): a call per leaf for
  CUDA, and elsewhere the XLA path, not Pallas's interpreter (whose
  grid loop is a `while`): the same bits as kernel="xla"."""
  monkeypatch.setattr(writeback_kernel, "_here", lambda *_: True)
  params = _params("bfloat16", jnp.float32)
  tx = lowprec.writeback("bfloat16", "stochastic", key=jax.random.key(5))
  auto = lowprec.writeback(
    "bfloat16", "stochastic", key=jax.random.key(5), kernel="auto"
  )
  assert _calls(auto, params) == TAKEN
  u = _proposals(1, np.random.default_rng(0))

  def loops(tx):  # the key's split is a loop of its own
    compiled = jax.jit(tx.update).lower(u, tx.init(params), params).compile()
    return compiled.as_text().count(" while(")

  pallas = lowprec.writeback(
    "bfloat16", "stochastic", key=jax.random.key(5), kernel="pallas"
  )
  assert loops(auto) == loops(tx) < loops(pallas)
  _assert_same(
    jax.jit(tx.update)(u, tx.init(params), params),
    jax.jit(auto.update)(u, auto.init(params), params),
  )


def test_auto_takes_float8_weights_only_where_triton_converts_them(
  monkeypatch,
):
  """On one GPU, "auto" runs the kernel for weights of any dtype on
  compute capability 8.9 or more, and on an older one only for weights
  not stored in a one-byte float (Triton has no float8 conversion
  there); never on several devices."""

  class Device:
    def __init__(self, capability):
      self.compute_capability = capability

  f8 = jnp.zeros((128,), jnp.float8_e4m3fn)
  bf16 = jnp.zeros((128,), jnp.bfloat16)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  for capability, fp8 in (("8.0", False), ("8.9", True), ("9.0", True)):
    monkeypatch.setattr(jax, "devices", lambda c=capability: [Device(c)])
    assert writeback_kernel._here("auto", bf16)
    assert writeback_kernel._here("auto", f8) is fp8
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  assert not writeback_kernel._here("auto", bf16)
  assert writeback_kernel._here("pallas", f8)


@pytest.mark.parametrize(
  "fmt, rounding, dtype",
  [
    ("bfloat16", "stochastic", jnp.bfloat16),
    ("float8_e4m3fn", "deadzone", jnp.float8_e4m3fn),
    ("float8_e5m2", "nearest", jnp.float32),
  ],
)
def test_kernel_lowers_to_triton(fmt, rounding, dtype):
  """Exported for CUDA (no GPU needed): each leaf the kernel takes is one
  Triton call, so every operation in it (the rounding on bit patterns,
  the random bits, the exact delta and the counts) has a Triton
  lowering; none divides (Triton's `/` is the approximate
  `div.full.f32`)."""
  params = _params(fmt, dtype)
  tx = lowprec.writeback(fmt, rounding, key=jax.random.key(0), kernel="pallas")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", Float8ParamsWarning)
    state = tx.init(params)
  u = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  exported = export.export(
    jax.jit(tx.update),
    platforms=["cuda"],
    disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    ],
  )(u, state, params)
  module = exported.mlir_module()
  assert module.count("xla.gpu.triton") == TAKEN
  assert "divf" not in module


def test_an_unknown_kernel_is_refused():
  with pytest.raises(ValueError, match="valid: auto, pallas, xla"):
    lowprec.writeback("bfloat16", kernel="triton")


def test_nnx_optimizer_loop_same_params():
  """`nnx.Optimizer` over a two-layer NNX model on the bfloat16 grid,
  AdamW then stochastic write-back (5 steps, seed 0): the kernel's
  params equal the XLA path's bit for bit, and the loss falls."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(16, 64, rngs=rngs)
      self.b = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  x = jax.random.normal(jax.random.key(1), (64, 16))

  def train(kernel):
    model = Model(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, lowprec.to_grid(params, "bfloat16"))
    tx = optax.chain(
      optax.adamw(1e-2),
      lowprec.writeback(
        "bfloat16", "stochastic", key=jax.random.key(2), kernel=kernel
      ),
    )
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss_fn = lambda m: jnp.mean((m(x) - 1.0) ** 2)  # noqa: E731

    @nnx.jit
    def step(model, opt):
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      opt.update(model, grads)
      return loss

    losses = [float(step(model, opt)) for _ in range(5)]
    return nnx.state(model, nnx.Param), losses

  (p_xla, l_xla), (p_kernel, l_kernel) = train("xla"), train("pallas")
  _assert_same(p_xla, p_kernel)
  assert l_xla == l_kernel and l_xla[-1] < l_xla[0]

"""`lowprec.scale_by_stored_adam`: the one-pass kernel against the XLA path.

The reference is `lowprec.store_state(optax.scale_by_adam(...), {"mu":
"companded8:block32", "nu": "sqrt8:block32"}, telemetry=False)`: the
kernel (Pallas's interpreter on this CPU) must give its updates, codes
and scales bit for bit, on trees of several leaves (a one-leaf tree
compiles optax's bias corrections differently: see `_moments`). The
Triton lowering is checked by exporting for CUDA, which needs no GPU.
"""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import export

import lowprec
from lowprec.grids import codemaps
from lowprec.optim import fused_adam, stored_state

RULES = {"mu": "companded8:block32", "nu": "sqrt8:block32"}
# Pairs of moments the kernel holds: FlashOptim's, bitsandbytes' (its
# tables read by index), and one map for both.
PAIRS = {
  "flashoptim": RULES,
  "bitsandbytes": {"mu": "dynamic8:block256", "nu": "dynamic8u:block256"},
  "dynamic8_both": {"mu": "dynamic8:block64", "nu": "dynamic8:block64"},
  # torchao's AdamWFp8 (float32 scales amax / 448).
  "amax_e4m3": {
    "mu": "float8_e4m3fn:nearest:block256:amax",
    "nu": "float8_e4m3fn:nearest:block256:amax",
  },
  # Power-of-two scales beside float16 amax ones, and a code map beside a
  # float format.
  "pow2_and_float16_amax": {
    "mu": "float8_e4m3fn:nearest:block64",
    "nu": "float8_e4m3fn:nearest:block64:amax:float16",
  },
  "companded8_e4m3": {
    "mu": "companded8:block32",
    "nu": "float8_e4m3fn:nearest:block32:amax",
  },
  # 4-bit codes, two to a byte (Li, Chen, Zhu 2023's maps), and one
  # packed moment beside an unpacked one.
  "4bit": {"mu": "dynamic4:block128", "nu": "uint4nz:block128"},
  "dynamic8_uint4nz": {"mu": "dynamic8:block64", "nu": "uint4nz:block64"},
  # Stochastic rounding: the q8 state recipe (bitsandbytes' maps), each
  # other kind of code with random bits, and a random moment beside a
  # nearest one.
  "q8": {
    "mu": "dynamic8:stochastic:block256",
    "nu": "dynamic8u:stochastic:block256",
  },
  "flashoptim_stochastic": {
    "mu": "companded8:stochastic:block32",
    "nu": "sqrt8:stochastic:block32",
  },
  "e4m3_stochastic_beside_nearest": {
    "mu": "float8_e4m3fn:stochastic:block64:amax",
    "nu": "float8_e4m3fn:nearest:block64",
  },
  "4bit_stochastic": {
    "mu": "dynamic4:stochastic:block128",
    "nu": "uint4nz:stochastic:block128",
  },
}
# Dead zone (stochastic where nearest gives the old value back), checked
# without FMA instructions only (`_run_telemetry_check`): it reads the old
# moments a second time, as the counts do.
DEADZONE = {
  "flashoptim_deadzone": {
    "mu": "companded8:deadzone:block32",
    "nu": "sqrt8:deadzone:block32",
  },
  "bitsandbytes_deadzone": {
    "mu": "dynamic8:deadzone:block256",
    "nu": "dynamic8u:stochastic:block256",
  },
  "e4m3_deadzone": {
    "mu": "float8_e4m3fn:deadzone:block64",
    "nu": "float8_e4m3fn:deadzone:block64:amax",
  },
  "4bit_deadzone": {
    "mu": "dynamic4:deadzone:block128",
    "nu": "uint4nz:nearest:block128",
  },
}


def _shapes(block: int = 32) -> dict:
  """Leaves the kernel takes (rows a whole number of tiles, a ragged last
  tile, a tile of one row, three axes, bfloat16 gradients) and two it
  leaves to XLA (a last axis that is not a whole number of blocks, a
  scalar)."""
  return {
    "tiles": (64, 4 * block),
    "ragged": (300, 3 * block),
    "one_row": (1, block),
    "three_axes": (2, 5, 2 * block),
    "bf16_grads": (4, 2 * block),
    "odd_axis": (7, 33),
    "scalar": (),
  }


SHAPES = _shapes()


def _grads(shapes, t, rng):
  """Gradients of mixed magnitudes (1e-30 to 1e6, so blocks of very
  different scales and some subnormal squares), a block of zeros, and
  at step 3 a NaN and an infinity (their blocks' scales become NaN or
  saturate)."""
  out = {}
  for name, shape in shapes.items():
    g = rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 7, shape)
    g = np.asarray(g, np.float32)
    if g.ndim and g.size >= 64:
      g.reshape(-1)[:32] = 0.0
      if t == 3:
        g.reshape(-1)[40] = np.nan
        g.reshape(-1)[-1] = np.inf
    out[name] = jnp.asarray(g, jnp.bfloat16 if "bf16" in name else None)
  return out


def _bits(tree):
  """Every leaf as its bytes (NaN payloads, signed zeros and all)."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _assert_same(a, b):
  names = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(a)
  ]
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for name, x, y in zip(names, _bits(a), _bits(b), strict=True):
    assert x == y, f"{name} differs"


@pytest.mark.parametrize(
  "hyper, pair",
  [
    ({}, "flashoptim"),
    ({"b1": 0.8, "b2": 0.95, "eps": 1e-6, "eps_root": 1e-12}, "flashoptim"),
    ({}, "bitsandbytes"),
    ({"b2": 0.95}, "dynamic8_both"),
    ({}, "amax_e4m3"),
    ({"b1": 0.8, "eps_root": 1e-12}, "pow2_and_float16_amax"),
    ({}, "companded8_e4m3"),
    ({}, "4bit"),
    ({"b2": 0.95}, "dynamic8_uint4nz"),
    ({"b2": 0.95}, "q8"),
    ({}, "flashoptim_stochastic"),
    ({"b1": 0.8, "eps_root": 1e-12}, "e4m3_stochastic_beside_nearest"),
    ({}, "4bit_stochastic"),
  ],
  ids=lambda v: v if isinstance(v, str) else None,
)
def test_kernel_bits_equal_store_state(hyper, pair):
  """Six steps (seed 0): updates, codes, scales, counts and keys equal
  the XLA path's bit for bit, leaf by leaf, a NaN and an inf included;
  stochastic rounding draws `store_state`'s bits from the same key."""
  rules = PAIRS[pair]
  key = jax.random.key(7)
  ref = lowprec.store_state(
    optax.scale_by_adam(**hyper), rules, telemetry=False, key=key
  )
  fused = lowprec.scale_by_stored_adam(
    **hyper, **rules, kernel="pallas", key=key
  )
  block = stored_state.parse_state_format(rules["mu"]).scale
  shapes = _shapes(block)
  params = {n: jnp.zeros(s) for n, s in shapes.items()}
  s_ref, s_fused = ref.init(params), fused.init(params)
  _assert_same(s_ref, s_fused)
  step_ref, step_fused = jax.jit(ref.update), jax.jit(fused.update)
  rng = np.random.default_rng(0)
  for t in range(6):
    g = _grads(shapes, t, rng)
    u_ref, s_ref = step_ref(g, s_ref)
    u_fused, s_fused = step_fused(g, s_fused)
    _assert_same((u_ref, s_ref), (u_fused, s_fused))
  # A map's block holding the NaN has a NaN scale (a float format's
  # holds a NaN code), so the comparison saw one.
  mu = s_ref.scales["mu/tiles"]
  if not codemaps.is_map(rules["mu"].split(":")[0]):
    mu = s_ref.inner.mu["tiles"]
  assert np.isnan(np.asarray(mu, np.float32)).any()


def test_the_kernel_runs_once_a_leaf_it_takes():
  """One kernel per leaf the kernel takes (a `pallas_call` for CUDA and
  one interpreted, picked by platform), none for the others;
  `kernel="xla"` and (on this CPU) `"auto"` run none."""
  params = {n: jnp.zeros(s) for n, s in SHAPES.items()}
  held = sum(1 for s in SHAPES.values() if s and s[-1] % 32 == 0)

  def calls(kernel):
    tx = lowprec.scale_by_stored_adam(kernel=kernel)
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params))
    return str(jaxpr).count("pallas_call") / 2

  assert calls("pallas") == held == 5
  assert calls("xla") == 0
  assert calls("auto") == 0


@pytest.mark.parametrize("telemetry", [False, True])
def test_auto_off_cuda_takes_the_xla_path_leaf_by_leaf(monkeypatch, telemetry):
  """Where "auto" would take the kernel but the platform is not CUDA
  (another GPU; here the CPU standing in for one): one call per leaf
  for CUDA, and elsewhere the XLA path, not Pallas's interpreter (whose
  grid loop is a `while` in the program): the same bits as
  `store_state`, counts included."""
  monkeypatch.setattr(fused_adam, "_kernel_here", lambda *_: True)
  params = {n: jnp.zeros(s) for n, s in SHAPES.items()}
  g = _grads(SHAPES, 0, np.random.default_rng(0))
  ref = lowprec.store_state(optax.scale_by_adam(), RULES, telemetry=telemetry)

  def program(kernel):
    tx = lowprec.scale_by_stored_adam(kernel=kernel, telemetry=telemetry)
    state = tx.init(params)
    jaxpr = str(jax.make_jaxpr(tx.update)(g, state))
    compiled = jax.jit(tx.update).lower(g, state).compile().as_text()
    return jaxpr.count("pallas_call"), compiled, jax.jit(tx.update)(g, state)

  calls, compiled, out = program("auto")
  assert calls == 5  # the CUDA branch of each leaf the kernel takes
  assert "while" not in compiled
  assert "while" in program("pallas")[1]
  _assert_same(out, jax.jit(ref.update)(g, ref.init(params)))


def test_auto_takes_e4m3_to_the_kernel_only_where_triton_converts_it(
  monkeypatch,
):
  """On one GPU, "auto" runs the kernel for the code maps on any compute
  capability, and for e4m3 codes on 8.9 or more (Triton has no float8
  conversion below), taking the XLA path on an older GPU."""

  class Device:
    def __init__(self, capability):
      self.compute_capability = capability

  codecs = {
    pair: {
      n: stored_state.parse_state_format(s).codec()
      for n, s in PAIRS[pair].items()
    }
    for pair in ("flashoptim", "amax_e4m3")
  }
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  for capability, fp8 in (("8.0", False), ("8.9", True), ("9.0", True)):
    monkeypatch.setattr(jax, "devices", lambda c=capability: [Device(c)])
    assert fused_adam._kernel_here("auto", codecs["flashoptim"])
    assert fused_adam._kernel_here("auto", codecs["amax_e4m3"]) is fp8
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  assert not fused_adam._kernel_here("auto", codecs["flashoptim"])
  assert fused_adam._kernel_here("pallas", codecs["amax_e4m3"])


@pytest.mark.parametrize(
  "pair, telemetry",
  [
    ("flashoptim", False),
    ("bitsandbytes", False),
    ("amax_e4m3", False),
    ("4bit", False),
    ("q8", False),
    ("q8", True),
    ("flashoptim", True),
  ],
)
def test_kernel_lowers_to_triton(pair, telemetry):
  """Exported for CUDA (no GPU needed): each leaf the kernel takes is one
  Triton call, so every operation in it (the table maps' reads by index,
  the random bits and the counts included) has a Triton lowering; and
  its divisions and roots are PTX's correctly rounded ones, as XLA's
  are, not Triton's `/` (`arith.divf`, which Triton compiles to the
  approximate `div.full.f32`)."""
  params = {n: jnp.zeros(s) for n, s in _shapes(256).items()}
  tx = lowprec.scale_by_stored_adam(
    **PAIRS[pair], kernel="pallas", key=jax.random.key(0), telemetry=telemetry
  )
  state = tx.init(params)
  exported = export.export(
    jax.jit(tx.update),
    platforms=["cuda"],
    disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    ],
  )(params, state)
  module = exported.mlir_module()
  assert module.count("xla.gpu.triton") == 5
  # Each call's Triton IR (bytecode, its strings legible) once.
  assert module.count("div.rn.f32") == 5
  assert module.count("sqrt.rn.f32") == 5
  assert "divf" not in module and "__nv_sqrtf" not in module


def _mlp(key):
  k1, k2 = jax.random.split(key)
  return {
    "w1": 0.3 * jax.random.normal(k1, (16, 64)),
    "b1": jnp.zeros((64,)),
    "w2": 0.3 * jax.random.normal(k2, (64, 32)),
    "b2": jnp.zeros((32,)),
  }


def _loss(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _adamw(kernel):
  return optax.chain(
    lowprec.scale_by_stored_adam(0.9, 0.95, kernel=kernel),
    optax.add_decayed_weights(0.1),
    optax.scale_by_learning_rate(1e-2),
  )


def test_plain_jax_adamw_loop_same_params():
  """A plain-JAX AdamW loop (10 steps, seed 0): the kernel's params and
  state equal the XLA path's bit for bit, and the loss falls."""
  x = jax.random.normal(jax.random.key(1), (128, 16))
  y = jnp.sin(x[:, :1] * jnp.arange(1, 33.0))

  def train(kernel):
    tx = _adamw(kernel)
    params = _mlp(jax.random.key(0))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      loss, g = jax.value_and_grad(_loss)(params, x, y)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(10):
      params, state, loss = step(params, state)
      losses.append(float(loss))
    return params, state, losses

  p_xla, s_xla, losses = train("xla")
  p_kernel, s_kernel, losses_kernel = train("pallas")
  _assert_same((p_xla, s_xla), (p_kernel, s_kernel))
  assert losses == losses_kernel
  assert losses[-1] < 0.8 * losses[0]


def test_nnx_optimizer_loop_same_params():
  """`nnx.Optimizer` over a two-layer NNX model (5 steps, seed 0): the
  kernel's params equal the XLA path's bit for bit."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(16, 64, rngs=rngs)
      self.b = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  x = jax.random.normal(jax.random.key(1), (64, 16))

  def train(kernel):
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, _adamw(kernel), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
      grads = nnx.grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
      opt.update(model, grads)

    for _ in range(5):
      step(model, opt)
    return nnx.state(model, nnx.Param)

  _assert_same(train("xla"), train("pallas"))


@pytest.mark.parametrize(
  "specs, match",
  [
    ({"mu": "int4:nearest:block128:amax"}, "kernel='xla'"),
    ({"nu": "sqrt8:block64"}, "two sizes"),
    ({"nu": "float8_e5m2:nearest:block32"}, "its format"),
    ({"mu": "float8_e4m3fn:nearest:tensor"}, "its blocks"),
  ],
)
def test_specs_the_kernel_does_not_hold_are_refused(specs, match):
  with pytest.raises(ValueError, match=match):
    lowprec.scale_by_stored_adam(**specs, kernel="pallas")


def test_an_unknown_kernel_is_refused_and_other_specs_take_xla():
  with pytest.raises(ValueError, match="valid: auto, pallas, xla"):
    lowprec.scale_by_stored_adam(kernel="triton")
  # Any other spec runs on the XLA path under "auto".
  tx = lowprec.scale_by_stored_adam(
    mu="int4:nearest:block128:amax", nu="uint4nz:block128"
  )
  params = {"w": jnp.zeros((4, 256)), "v": jnp.zeros((256,))}
  updates, _ = jax.jit(tx.update)(params, tx.init(params))
  assert updates["w"].dtype == jnp.float32


def test_a_random_rounding_without_a_key_is_refused():
  with pytest.raises(ValueError, match=r"key=jax.random.key\(seed\)"):
    lowprec.scale_by_stored_adam(**PAIRS["q8"])


def test_a_state_of_other_specs_is_refused():
  params = {"w": jnp.zeros((4, 64)), "v": jnp.zeros((64,))}
  other = lowprec.scale_by_stored_adam(
    nu="sqrt8:block64", mu="companded8:block64"
  )
  state = other.init(params)
  tx = lowprec.scale_by_stored_adam(kernel="pallas")
  with pytest.raises(ValueError, match="recorded specs"):
    tx.update(params, state)


def test_tile_is_a_power_of_two_within_the_rows():
  for block in (32, 64, 256):
    most = fused_adam._ELEMENTS // block
    for rows in (1, 2, 3, 31, 32, 33, 255, 256, 257, 10_000):
      tile = fused_adam._tile(rows, block)
      assert tile & (tile - 1) == 0 and tile <= min(rows, most)
      assert 2 * tile > min(rows, most)


def test_under_shard_map_each_device_steps_its_own_shard():
  """The docs' way on several devices: `jax.shard_map` over 8 devices,
  rows split, each running the kernel on its shard; bits equal the XLA
  path's on the whole tree (3 steps, seed 0)."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("d",))
  shapes = {"w": (64, 128), "b": (8, 96)}
  params = {n: jnp.zeros(s) for n, s in shapes.items()}
  ref = lowprec.scale_by_stored_adam(kernel="xla")
  tx = lowprec.scale_by_stored_adam(kernel="pallas")
  state = tx.init(params)
  specs = jax.tree.map(lambda x: P("d") if jnp.ndim(x) else P(), state)
  step = jax.jit(
    jax.shard_map(
      tx.update,
      mesh=mesh,
      in_specs=(P("d"), specs),
      out_specs=(P("d"), specs),
      # Pallas's interpreter and its output shapes do not track which
      # mesh axes a value varies over.
      check_vma=False,
    )
  )

  def put(tree, spec):
    return jax.tree.map(
      lambda x, p: jax.device_put(x, jax.NamedSharding(mesh, p)), tree, spec
    )

  s_ref, s_tx = state, put(state, specs)
  rng = np.random.default_rng(0)
  for t in range(3):
    g = _grads(shapes, t, rng)
    u_ref, s_ref = jax.jit(ref.update)(g, s_ref)
    u_tx, s_tx = step(put(g, {n: P("d") for n in shapes}), s_tx)
    _assert_same((u_ref, s_ref), (u_tx, s_tx))


def test_ieee_ops_are_the_plain_ones_except_under_ptx():
  """`_ieee.div` and `sqrt` trace to `/` and `jnp.sqrt` (so XLA's
  programs, and the goldens, do not move); under `ptx()` to one PTX
  instruction each, correctly rounded, with their operands broadcast."""
  from lowprec.grids import _ieee

  a, b = jnp.ones((4, 8)), jnp.ones((4, 1))
  plain = str(jax.make_jaxpr(lambda a, b: a / b)(a, b))
  assert str(jax.make_jaxpr(_ieee.div)(a, b)) == plain
  root = str(jax.make_jaxpr(jnp.sqrt)(a))
  assert str(jax.make_jaxpr(_ieee.sqrt)(a)) == root
  assert not _ieee.active()
  # Fresh functions: JAX reuses a trace of a function it has seen with
  # the same shapes, whatever the context (the kernel's body is a fresh
  # partial, `ptx` among its arguments, each time it is traced).
  with _ieee.ptx():
    assert _ieee.active()
    div = str(jax.make_jaxpr(lambda a, b: _ieee.div(a, b))(a, b))
    sqrt = str(jax.make_jaxpr(lambda a: _ieee.sqrt(a))(a))
    with _ieee.ptx(False):
      again = jax.make_jaxpr(lambda a, b: _ieee.div(a, b))(a, b)
      assert str(again) == plain
  assert not _ieee.active()
  assert "div.rn.f32" in div and "f32[4,8]" in div and "div " not in div
  assert "sqrt.rn.f32" in sqrt and "sqrt " not in sqrt


# ---- telemetry: the counts in the kernel ------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _telemetry_check(pairs, steps):
  """Prints one line per pair: whether `scale_by_stored_adam(...,
  telemetry=True)` (the kernel, interpreted) gave `store_state(...,
  telemetry=True)`'s updates, codes, scales and counts bit for bit over
  `steps` steps (seed 0), and its total of changed entries."""
  for pair in pairs:
    rules = {**PAIRS, **DEADZONE}[pair]
    key = jax.random.key(7)
    ref = lowprec.store_state(optax.scale_by_adam(), rules, key=key)
    fused = lowprec.scale_by_stored_adam(
      **rules, kernel="pallas", key=key, telemetry=True
    )
    shapes = _shapes(stored_state.parse_state_format(rules["mu"]).scale)
    params = {n: jnp.zeros(s) for n, s in shapes.items()}
    s_ref, s_fused = ref.init(params), fused.init(params)
    rng = np.random.default_rng(0)
    same = True
    for t in range(steps):
      g = _grads(shapes, t, rng)
      u_ref, s_ref = jax.jit(ref.update)(g, s_ref)
      u_fused, s_fused = jax.jit(fused.update)(g, s_fused)
      same &= jax.tree.structure(s_ref) == jax.tree.structure(s_fused)
      same &= _bits((u_ref, s_ref)) == _bits((u_fused, s_fused))
    changed = sum(int(c) for c in s_fused.counts.changed.values())
    print(f"{pair} {'same' if same else 'differs'} {changed}", flush=True)


def without_fmas(code: str) -> dict:
  """Runs `code` (with tests/ importable) in a process whose XLA:CPU
  emits no FMA instructions (`--xla_cpu_max_isa=AVX`; skips off x86):
  its printed lines as `{first word: the rest}`."""
  if platform.machine().lower() not in ("x86_64", "amd64"):
    pytest.skip("--xla_cpu_max_isa=AVX names an x86 instruction set")
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
  out = subprocess.run(
    [sys.executable, "-c", f"import experiments.xla_flags; {code}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def _run_telemetry_check(pairs, steps):
  """`_telemetry_check` in a process whose XLA:CPU emits no FMA
  instructions (`--xla_cpu_max_isa=AVX`): where XLA contracts Adam's
  `b * m + (1 - b) * g` into an FMA, and which of its two products it
  contracts, depends on how it fuses the program around it, and counting
  reads the old moments a second time. So with FMAs, `store_state`'s own
  updates differ in the last bit between telemetry on and off (about
  one in 2,000 to 10,000 here), and the interpreted kernel's from the
  XLA path's in some pairs; without them the arithmetic is the same
  rounding for rounding."""
  lines = without_fmas(
    f"import fused_adam_test as t; t._telemetry_check({list(pairs)!r}, {steps})"
  )
  assert sorted(lines) == sorted(pairs)
  for pair, result in lines.items():
    verdict, changed = result.split()
    assert verdict == "same", pair
    assert int(changed) > 0, pair  # the counts count something


# One pair of `PAIRS` of each kind of code map and rounding (dynamic maps
# of block 256, amax e4m3 scales, companded codes, 4-bit codes drawn
# stochastically, e4m3 stochastic beside nearest), which the bits test
# above takes all of (with FMAs, telemetry off), and every dead-zone
# pair, which only this test takes.
TELEMETRY_PAIRS = (
  "bitsandbytes",
  "amax_e4m3",
  "companded8_e4m3",
  "4bit_stochastic",
  "e4m3_stochastic_beside_nearest",
  *DEADZONE,
)


@pytest.mark.slow  # about 3 minutes cold, five steps
def test_kernel_telemetry_equals_store_state_without_fmas():
  """The kernel's counts (changed, erased, flushed, saturated,
  non-finite, stalled, per leaf and moment) and everything else equal
  `store_state`'s with telemetry on, bit for bit, for one pair of
  formats of each kind and every dead-zone pair (five steps, seed 0, a
  NaN and an inf at step 3 and a step after them)."""
  _run_telemetry_check(TELEMETRY_PAIRS, steps=5)


def test_kernel_telemetry_is_what_lowprec_telemetry_reads():
  """With FMAs (this process): the counts the kernel writes are the
  state's `StateCounts`, read by `lowprec.telemetry` under the same
  names as `store_state`'s, and equal to them on this tree (the counts
  do not depend on the last bit of an update here)."""
  rules = PAIRS["q8"]
  key = jax.random.key(7)
  ref = lowprec.store_state(optax.scale_by_adam(), rules, key=key)
  fused = lowprec.scale_by_stored_adam(
    **rules, kernel="pallas", key=key, telemetry=True
  )
  params = {n: jnp.zeros(s) for n, s in _shapes(256).items()}
  g = _grads(_shapes(256), 0, np.random.default_rng(0))
  _, s_ref = jax.jit(ref.update)(g, ref.init(params))
  _, s_fused = jax.jit(fused.update)(g, fused.init(params))
  got, want = lowprec.telemetry(s_fused), lowprec.telemetry(s_ref)
  assert sorted(got) == sorted(want) and any("state" in k for k in got)
  for k in want:
    np.testing.assert_equal(got[k], want[k], err_msg=k)

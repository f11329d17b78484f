"""`lowprec.stored_adamw_writeback`: AdamW with stored moments and the
write-back in one kernel per leaf, against the chain of four transforms.

The reference is the chain its docstring names (`scale_by_stored_adam`
on the XLA path, `optax.add_decayed_weights`, `optax.
scale_by_learning_rate`, `lowprec.writeback`). Where XLA:CPU contracts a
product and a sum into an FMA depends on how it fuses the program around
them (docs/state.md), and the one kernel fuses AdamW's arithmetic with
the decay's `u + weight_decay * w` into one program, so the bits are
compared in a process whose XLA:CPU emits no FMA instructions
(`--xla_cpu_max_isa=AVX`). The Triton lowering is checked by exporting
for CUDA, which needs no GPU.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export

import lowprec
from lowprec.engine.weights import Float8ParamsWarning
from lowprec.optim import fused_adam
from tests.fused_adam_test import without_fmas

# Leaves the one kernel takes (rows a whole number of tiles, a ragged last
# tile, a vector of one block), and one whose moments and weights take
# the chain (a last axis that is no whole number of blocks).
SHAPES = {
  "tiles": (64, 512),
  "ragged": (300, 256),
  "bias": (256,),
  "odd": (7, 33),
}
TAKEN = 3
# name -> (mu, nu, weights' grid, write-back rounding, weights' dtype)
CASES = {
  # The frontier study's bf16 SR weights with q8 moments.
  "q8_bf16_sr": (
    "dynamic8:stochastic:block256",
    "dynamic8u:stochastic:block256",
    "bfloat16",
    "stochastic",
    "float32",
  ),
  # FlashOptim's maps, weights stored in bfloat16 (the decay's product in
  # bfloat16, as optax's).
  "flashoptim_native_bf16": (
    "companded8:block32",
    "sqrt8:block32",
    "bfloat16",
    "nearest",
    "bfloat16",
  ),
  # 4-bit moments (two codes a byte, each lane apart) and e4m3 weights by
  # dead zone.
  "4bit_e4m3_deadzone": (
    "dynamic4:block128",
    "uint4nz:block128",
    "float8_e4m3fn",
    "deadzone",
    "float32",
  ),
  # torchao's amax e4m3 moments.
  "amax_e4m3_bf16_sr": (
    "float8_e4m3fn:nearest:block256:amax",
    "float8_e4m3fn:nearest:block256:amax",
    "bfloat16",
    "stochastic",
    "float32",
  ),
}


def _params(fmt, dtype):
  rng = np.random.default_rng(0)
  p = {
    n: jnp.asarray(rng.standard_normal(s), jnp.float32)
    for n, s in SHAPES.items()
  }
  return jax.tree.map(lambda x: x.astype(dtype), lowprec.to_grid(p, fmt))


def _grads(t, rng):
  """Gradients of mixed magnitudes (1e-6 to 1), and at step 1 a NaN."""
  out = {}
  for name, shape in SHAPES.items():
    g = rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 1, shape)
    g = np.asarray(g, np.float32)
    if t == 1 and name == "tiles":
      g[0, 3] = np.nan
    out[name] = jnp.asarray(g)
  return out


def _transform(case, kernel, telemetry=True):
  mu, nu, fmt, rounding, _ = CASES[case]
  schedule = optax.cosine_decay_schedule(1e-2, 10)
  return lowprec.stored_adamw_writeback(
    schedule,
    fmt,
    rounding,
    mu=mu,
    nu=nu,
    b2=0.95,
    weight_decay=0.1,
    key=jax.random.key(3),
    telemetry=telemetry,
    kernel=kernel,
  )


def _steps(tx, case, steps):
  """`steps` updates (seed 0): the deltas, params and state after each."""
  _, _, fmt, _, dtype = CASES[case]
  params = _params(fmt, dtype)
  state = tx.init(params)
  step = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  out = []
  for t in range(steps):
    deltas, state = step(_grads(t, rng), state, params)
    params = lowprec.apply_updates(params, deltas)
    out.append((deltas, params, state))
  return out


def _differing(a, b) -> list:
  paths = jax.tree_util.tree_leaves_with_path(a)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return [
    jax.tree_util.keystr(p)
    for (p, x), y in zip(paths, jax.tree.leaves(b), strict=True)
    if np.asarray(x).tobytes() != np.asarray(y).tobytes()
  ]


def _bits_check(cases, steps):
  """Prints one line per case: whether the one kernel (interpreted), and
  "auto" where the platform is not CUDA, gave the chain's deltas, params,
  moments, scales, counts and keys bit for bit over `steps` updates, and
  the write-back's moved count."""
  for case in cases:
    ref = _steps(_transform(case, "xla"), case, steps)
    got = _steps(_transform(case, "pallas"), case, steps)
    bad = _differing(ref, got)
    moved = lowprec.telemetry(got[-1][2])["moved"]
    print(f"{case} {'same' if not bad else bad[:4]} {moved}", flush=True)
  # "auto" off CUDA: the XLA form of the same step, leaf by leaf.
  case = cases[0]
  fused_adam._kernel_here = lambda *_: True
  auto = _steps(_transform(case, "auto"), case, steps)
  ref = _steps(_transform(case, "xla"), case, steps)
  bad = _differing(ref, auto)
  print(f"auto {'same' if not bad else bad[:4]} 1", flush=True)


def _run_bits_check(cases, steps):
  lines = without_fmas(
    "import warnings; warnings.simplefilter('ignore'); "
    f"import fused_adamw_test as t; t._bits_check({list(cases)!r}, {steps})"
  )
  assert sorted(lines) == sorted([*cases, "auto"])
  for case, result in lines.items():
    verdict, moved = result.rsplit(" ", 1)
    assert verdict == "same", (case, verdict)
    assert int(moved) > 0, case  # the write-back moved weights


@pytest.mark.slow  # about a minute warm
def test_one_kernel_equals_the_chain_every_case():
  """Every case (the frontier study's recipe: bf16 SR weights, q8
  moments, a cosine schedule, decay 0.1; native bfloat16 weights; 4-bit
  moments with e4m3 weights by dead zone; amax e4m3 moments), 4 updates
  without FMAs: the one kernel's deltas, params, codes, scales, counts
  and keys are the chain's bit for bit, and so are "auto"'s off CUDA."""
  _run_bits_check(list(CASES), steps=4)


def test_one_kernel_a_leaf_it_takes():
  """One kernel per leaf it takes (a call for CUDA and one interpreted,
  picked by platform), the other leaf through the chain; "xla" is the
  chain itself, and on this CPU "auto" runs no kernel."""
  case = "q8_bf16_sr"
  params = _params("bfloat16", jnp.float32)
  grads = _grads(0, np.random.default_rng(0))

  def calls(kernel):
    tx = _transform(case, kernel)
    jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params), params)
    return str(jaxpr).count("pallas_call")

  assert calls("pallas") == 2 * TAKEN
  tx = _transform(case, "pallas")
  jaxpr = str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
  assert jaxpr.count("name=stored_adamw_writeback\n") == 2 * TAKEN
  assert calls("auto") == calls("xla") == 0
  chain = _transform(case, "xla")
  assert isinstance(chain.init(params), tuple) and len(chain.init(params)) == 4


def test_telemetry_reads_both_the_moments_and_the_write_back():
  """`lowprec.telemetry` of the state reads the write-back's counts
  (moved, erased, every leaf) and the moments' (changed), as of the
  chain; the NaN at step 1 is counted as one non-finite proposal."""
  steps = _steps(_transform("q8_bf16_sr", "pallas"), "q8_bf16_sr", 2)
  report = lowprec.telemetry(steps[1][2])
  for name in SHAPES:
    assert f"moved/{name}" in report, sorted(report)[:20]
  assert report["nonfinite"] == 1
  assert report["moved"] > 0 and 0 < report["erased_fraction"] < 1
  assert report["state/changed"] > 0  # the moments' counts


@pytest.mark.parametrize("case", ["q8_bf16_sr", "flashoptim_native_bf16"])
def test_one_kernel_lowers_to_triton(case):
  """Exported for CUDA (no GPU needed): each leaf it takes is one Triton
  call, whose divisions and roots are PTX's correctly rounded ones."""
  _, _, fmt, _, dtype = CASES[case]
  params = _params(fmt, dtype)
  tx = _transform(case, "pallas")
  grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  exported = export.export(
    jax.jit(tx.update),
    platforms=["cuda"],
    disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    ],
  )(grads, tx.init(params), params)
  module = exported.mlir_module()
  assert module.count("xla.gpu.triton") == TAKEN
  assert module.count("div.rn.f32") == TAKEN
  assert "divf" not in module and "__nv_sqrtf" not in module


def test_float8_weights_with_a_decay_are_refused_at_init():
  """optax adds the decay's product in the weights' dtype, which JAX
  refuses for float8: `init` says so and names the fixes; without a
  decay the weights step through the chain, no write-back in a kernel."""
  params = _params("float8_e4m3fn", jnp.float8_e4m3fn)
  tx = lowprec.stored_adamw_writeback(1e-3, "float8_e4m3fn", kernel="pallas")
  with pytest.raises(ValueError, match=r"'bias'.*lowprec.to_grid"):
    tx.init(params)
  tx = lowprec.stored_adamw_writeback(
    1e-3, "float8_e4m3fn", weight_decay=0.0, kernel="pallas"
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", Float8ParamsWarning)
    state = tx.init(params)
  grads = _grads(0, np.random.default_rng(0))
  jaxpr = str(jax.make_jaxpr(tx.update)(grads, state, params))
  assert "stored_adamw_writeback" not in jaxpr


def test_weights_the_kernel_does_not_take_step_through_the_chain():
  """An integer grid's weights run no write-back in a kernel; their
  moments still take `scale_by_stored_adam`'s."""
  grads = _grads(0, np.random.default_rng(0))
  fmt = lowprec.get_format("int4", scale=0.25)
  params = _params(fmt, jnp.float32)
  tx = lowprec.stored_adamw_writeback(1e-3, fmt, kernel="pallas")
  jaxpr = str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
  # The moments of the leaves whose blocks are whole still take
  # scale_by_stored_adam's kernel; no write-back is in one.
  assert jaxpr.count("name=stored_adam\n") == 2 * TAKEN
  assert "stored_adamw_writeback" not in jaxpr


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"kernel": "triton"}, "valid: auto, pallas, xla"),
    ({"telemetry": 10}, "telemetry=k"),
    ({"weight_decay": optax.constant_schedule(0.1)}, "float weight_decay"),
    ({"rounding": "stochastic"}, r"key=jax.random.key\(seed\)"),
  ],
)
def test_what_it_cannot_run_is_refused_naming_the_fix(kwargs, match):
  with pytest.raises(ValueError, match=match):
    lowprec.stored_adamw_writeback(1e-3, "bfloat16", **kwargs)

"""The compiler-proof contract (lowprec.contract): every recipe's step
keeps it, and the checker finds the patterns a GPU compiler rewrites.

Each recipe's jitted update is traced to the program JAX lowers; no
narrowing conversion of an unrounded value may be widened and used in
arithmetic, and no arithmetic may run on narrow floats (see
docs/compiler.md).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec
from experiments import golden_bits
from lowprec import contract

RECIPES = golden_bits.transforms()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipes_step_keeps_the_contract(name):
  kind, tx, params = RECIPES[name]()
  if kind == "adamw":  # the recipe after a full AdamW step
    tx = optax.chain(lowprec.in_float32(optax.adamw(1e-3)), tx)
  state = tx.init(params)
  updates = {"w": jnp.asarray(golden_bits._proposals(0))}
  if kind == "state":
    updates = params
  found = contract.check(jax.jit(tx.update), updates, state, params)
  assert found == [], "\n".join(map(str, found))


def _adamw_chain(last, params):
  tx = optax.chain(lowprec.in_float32(optax.adamw(1e-3)), last)
  state = tx.init(params)
  return contract.check(jax.jit(tx.update), params, state, params)


@pytest.mark.parametrize(
  "last",
  [
    lambda: lowprec.writeback("bfloat16", "stochastic", key=jax.random.key(0)),
    lambda: lowprec.kahan_writeback("bfloat16", buffer="float8_e5m2"),
    lambda: lowprec.remainder_writeback(),
  ],
  ids=["writeback", "kahan", "remainder"],
)
def test_full_adamw_steps_on_native_bfloat16_params_keep_the_contract(last):
  params = lowprec.to_grid(
    {"w": jnp.linspace(-1, 1, 256).reshape(4, 64)}, "bfloat16", storage="native"
  )
  assert _adamw_chain(last(), params) == []


def test_the_traces_keep_the_contract():
  params = {"w": jnp.linspace(-1, 1, 256).reshape(4, 64)}
  traces = optax.chain(
    lowprec.freeze.state_trace(
      optax.adamw(1e-3), {"fp8": {"mu": "float8_e4m3fn:stochastic:block32"}}
    ),
    lowprec.freeze.reference_trace(["bfloat16", "mxfp8_e4m3"]),
    lowprec.freeze.compensated_trace(
      {"k": ("bfloat16", "kahan", "float8_e5m2")}
    ),
  )
  state = traces.init(params)
  found = contract.check(jax.jit(traces.update), params, state, params)
  assert found == [], "\n".join(map(str, found))


def test_mx_quantize_and_its_stochastic_rounding_keep_the_contract():
  x = jnp.linspace(-3, 3, 256).reshape(4, 64)
  key = jax.random.key(0)
  for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
    f = lambda x, fmt=fmt: lowprec.scaled.fake_quantize(
      x, fmt, "stochastic", key
    )  # noqa: E731
    assert contract.check(f, x) == []
    q = lambda x, fmt=fmt: lowprec.scaled.quantize(x, fmt)  # noqa: E731
    assert contract.check(q, x) == []


# ---- the checker finds what it must, and only that ---------------------------


def test_a_round_trip_used_in_arithmetic_is_found_with_its_line_and_fix():
  def step(x, y):
    return x.astype(jnp.bfloat16).astype(jnp.float32) + y

  x = jnp.ones(8)
  (f,) = contract.check(jax.jit(step), x, x)
  assert f.kind == "round trip"
  assert "f32[8] -> bf16[8]" in f.operation and f.use == "add"
  assert f.where.endswith(f":{step.__code__.co_firstlineno + 1}")
  assert "jax.lax.reduce_precision" in str(f)


def test_rounded_values_and_stored_outputs_are_not_findings():
  x = jnp.linspace(0, 1, 8)

  def guarded(x, y):
    r = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    return r.astype(jnp.bfloat16).astype(jnp.float32) + y

  def on_bits(x, y):
    r = lowprec.round_nearest(x, "bfloat16")
    return r.astype(jnp.bfloat16).astype(jnp.float32) * y

  def stored(x, y):  # narrowed and returned, never widened here
    return (x + y).astype(jnp.bfloat16)

  for fn in (guarded, on_bits, stored):
    assert contract.check(fn, x, x) == [], fn.__name__


def test_round_trips_inside_nested_jits_and_scans_are_found():
  @jax.jit
  def inner(x):
    return x.astype(jnp.float8_e4m3fn)

  def nested(x, y):
    return inner(x).astype(jnp.float32) - y

  def scanned(x, y):
    def body(c, _):
      return c.astype(jnp.bfloat16).astype(jnp.float32) * 0.5, None

    return jax.lax.scan(body, x, None, length=3)[0] + y

  x = jnp.ones(4)
  assert [f.kind for f in contract.check(nested, x, x)] == ["round trip"]
  assert [f.kind for f in contract.check(scanned, x, x)] == ["round trip"]


def test_narrow_arithmetic_is_found_and_can_be_left_out():
  def step(x, y):
    return x.astype(jnp.bfloat16) * y.astype(jnp.bfloat16)

  x = jnp.ones(4)
  (f,) = contract.check(step, x, x)
  assert f.kind == "narrow arithmetic" and "excess precision" in str(f)
  assert contract.check(step, x, x, narrow_arithmetic=False) == []


def test_check_step_warns_once_per_finding_naming_the_fix():
  def step(x):
    return x.astype(jnp.float16).astype(jnp.float32) + 1.0

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    found = contract.check_step(step, np.ones(3, np.float32))
  assert len(found) == 1 and len(caught) == 1
  assert issubclass(caught[0].category, contract.CompilerContractWarning)
  assert "reduce_precision" in str(caught[0].message)


def test_a_round_trip_in_a_comparison_is_found():
  # The float16 ceiling lowprec once computed: convert down, back up, and
  # compare with the value; XLA:GPU drops the pair and the test with it.
  def ceil_f16(s):
    h = s.astype(jnp.float16)
    below = h.astype(jnp.float32) < s
    return jnp.where(below, s, jnp.float32(0))

  [f] = contract.check(ceil_f16, jnp.ones(4))
  assert f.kind == "round trip" and f.use == "lt"
  assert "f32[4] -> f16[4]" in f.operation


@pytest.mark.parametrize(
  "divide, found",
  [
    (lambda x: x / 448.0, True),
    (lambda x: x / jnp.float32(7.0), True),
    # An optimization barrier does not keep XLA:GPU from the reciprocal.
    (
      lambda x: (
        x
        / jax.lax.optimization_barrier(
          jnp.broadcast_to(jnp.float32(448.0), x.shape)
        )
      ),
      True,
    ),
    (lambda x: x / 4.0, False),  # an exact reciprocal
    (lambda x: x / 0.125, False),
    (lambda x: x / jnp.max(x), False),  # a value computed at run time
  ],
  ids=["literal", "scalar", "barrier", "pow2", "pow2-small", "runtime"],
)
def test_a_division_by_a_constant_is_found_unless_a_power_of_two(divide, found):
  findings = contract.check(jax.jit(divide), jnp.ones((2, 4)))
  assert bool(findings) == found, findings
  if found:
    assert findings[0].kind == "constant division"
    assert "reciprocal" in str(findings[0])

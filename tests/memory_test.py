"""`bytes_per_param` against byte counts worked out by hand."""

import jax
import jax.numpy as jnp
import optax
import pytest

import lowprec


def _count(tx, params):
  return lowprec.bytes_per_param(params, jax.eval_shape(tx.init, params))


# store_state's counts: its step count and six int32 counts per stored
# leaf (changed, erased, flushed, saturated, nonfinite, stalled).
def _counts(leaves):
  return 4 + 6 * 4 * leaves


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize(
  "scale, scale_bytes",
  [("block128", lambda rows: rows * 2 * 4), ("tensor", lambda rows: 4)],
  ids=["block128", "tensor"],
)
def test_scales_count_with_the_moment_they_scale(rows, scale, scale_bytes):
  """w: rows x 256 float32. mu in bfloat16 (2 bytes), nu in e5m2 (1 byte)
  with a float32 scale per 128 elements (2 per row) or per tensor. Fixed:
  Adam's step count and store_state's counts, the same at every size."""
  params = {"w": jnp.zeros((rows, 256))}
  n = rows * 256
  rules = {"mu": "bfloat16", "nu": f"float8_e5m2:nearest:{scale}"}
  got = _count(lowprec.store_state(optax.adam(1e-3), rules), params)
  assert got.params == 4.0
  assert got.state == 2 + 1 + scale_bytes(rows) / n
  assert got.fixed == 4 + _counts(2)
  assert got.total == 4 + got.state


def test_a_scalar_parameter_has_moments_per_parameter():
  """w: 8 elements, t: a 0-d parameter; 9 parameters. Adam keeps mu and
  nu for both (8 bytes per parameter in float32); a write-back's counts
  per tensor (int32 [] each) are fixed bytes, although t is a scalar."""
  params = {"w": jnp.zeros(8), "t": jnp.zeros(())}
  got = _count(optax.adam(1e-3), params)
  assert got == (4.0, 8.0, 12.0, 4)
  bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  tx = optax.chain(optax.adam(1e-3), lowprec.writeback("bfloat16"))
  got = _count(tx, bf)
  # Moments in bfloat16, like the params; fixed: Adam's count, the
  # write-back's count and its six counts for each of the two tensors
  # (five reported, and the off-grid count it checks).
  assert got == (2.0, 4.0, 6.0, 4 + 4 + 6 * 2 * 4)


def _buffer() -> optax.GradientTransformation:
  """State: one (4, 256) float32 buffer, shaped like no parameter."""

  def init(params):
    del params
    return {"buf": jnp.zeros((4, 256))}

  def update(updates, state, params=None):
    del params
    return updates, state

  return optax.GradientTransformation(init, update)


def test_a_scale_shaped_like_a_parameter_counts_with_its_leaf():
  """The stored buffer (4 x 256 e4m3fn, 1024 bytes) is shaped like no
  parameter, so it and its block scales (4 x 2 float32, 32 bytes) are
  fixed, although the scales have parameter t's shape."""
  params = {"w": jnp.zeros((16, 16)), "t": jnp.zeros((4, 2))}
  tx = lowprec.store_state(_buffer(), {"buf": "float8_e4m3fn:nearest:block128"})
  got = _count(tx, params)
  assert got.state == 0.0
  assert got.fixed == 1024 + 32 + _counts(1)


def test_a_state_passed_as_params_is_refused():
  params = {"w": jnp.zeros((4, 4))}
  tx = optax.adam(1e-3)
  state = tx.init(params)
  fix = r"\(params, opt_state\).*bytes_per_param\(params, tx.init\(params\)\)"
  with pytest.raises(ValueError, match=f"optax state.*{fix}"):
    lowprec.bytes_per_param(state, params)
  # A view without types (a checkpoint restored without a target).
  plain = {"count": state[0].count, "mu": state[0].mu, "nu": state[0].nu}
  with pytest.raises(ValueError, match=f"a step count at 'count'.*{fix}"):
    lowprec.bytes_per_param(plain)
  sr = lowprec.writeback("bfloat16", "stochastic", key=jax.random.key(0))
  with pytest.raises(ValueError, match="looks like an optimizer state"):
    lowprec.bytes_per_param(sr.init(params), params)

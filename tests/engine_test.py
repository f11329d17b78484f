"""The storage engine: its key scheme, codecs and layout, against
`jax.random`, real stored states and the documented example.

The families' results on the engine are pinned bit for bit by
tests/goldens.json and tests/golden_bits.json; these tests pin the parts
a new recipe builds on.
"""

import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec
from lowprec.engine import counting
from lowprec.engine.codec import Codec, decode, encode
from lowprec.grids import rng

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_leaf_keys_fold_the_crc_of_the_path_into_the_steps_key():
  # The scheme every recorded stochastic result was drawn with, written
  # out with jax.random and zlib.
  key = jax.random.key(3)
  words, impl = rng.state_key(key, "test")
  kept, step = rng.next_step(words, impl)
  want_kept, want_step = jax.random.split(key)
  assert np.array_equal(kept, jax.random.key_data(want_kept))
  names = ["params/Dense_0/kernel", "0/mu/w", "b"]
  got = rng.leaf_keys(step, names)
  for n in names:
    seed = zlib.crc32(n.encode()) & 0x7FFFFFFF
    want = jax.random.key_data(jax.random.fold_in(want_step, seed))
    assert np.array_equal(got[n], want), n
  assert rng.leaf_keys(step, []) == {}


def test_a_random_store_without_a_key_names_its_caller_and_the_fix():
  with pytest.raises(ValueError, match=r"my_recipe draws random bits.*"):
    rng.state_key(None, "my_recipe")
  with pytest.raises(TypeError, match="PRNG key"):
    rng.state_key(3, "my_recipe")


@pytest.mark.parametrize(
  "spec",
  ["float8_e4m3fn:nearest:block32", "int8:stochastic:tensor", "bfloat16"],
)
def test_codec_bytes_are_those_of_a_stored_state(spec):
  params = {"w": jnp.ones((8, 100), jnp.float32)}
  tx = lowprec.store_state(
    optax.sgd(0.1, 0.9), {"trace": spec}, key=jax.random.key(0)
  )
  state = tx.init(params)
  leaf = state.inner[0].trace["w"]
  scales = state.scales.get("0/trace/w")
  stored = leaf.nbytes + (0 if scales is None else scales.nbytes)
  codec = lowprec.optim.stored_state.parse_state_format(spec).codec()
  assert codec.nbytes((8, 100)) == stored
  assert codec.dtype() == leaf.dtype


def test_encode_and_decode_of_a_block_scaled_codec_against_numpy():
  x = np.random.default_rng(0).standard_normal((3, 70)).astype(np.float32)
  codec = Codec(lowprec.get_format("float8_e5m2"), scale=32)
  enc = encode(codec, x)
  # Oracle: the smallest power of two p with amax / p <= 57344 per block
  # of 32 (the last block holds 6), values e5m2(x / p) * p.
  pad = np.pad(np.abs(x), [(0, 0), (0, 26)]).reshape(3, 3, 32).max(-1)
  p = 2.0 ** np.ceil(np.log2(pad / 57344.0))
  per = np.repeat(p, 32, axis=-1)[:, :70].astype(np.float32)
  import ml_dtypes

  q = (x / per).astype(ml_dtypes.float8_e5m2)
  assert np.array_equal(np.asarray(enc.scales), p.astype(np.float32))
  assert np.array_equal(np.asarray(enc.code), q)
  want = q.astype(np.float32) * per
  assert np.array_equal(np.asarray(enc.value), want)
  assert np.array_equal(np.asarray(decode(codec, enc.code, enc.scales)), want)


def test_deadzone_is_stochastic_only_where_nearest_gives_the_old_value_back():
  fmt = lowprec.get_format("bfloat16")
  old = jnp.ones(4096, jnp.float32)
  x = old + jnp.float32(2.0**-10)  # an eighth of a gap: nearest keeps 1
  bits = rng.random_bits(jax.random.key(1), x.shape)
  dz = encode(Codec(fmt, "deadzone"), x, old, bits).value
  sr = encode(Codec(fmt, "stochastic"), x, old, bits).value
  assert np.array_equal(dz, sr)
  y = old + jnp.float32(2.0**-7 * 0.75)  # nearest moves: dead zone agrees
  dz = encode(Codec(fmt, "deadzone"), y, old, bits).value
  rn = encode(Codec(fmt, "nearest"), y, old).value
  assert np.array_equal(dz, rn)
  assert float(jnp.mean(sr != 1.0)) == pytest.approx(1 / 8, abs=0.02)


def test_layout_gives_totals_a_fraction_and_the_same_per_path():
  per = {"a": {"x": jnp.int32(3), "y": jnp.int32(4)}, "b": {"x": 1, "y": 0}}
  got = counting.layout(
    jnp.int32(7), per, ("x", "y"), ("r", "x", "y"), host=True
  )
  assert got == {
    "steps": 7,
    "x": 4,
    "y": 4,
    "r": 1.0,
    "x/a": 3,
    "y/a": 4,
    "r/a": 0.75,
    "x/b": 1,
    "y/b": 0,
    "r/b": got["r/b"],
  }
  assert np.isnan(got["r/b"])
  arrays = counting.layout(jnp.int32(7), per, ("x", "y"), ("r", "x", "y"))
  assert list(arrays) == list(got)
  assert arrays["r"].dtype == jnp.float32


def test_the_documented_toy_recipe_is_under_40_lines():
  text = open(os.path.join(ROOT, "docs", "engine.md"), encoding="utf-8").read()
  code = text.split("```python\n")[1].split("```")[0].splitlines()
  start = next(i for i, s in enumerate(code) if s.startswith("class "))
  end = next(
    i for i, s in enumerate(code) if "return optax.GradientTransformation" in s
  )
  assert end - start + 1 < 40


@pytest.mark.parametrize(
  "make",
  [
    lambda: lowprec.writeback("bfloat16", telemetry=False),
    lambda: lowprec.kahan_writeback("bfloat16", telemetry=False),
    lambda: lowprec.remainder_writeback(telemetry=False),
    lambda: lowprec.split_writeback(telemetry=False),
    lambda: lowprec.eco(optax.sgd(0.1, 0.9), "bfloat16", telemetry=False),
    lambda: lowprec.store_state(
      optax.adam(1e-3), {"mu": "bfloat16"}, telemetry=False
    ),
  ],
  ids=["writeback", "kahan", "remainder", "split", "eco", "store_state"],
)
def test_a_store_without_telemetry_reports_only_its_steps(make):
  params = lowprec.to_grid({"w": jnp.linspace(-1, 1, 64)}, "bfloat16")
  tx = make()
  state = tx.init(params)
  _, state = tx.update(params, state, params)
  got = lowprec.telemetry(state)
  assert got in ({"steps": 1}, {"state/steps": 1}), got
  assert list(lowprec.telemetry_arrays(state)) == list(got)


def test_grouped_gives_the_per_row_results():
  # Rows of three shapes, one static that splits a shape's group, a None
  # entry and a group of one: each result is that of fn on the row alone.
  from lowprec.engine import leafwise

  rs = np.random.default_rng(0)
  shapes = [(4, 3), (4, 3), (5,), (4, 3), (5,), (2, 2)]
  rows = [
    (jnp.asarray(rs.standard_normal(s), jnp.float32), None) for s in shapes
  ]
  statics = [1.5, 1.5, 1.0, 0.5, 1.0, 1.5]

  def fn(scale, x, none):
    assert none is None
    y = jnp.sin(x) * scale + x**2
    return {"y": y, "sum": jnp.sum(y, axis=-1), "n": jnp.sum(x > 0)}

  got = jax.jit(lambda r: leafwise.grouped(fn, r, statics))(rows)
  assert len(leafwise.same_shapes(rows, statics)) == 4
  for (x, _), s, out in zip(rows, statics, got, strict=True):
    want = jax.jit(fn, static_argnums=(0, 2))(s, x, None)
    for k in ("y", "n"):  # elementwise values and integer counts: exact
      assert np.array_equal(np.asarray(out[k]), np.asarray(want[k])), k
    # A float sum: XLA orders a batched reduction its own way.
    np.testing.assert_allclose(out["sum"], want["sum"], rtol=1e-6)


def test_grouped_stacked_gives_the_rows_results_in_row_order():
  # The same results as the list, bit for bit, stacked in row order
  # (the groups interleave: rows 0, 1, 3 form one group, 2 and 4 another).
  from lowprec.engine import leafwise

  rs = np.random.default_rng(2)
  shapes = [(4, 3), (4, 3), (5,), (4, 3), (5,), (2, 2)]
  rows = [(jnp.asarray(rs.standard_normal(s), jnp.float32),) for s in shapes]

  def fn(_, x):
    return jnp.sum(x > 0), jnp.stack([jnp.max(x), jnp.min(x)])

  listed = jax.jit(lambda r: leafwise.grouped(fn, r))(rows)
  n, ext = jax.jit(lambda r: leafwise.grouped(fn, r, stacked=True))(rows)
  assert n.shape == (6,) and ext.shape == (6, 2)
  for i, (n_i, ext_i) in enumerate(listed):
    assert int(n[i]) == int(n_i), i
    assert np.array_equal(np.asarray(ext[i]), np.asarray(ext_i)), i
  with pytest.raises(ValueError, match="at least one row"):
    leafwise.grouped(fn, [], stacked=True)


def _fusions(fn, *args) -> int:
  """Fusions (compiled programs) in XLA's optimized `fn`."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  return len(re.findall(r" fusion\(", hlo))


def _deep(n_layer, width=24):
  rs = np.random.default_rng(1)
  layer = lambda: {  # noqa: E731
    "attn": {"kernel": rs.standard_normal((width, 3 * width)) * 0.1},
    "mlp": {"kernel": rs.standard_normal((width, 4 * width)) * 0.1},
    "ln": {"scale": np.ones(width)},
  }
  tree = {f"h_{i}": layer() for i in range(n_layer)}
  tree["wte"] = rs.standard_normal((40, width)) * 0.1
  fmt = lowprec.get_format("bfloat16")
  cast = lambda x: lowprec.round_nearest(jnp.asarray(x, jnp.float32), fmt)  # noqa: E731
  return jax.tree.map(cast, tree)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_each_layer_steps_as_it_would_alone(rounding):
  # A layer's deltas and counts depend on its own path (its random key)
  # and values only: as the only leaf of its own tree it gets the same.
  params = _deep(4)
  updates = jax.tree.map(lambda w: jnp.full_like(w, 3e-3) * jnp.cos(w), params)
  make = lambda: lowprec.writeback(  # noqa: E731
    "bfloat16", rounding, key=jax.random.key(5), telemetry=True
  )
  tx = make()
  deltas, state = jax.jit(tx.update)(updates, tx.init(params), params)
  for name in params:
    one = {name: params[name]}
    tx1 = make()
    d1, s1 = jax.jit(tx1.update)({name: updates[name]}, tx1.init(one), one)
    for a, b in zip(
      jax.tree.leaves(d1), jax.tree.leaves(deltas[name]), strict=True
    ):
      assert np.array_equal(np.asarray(a), np.asarray(b)), name
    for field in ("moved", "proposals", "saturated"):
      for path, v in getattr(s1, field).items():
        assert int(getattr(state, field)[path]) == int(v), (field, path)


def test_the_trace_program_does_not_grow_with_depth():
  # The program XLA is given for a reference trace over 16 layers is
  # within 1.5x of 2 layers (leaf by leaf, with its sample gathered from
  # every leaf, it grew faster than the leaves): same-shaped leaves are
  # counted and sampled stacked.
  def size(n_layer):
    params = _deep(n_layer)
    tx = lowprec.freeze.reference_trace(
      ["float8_e4m3fn"], sample=64, key=jax.random.key(1)
    )
    lowered = jax.jit(tx.update).lower(params, tx.init(params), params)
    return len(lowered.as_text().splitlines())

  ratio = size(16) / size(2)
  assert ratio < 1.5, ratio
  # Nor does the compiled one: the per-leaf counts come back stacked (a
  # list sliced every leaf's counts out, a fusion each: 43 -> 139 fusions
  # for 2 -> 16 layers).
  tx = lowprec.freeze.reference_trace(
    ["float8_e4m3fn"], sample=64, key=jax.random.key(1)
  )
  n = {
    k: _fusions(tx.update, p, tx.init(p), p)
    for k in (2, 16)
    for p in [_deep(k)]
  }
  assert n[16] <= n[2] + 4, n


def test_the_write_back_does_not_copy_the_leaves():
  # Stacking same-shaped leaves copies them in and the deltas out (3-4x
  # the step's time on a CPU): the compiled write-back concatenates no
  # float arrays (only its random keys), however many same-shaped layers
  # there are.
  params = _deep(4)
  tx = lowprec.writeback(
    "bfloat16", "stochastic", key=jax.random.key(0), telemetry=True
  )
  hlo = (
    jax.jit(tx.update).lower(params, tx.init(params), params).compile()
  ).as_text()
  stacked = re.findall(r"= f32\[[^\]]*\]\S* concatenate\(", hlo)
  assert not stacked, stacked

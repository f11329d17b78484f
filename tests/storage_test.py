"""Format specifications, storage conversion, grid checks and apply_updates."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lowprec
from lowprec.engine.weights import format_lookup

PARAMS = {
  "params": {
    "Dense_0": {"kernel": jnp.zeros((2, 3)), "bias": jnp.zeros(3)},
    "LayerNorm_0": {"scale": jnp.ones(3)},
  }
}


def _names(params, spec):
  lookup = format_lookup(spec)
  return {
    lowprec.engine.weights.path_name(p): (None if f is None else f.name)
    for p, f in (
      (p, lookup(p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )
  }


def test_one_format_covers_every_parameter():
  assert set(_names(PARAMS, "bfloat16").values()) == {"bfloat16"}


def test_rules_first_match_wins_and_use_fullmatch():
  rules = [
    (r".*/(bias|scale)", None),
    (r"params/Dense_\d+/kernel", "float8_e4m3fn"),
    (r".*", "bfloat16"),
  ]
  assert _names(PARAMS, rules) == {
    "params/Dense_0/bias": None,
    "params/Dense_0/kernel": "float8_e4m3fn",
    "params/LayerNorm_0/scale": None,
  }
  # "kernel" alone does not match "params/Dense_0/kernel" (fullmatch).
  with pytest.raises(ValueError, match="params/Dense_0/kernel") as e:
    _names(PARAMS, [("kernel", "bfloat16"), (".*bias|.*scale", None)])
  assert "(r'.*', None)" in str(e.value)


def test_format_pytree_may_stop_at_a_prefix():
  spec = {"params": {"Dense_0": "e8m3", "LayerNorm_0": {"scale": None}}}
  assert _names(PARAMS, spec) == {
    "params/Dense_0/bias": "e8m3",
    "params/Dense_0/kernel": "e8m3",
    "params/LayerNorm_0/scale": None,
  }
  with pytest.raises(ValueError, match="params/LayerNorm_0/scale"):
    _names(PARAMS, {"params": {"Dense_0": "e8m3"}})


def test_bad_names_fail_when_the_spec_is_parsed():
  with pytest.raises(ValueError, match="Did you mean 'bfloat16'"):
    format_lookup([(".*", "bfloat61")])
  with pytest.raises(ValueError, match="bad regex"):
    format_lookup([("(", "bfloat16")])


@pytest.mark.parametrize(
  "name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
)
def test_to_grid_is_the_saturating_ml_dtypes_cast(name):
  fmt = lowprec.get_format(name)
  x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
  x = x * np.float32(fmt.max_finite / 4)
  x[:4] = [fmt.max_finite * 3, -fmt.max_finite * 3, 0.0, -0.0]
  got = np.asarray(lowprec.to_grid({"w": jnp.asarray(x)}, name)["w"])
  with np.errstate(over="ignore", invalid="ignore"):
    want = x.astype(fmt.native_dtype).astype(np.float32)
  want = np.where(np.isfinite(want), want, np.sign(x) * fmt.max_finite)
  np.testing.assert_array_equal(got, want)
  assert got.dtype == np.float32


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_storage_round_trip_is_exact(name):
  x = {"w": jax.random.normal(jax.random.key(1), (64, 32))}
  on_grid = lowprec.to_grid(x, name)
  native = lowprec.to_grid(on_grid, name, storage="native")
  assert native["w"].dtype == np.dtype(getattr(ml_dtypes, name, name))
  back = lowprec.to_grid(native, name)
  np.testing.assert_array_equal(
    np.asarray(back["w"]).view(np.uint32),
    np.asarray(on_grid["w"]).view(np.uint32),
  )
  lowprec.check_on_grid(native, name)


def test_to_grid_leaves_none_formats_alone_and_refuses_missing_native():
  out = lowprec.to_grid(PARAMS, [(".*kernel", "e8m3"), (".*", None)])
  assert (
    out["params"]["LayerNorm_0"]["scale"]
    is (PARAMS["params"]["LayerNorm_0"]["scale"])
  )
  with pytest.raises(ValueError, match="no native dtype.*storage='float32'"):
    lowprec.to_grid(PARAMS, "e8m3", storage="native")
  with pytest.raises(ValueError, match="unknown storage"):
    lowprec.to_grid(PARAMS, "e8m3", storage="fp8")


def test_check_on_grid_names_leaf_count_and_fix():
  params = {"a": {"w": jnp.array([0.1, 0.5, 0.3])}, "b": jnp.array([1.0])}
  with pytest.raises(ValueError) as e:
    lowprec.check_on_grid(params, "float8_e4m3fn")
  msg = str(e.value)
  assert "'a/w': 2 of 3 values off the float8_e4m3fn grid" in msg
  assert "'b'" not in msg and "lowprec.to_grid" in msg
  lowprec.check_on_grid(lowprec.to_grid(params, "float8_e4m3fn"), "e4m3")


def test_check_on_grid_accepts_int_grids_with_any_scale():
  fmt = lowprec.get_format("int8", scale=0.1)
  x = jnp.asarray(np.arange(-127, 128, dtype=np.float32) * np.float32(0.1))
  lowprec.check_on_grid({"w": x}, fmt)
  with pytest.raises(ValueError, match="1 of 1 values"):
    lowprec.check_on_grid({"w": jnp.array([0.15])}, fmt)


def test_check_on_grid_refuses_a_storage_that_cannot_hold_the_grid():
  w = {"w": jnp.zeros(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match="stored as bfloat16.*float8_e4m3fn"):
    lowprec.check_on_grid(w, "float8_e4m3fn")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_apply_updates_equals_optax_where_optax_works(dtype):
  k1, k2 = jax.random.split(jax.random.key(2))
  p = {"w": jax.random.normal(k1, (256,)).astype(dtype), "none": None}
  u = {"w": 1e-2 * jax.random.normal(k2, (256,)), "none": None}
  got, want = lowprec.apply_updates(p, u), optax.apply_updates(p, u)
  assert got["none"] is None and got["w"].dtype == dtype
  np.testing.assert_array_equal(
    np.asarray(got["w"], np.float32), np.asarray(want["w"], np.float32)
  )


def test_apply_updates_takes_native_float8():
  p = {"w": jnp.array([1.0, -2.0, 448.0], ml_dtypes.float8_e4m3fn)}
  u = {"w": jnp.array([0.125, -0.25, 0.0])}
  with pytest.raises(Exception, match="float8|promot"):
    optax.apply_updates(p, u)
  got = lowprec.apply_updates(p, u)["w"]
  assert got.dtype == ml_dtypes.float8_e4m3fn
  np.testing.assert_array_equal(
    np.asarray(got, np.float32), [1.125, -2.25, 448]
  )


# ---- leaves that are not parameters, and bad leaves ------------------------

# An Equinox-like tree: arrays next to a function, a Python float and a bool.
MIXED = {
  "w": jnp.array([0.1, 1.06, -3.3]),
  "act": jax.nn.gelu,
  "eps": 1e-5,
  "flag": True,
  "idx": jnp.arange(3),
}


def test_non_array_leaves_pass_through_to_grid_and_check_on_grid():
  rules = [("idx", None), (".*", "bfloat16")]
  out = lowprec.to_grid(MIXED, rules)
  # Untouched, by identity: eps is not rounded to 1.0013580322265625e-05.
  for k in ("act", "eps", "flag", "idx"):
    assert out[k] is MIXED[k], k
  want = np.asarray(MIXED["w"]).astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(out["w"]), want)
  lowprec.check_on_grid(out, rules)
  native = lowprec.to_grid(MIXED, rules, storage="native")
  assert native["w"].dtype == jnp.bfloat16 and native["eps"] == 1e-5
  # Non-arrays need no rule: only the arrays' paths are looked up.
  lowprec.check_on_grid(out, [("w", "bfloat16"), ("idx", None)])


@pytest.mark.parametrize(
  "call",
  [
    lambda t, f: lowprec.to_grid(t, f),
    lambda t, f: lowprec.check_on_grid(t, f),
    lambda t, f: lowprec.writeback(f).init(t),
  ],
  ids=["to_grid", "check_on_grid", "writeback.init"],
)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_an_int_or_bool_array_with_a_format_is_refused_naming_leaf_and_fix(
  call, dtype
):
  tree = {"w": jnp.zeros(3), "nested": {"count": jnp.zeros(3, dtype)}}
  with pytest.raises(ValueError) as e:
    call(tree, "bfloat16")
  msg = str(e.value)
  assert f"'nested/count' holds {np.dtype(dtype).name} values" in msg
  # The fix, and no circular advice to convert it or call to_grid.
  assert "(r'nested/count', None)" in msg and "eqx.filter" in msg
  assert "to_grid" not in msg and "astype" not in msg
  call(tree, [("nested/count", None), (".*", "bfloat16")])  # the fix works


def test_apply_updates_passes_through_leaves_whose_update_is_none():
  params = lowprec.to_grid(MIXED, [("idx", None), (".*", "bfloat16")])
  params["w"] = params["w"].astype(jnp.bfloat16)
  updates = {k: None for k in MIXED}
  updates["w"] = jnp.array([2**-7, 0.0, 2**-5], jnp.float32)
  out = lowprec.apply_updates(params, updates)
  for k in ("act", "eps", "flag", "idx"):
    assert out[k] is params[k], k
  assert out["w"].dtype == jnp.bfloat16
  want = np.asarray(params["w"], np.float32) + [2**-7, 0.0, 2**-5]
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32), want)
  # As in eqx.apply_updates, a None may stand for a whole subtree.
  nested = {"a": {"w": params["w"], "act": jax.nn.gelu}, "b": params["w"]}
  out = lowprec.apply_updates(nested, {"a": None, "b": updates["w"]})
  assert out["a"]["w"] is params["w"] and out["a"]["act"] is jax.nn.gelu
  np.testing.assert_array_equal(np.asarray(out["b"], np.float32), want)
  bad = dict(updates, eps=jnp.float32(1.0))
  with pytest.raises(ValueError, match="'eps' is a float, not an array"):
    lowprec.apply_updates(params, bad)


@pytest.mark.parametrize("u_shape", [(3, 2), (), (2,)], ids=str)
def test_apply_updates_names_the_leaf_and_both_shapes(u_shape):
  params = {"a": {"w": jnp.zeros((2, 3))}}
  updates = {"a": {"w": jnp.zeros(u_shape)}}
  with pytest.raises(ValueError) as e:
    lowprec.apply_updates(params, updates)
  msg = str(e.value)
  assert f"'a/w' has shape {u_shape}, the parameter (2, 3)" in msg

"""Formats against ml_dtypes (named) and the IEEE definition (generic)."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
from lowprec.grids.formats import NAMED

NATIVE = [n for n in NAMED if n != "float32"]
SMALL = [n for n in NATIVE if NAMED[n].bits <= 16]


def _codes(name):
  """Every code of a named format decoded by ml_dtypes, as float32."""
  fmt = NAMED[name]
  dt = fmt.native_dtype
  carrier = np.uint16 if dt.itemsize == 2 else np.uint8
  codes = np.arange(1 << fmt.bits, dtype=carrier)
  return codes.view(dt).astype(np.float32)


@pytest.mark.parametrize("name", NATIVE)
def test_limits_match_ml_dtypes_finfo(name):
  fmt = lowprec.get_format(name)
  fi = ml_dtypes.finfo(fmt.native_dtype)
  assert fmt.max_finite == float(fi.max)
  assert fmt.min_normal == float(fi.smallest_normal)
  assert fmt.min_subnormal == float(fi.smallest_subnormal)
  assert fmt.bits == fi.bits
  dt = fmt.native_dtype
  assert fmt.has_inf == bool(np.isinf(np.float32(np.inf).astype(dt)))
  assert fmt.has_nan == bool(np.isnan(_codes(name)).any())
  neg_zero = np.float32(-0.0).astype(dt).astype(np.float32)
  assert fmt.has_negative_zero == bool(np.signbit(neg_zero))


@pytest.mark.parametrize("name", SMALL)
def test_values_enumerate_every_code(name):
  with np.errstate(invalid="ignore"):
    decoded = _codes(name).astype(np.float64)
  finite = decoded[np.isfinite(decoded) & (decoded >= 0)]
  np.testing.assert_array_equal(
    np.unique(finite), lowprec.get_format(name).values()
  )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", SMALL)
def test_every_code_rounds_to_itself(name, jit):
  fmt = lowprec.get_format(name)
  v = _codes(name)
  v = v[~np.isnan(v) & (np.isfinite(v) | fmt.has_inf)]
  key = jax.random.key(0)

  def go(x):
    return (
      lowprec.round_nearest(x, fmt, overflow="ieee"),
      lowprec.round_stochastic(x, fmt, key, overflow="ieee"),
      fmt.is_on_grid(x),
    )

  rn, sr, on = (jax.jit(go) if jit else go)(jnp.asarray(v))
  np.testing.assert_array_equal(
    np.asarray(rn).view(np.uint32)[v != 0], v.view(np.uint32)[v != 0]
  )
  np.testing.assert_array_equal(np.asarray(sr), v)
  assert bool(np.all(on))


@pytest.mark.parametrize("name", SMALL + ["e8m3", "e5m0", "e2m4", "e7m5"])
def test_gaps_and_neighbours_walk_the_grid(name):
  fmt = lowprec.get_format(name)
  pos = fmt.values()
  grid = np.concatenate([-pos[::-1], pos[1:]])  # ascending, one zero
  x = jnp.asarray(grid, jnp.float32)
  up = np.asarray(jax.jit(fmt.next_up)(x), np.float64)
  down = np.asarray(jax.jit(fmt.next_down)(x), np.float64)
  np.testing.assert_array_equal(up[:-1], grid[1:])
  np.testing.assert_array_equal(down[1:], grid[:-1])
  assert up[-1] == np.inf and down[0] == -np.inf
  gu = np.asarray(jax.jit(fmt.gap_up)(x), np.float64)
  gd = np.asarray(jax.jit(fmt.gap_down)(x), np.float64)
  np.testing.assert_array_equal(gu[:-1], np.diff(grid))
  np.testing.assert_array_equal(gd[1:], np.diff(grid))
  assert gu[-1] == np.inf and gd[0] == np.inf
  np.testing.assert_array_equal(
    np.asarray(fmt.ulp(x)), np.where(grid >= 0, gu, gu[::-1])
  )


@pytest.mark.parametrize("name", ["bfloat16", "float8_e5m2", "e8m3", "e4m1"])
def test_midpoints_are_off_grid(name):
  fmt = lowprec.get_format(name)
  v = fmt.values()
  mid = (v[1:] + v[:-1]) / 2
  assert not np.asarray(fmt.is_on_grid(jnp.asarray(mid, jnp.float32))).any()
  assert not bool(fmt.is_on_grid(jnp.float32(np.nan)))
  above = np.nextafter(np.float32(fmt.max_finite), np.float32(np.inf))
  assert not bool(fmt.is_on_grid(jnp.float32(above)))


@pytest.mark.parametrize(
  "generic, named",
  [
    ("e8m7", "bfloat16"),
    ("e5m10", "float16"),
    ("e5m2", "float8_e5m2"),
    ("e4m3", "float8_e4m3"),
    ("e3m4", "float8_e3m4"),
  ],
)
def test_generic_spelling_has_the_named_grid(generic, named):
  g, n = lowprec.get_format(generic), lowprec.get_format(named)
  assert (g.max_finite, g.min_normal, g.min_subnormal) == (
    n.max_finite,
    n.min_normal,
    n.min_subnormal,
  )
  if g.bits <= 16:
    np.testing.assert_array_equal(g.values(), n.values())


def test_int_format_grid_and_gaps():
  fmt = lowprec.get_format("int3", scale=0.25)
  np.testing.assert_array_equal(fmt.values(), [0, 0.25, 0.5, 0.75])
  assert fmt.max_finite == 0.75
  x = jnp.asarray([-0.75, -0.25, 0.0, 0.75])
  np.testing.assert_array_equal(fmt.gap_up(x), [0.25, 0.25, 0.25, np.inf])
  np.testing.assert_array_equal(fmt.gap_down(x), [np.inf, 0.25, 0.25, 0.25])
  np.testing.assert_array_equal(fmt.next_up(x), [-0.5, 0.0, 0.25, np.inf])
  on = fmt.is_on_grid(jnp.asarray([0.5, 0.6, 1.0, -0.75]))
  np.testing.assert_array_equal(on, [True, False, False, True])


def test_formats_are_hashable_static_arguments():
  fmt = lowprec.get_format("float8_e4m3fn")
  assert lowprec.get_format(fmt) is fmt
  assert hash(fmt) == hash(lowprec.get_format("float8_e4m3fn"))
  f = jax.jit(lambda x, f: f.next_up(x), static_argnums=1)
  assert float(f(jnp.float32(1.0), fmt)) == 1.125


def test_unknown_name_lists_valid_names_and_suggests():
  with pytest.raises(ValueError, match="float8_e4m3fn") as e:
    lowprec.get_format("float8_e4m3f")
  assert "Did you mean 'float8_e4m3fn'" in str(e.value)
  assert "eXmY" in str(e.value) and "bfloat16" in str(e.value)


def test_unknown_name_suggests_and_lists_what_the_caller_also_takes():
  # A caller that takes scaled names too passes them (formats itself
  # knows only grids): they are suggested and listed.
  mx = ("mxfp8_e4m3", "mxfp4_e2m1")
  with pytest.raises(ValueError) as e:
    lowprec.get_format("mxfp8_e4m", also_valid=mx)
  assert "Did you mean 'mxfp8_e4m3'" in str(e.value)
  assert "mxfp4_e2m1" in str(e.value) and "bfloat16" in str(e.value)
  with pytest.raises(ValueError) as e:
    lowprec.get_format("mxfp8_e4m")  # without them: none is named
  assert "mxfp" not in str(e.value).replace("'mxfp8_e4m'", "")


@pytest.mark.parametrize(
  "name, kwargs, match",
  [
    ("int3", {}, "needs a positive finite scale"),
    ("int3", {"scale": -1.0}, "needs a positive finite scale"),
    ("int9", {"scale": 1.0}, "K in 2..8"),
    ("e9m3", {}, "X in 2..8"),
    ("e4m24", {}, "Y in 0..23"),
    ("bfloat16", {"scale": 1.0}, "intK formats only"),
  ],
)
def test_bad_format_arguments(name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    lowprec.get_format(name, **kwargs)


# A name is resolved (and a choice checked) where it enters: the public
# functions. The underscore functions of these modules take resolved
# `Format`s / `ScaledFormat`s / `Codec`s, except the two that resolve for
# the public functions.
_RESOLVERS = {"get_format", "get_scaled_format", "is_scaled", "check_choice"}
_RESOLVING_HELPERS = {"_check_overflow", "_resolved"}
_LIB = pathlib.Path(lowprec.__file__).parent


def _called(fn: ast.AST) -> set[str]:
  out = set()
  for node in ast.walk(fn):
    if isinstance(node, ast.Call):
      f = node.func
      out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
  return out


@pytest.mark.parametrize(
  "module", ["grids/rounding.py", "grids/scaled.py", "engine/codec.py"]
)
def test_underscore_functions_take_resolved_formats(module):
  tree = ast.parse((_LIB / module).read_text())
  resolving = _RESOLVERS | _RESOLVING_HELPERS
  bad = {
    fn.name: sorted(_called(fn) & resolving)
    for fn in ast.walk(tree)
    if isinstance(fn, ast.FunctionDef)
    and fn.name.startswith("_")
    and not fn.name.startswith("__")
    and fn.name not in _RESOLVING_HELPERS
    and _called(fn) & resolving
  }
  assert not bad, f"{module}: helpers that resolve a name again: {bad}"

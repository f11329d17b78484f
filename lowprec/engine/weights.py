"""Where weights on a grid live: formats per parameter, storage, landing.

Weights on a grid are stored either as float32 arrays holding grid values
exactly (works for every format; the default) or in the format's native
dtype (`bfloat16`, `float16`, `float8_*`). Both are "no master weights": no
other copy of the parameters exists.

A format specification assigns a format (or None: leave the parameter alone)
to every parameter, in one of three forms:

* one format for every parameter: `"float8_e4m3fn"`, `get_format("int3",
  scale=0.125)`;
* a pytree of formats shaped like the params, or like a prefix of them:
  `{"dense": "float8_e4m3fn", "norm": None}`;
* ordered rules, a list of `(regex, format_or_None)` pairs matched with
  `re.fullmatch` against "/"-joined parameter paths such as
  `"params/Dense_0/kernel"`; the first match wins, and a path that matches no
  rule is an error.

Only array leaves are parameters. Other leaves (functions, Python numbers
and strings, which an Equinox module keeps next to its arrays) need no
format and pass through every function here untouched, so an unfiltered
Equinox model can be handed over as it is. An integer or boolean array has
no grid: give it a None format, or hand over only the float arrays
(`eqx.filter(model, eqx.is_inexact_array)`).

Example:
  ```python
  rules = [(r".*(bias|scale)", None), (r".*", "float8_e4m3fn")]
  params = lowprec.to_grid(params, rules)  # float32 on the e4m3fn grid
  lowprec.check_on_grid(params, rules)  # raises if a value is off grid
  fp8 = lowprec.to_grid(params, rules, storage="native")  # for export
  ```
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.engine import stacked
from lowprec.engine.rules import (  # noqa: F401  (the parameter dialect, re-exported)
  FormatLookup,
  format_lookup,
  is_array,
  path_name,
  rule_lookup,
)
from lowprec.grids import scaled
from lowprec.grids.formats import Format
from lowprec.grids.rounding import round_nearest

STORAGES = ("float32", "native")


class Float8ParamsWarning(UserWarning):
  """A write-back's `init` met params stored in a one-byte float dtype:
  land its deltas with `lowprec.apply_updates`, not `optax.apply_updates`.
  Silence it where that is done already: `warnings.simplefilter("ignore",
  lowprec.engine.weights.Float8ParamsWarning)`."""


def leaf_format(lookup: FormatLookup, path, x) -> Format | None:
  """The format of the leaf `x` at `path`; None for a leaf that is not an
  array (it is no parameter, and needs no rule) or that the spec leaves
  alone. Raises for an integer or boolean array given a format."""
  if not is_array(x):
    return None
  fmt = _stacked_format(lookup, path)
  if fmt is not None:
    check_float(path_name(path), x.dtype)
  return fmt


def _stacked_format(lookup: FormatLookup, path):
  """`lookup(path)`; for a leaf holding stacked layers (`h_0:12/...`,
  `lowprec.engine.stacked`), the format every layer's own path has."""
  layers = stacked.layer_paths(path)
  if layers is None:
    return lookup(path)
  fmts = [lookup(p) for p in layers]
  if any(f != fmts[0] for f in fmts[1:]):
    which = sorted({str(f) for f in fmts})
    raise ValueError(
      f"parameter {path_name(path)!r} stacks layers whose formats differ "
      f"({', '.join(which)}); store those layers apart, or give them one "
      "format"
    )
  return fmts[0]


def check_float(name: str, dtype) -> None:
  """Raises unless `dtype` is a floating-point dtype, naming the fix."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return
  raise ValueError(
    f"parameter {name!r} holds {dtype.name} values: only floating-point "
    "arrays go on a grid. Give it a None format (a rule "
    f"(r{name!r}, None) before the others), or hand over only the float "
    "arrays (Equinox: eqx.filter(model, eqx.is_inexact_array))"
  )


def check_storage(name: str, dtype, fmt: Format) -> None:
  """Raises unless `dtype` holds `fmt`'s grid: float32, or the native dtype."""
  dtype = np.dtype(dtype)
  if dtype == np.float32 or dtype == fmt.native_dtype:
    return
  if isinstance(fmt, scaled.ScaledFormat):
    check_float(name, dtype)
    raise ValueError(
      f"parameter {name!r} is stored as {dtype.name}; a parameter on the "
      f"scaled {fmt} grid is stored as float32 holding its values "
      "(elements times scales): lowprec.to_grid(params, fmt)"
    )
  check_float(name, dtype)
  native = f" or {fmt.native_dtype.name}" if fmt.native_dtype else ""
  raise ValueError(
    f"parameter {name!r} is stored as {dtype.name}, which is not a storage "
    f"of the {fmt} grid (float32{native}); convert it with "
    f"lowprec.to_grid(params, fmt, storage=...)"
  )


def to_grid(params, fmt, *, storage: str = "float32"):
  """Rounds params to their formats' grids (nearest, saturating).

  `w -> RN(w)`, ties to even, values beyond the largest finite one clipped to
  it. Rounding is the identity on grid values, so on params already on the
  grid this is an exact conversion between storages: use it to export
  float32-on-grid weights to native FP8 and to load them back.

  Args:
    params: a pytree of float arrays (any float dtype); leaves that are not
      arrays (an Equinox module's functions and Python numbers) are
      returned unchanged.
    fmt: a format specification (one format, a pytree of formats, or
      `(regex, format)` rules; see the module docstring). Parameters whose
      format is None are returned unchanged.
    storage: "float32" (every format) or "native" (the format's own dtype,
      e.g. `float8_e4m3fn`; not available for `eXmY` and `intK`).

  Returns:
    A pytree like `params` holding grid values in the chosen storage.

  Raises:
    ValueError: unknown storage, a format without a native dtype under
      `storage="native"`, a parameter the specification does not cover, or
      an integer or boolean array given a format.

  Example:
    ```python
    w = {"kernel": jnp.array([0.1, 1.06, 500.0])}
    lowprec.to_grid(w, "float8_e4m3fn")["kernel"]
    # Array([  0.1015625,   1.       , 448.       ], dtype=float32)
    ```
  """
  if storage not in STORAGES:
    raise ValueError(
      f"unknown storage {storage!r}; valid: {', '.join(STORAGES)}"
    )
  lookup = format_lookup(fmt)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = [x for _, x in flat]
  picked, fmts, dtypes = [], [], []
  for i, (path, x) in enumerate(flat):
    f = leaf_format(lookup, path, x)
    if f is None:
      continue
    if storage == "native" and f.native_dtype is None:
      raise ValueError(
        f"parameter {path_name(path)!r}: format {f} has no native dtype; "
        "store it as float32 holding grid values (storage='float32')"
      )
    picked.append(i)
    fmts.append(f)
    dtypes.append(
      np.dtype(np.float32) if storage == "float32" else f.native_dtype
    )
  rounded = _round_all([leaves[i] for i in picked], tuple(fmts), tuple(dtypes))
  for i, x in zip(picked, rounded, strict=True):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


# One compiled program per tree and formats, not one dispatch per operation.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _round_all(xs, fmts, dtypes):
  return [
    _nearest(jnp.asarray(x), f).astype(d)
    for x, f, d in zip(xs, fmts, dtypes, strict=True)
  ]


def _nearest(x, f):
  if isinstance(f, scaled.ScaledFormat):  # new scales from x itself
    return scaled.fake_quantize(x, f)
  return round_nearest(x, f)


@functools.partial(jax.jit, static_argnums=1)
def _off_grid(xs, fmts):
  """Per leaf: counts of NaN, of infinities the grid lacks and of other
  off-grid values, and the flat index of the first of the last."""
  out = []
  for x, f in zip(xs, fmts, strict=True):
    x = jnp.asarray(x).reshape(-1)
    nan = jnp.isnan(x)
    inf = jnp.isinf(x) & (not f.has_inf)
    if isinstance(f, scaled.ScaledFormat):
      # On the grid of its own scales: nearest rounding gives it back.
      full = jnp.asarray(xs[len(out)])
      on = (scaled.fake_quantize(full, f) == full).reshape(-1)
    else:
      on = f.is_on_grid(x)
    off = ~on & ~nan & ~inf
    first = jnp.argmax(off) if x.size else jnp.zeros([], jnp.int32)
    count = [jnp.sum(m, dtype=jnp.int32) for m in (nan, inf, off)]
    out.append((*count, first))
  return out


def check_on_grid(params, fmt) -> None:
  """Raises if any parameter value is off its format's grid.

  A value is on the grid when the format holds it exactly (zero of either
  sign, infinities where the format has them; never NaN). NaN, and
  infinities in a format without them, are reported as non-finite values,
  since no rounding fixes them.

  Args:
    params: a pytree of concrete arrays (not traced: call it outside jit);
      leaves that are not arrays are skipped.
    fmt: a format specification, as in `to_grid`.

  Raises:
    ValueError: naming every offending parameter with its count of off-grid
      values and the first of them, and the fix (`lowprec.to_grid`), or its
      count of non-finite values; also for a storage dtype that cannot hold
      the grid (an integer or boolean array given a format among them).

  Example:
    ```python
    lowprec.check_on_grid({"w": jnp.array([0.1])}, "bfloat16")
    # ValueError: 1 parameter(s) off their grid: 'w': 1 of 1 values off the
    # bfloat16 grid (first: 0.100000001). Put them on the grid first: ...
    ```
  """
  lookup = format_lookup(fmt)
  leaves = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    f = leaf_format(lookup, path, x)
    if f is not None:
      check_storage(path_name(path), x.dtype, f)
      leaves.append((path_name(path), x, f))
  found = _off_grid([x for _, x, _ in leaves], tuple(f for *_, f in leaves))
  bad, nonfinite = [], []
  for (name, x, f), (nan, inf, count, first) in zip(
    leaves, jax.device_get(found), strict=True
  ):
    if nan or inf:
      what = [f"{int(nan)} NaN"] if nan else []
      what += [f"{int(inf)} infinite ({f} has no inf)"] if inf else []
      nonfinite.append(f"{name!r}: {' and '.join(what)} of {np.size(x)}")
    if count:
      value = np.asarray(x, np.float32).reshape(-1)[first]
      bad.append(
        f"{name!r}: {int(count)} of {np.size(x)} values off the {f} grid "
        f"(first: {float(value):.9g})"
      )
  if nonfinite:
    raise ValueError(
      f"{len(nonfinite)} parameter(s) hold non-finite values: "
      + "; ".join(nonfinite)
      + ". No rounding puts these on a grid: the run diverged or was fed "
      "non-finite data or updates; restore the last good checkpoint (and "
      "look at the loss and learning rate), or keep non-finite updates out "
      "with writeback(..., nonfinite='keep')"
      + (". Also off the grid: " + "; ".join(bad) if bad else "")
    )
  if bad:
    raise ValueError(
      f"{len(bad)} parameter(s) off their grid: "
      + "; ".join(bad)
      + ". Put them on the grid first: params = lowprec.to_grid(params, fmt)"
    )


def apply_updates(params, updates):
  """`optax.apply_updates` that also takes float8 (and narrower) params.

  `w' = cast(w + u)` to `w`'s dtype, as `optax.apply_updates` does wherever
  that works (and with the same result there). JAX refuses to add float8 and
  float32 implicitly, so float8/float6/float4 params are widened to float32
  first. With the deltas of `lowprec.writeback`, `w + u` is exactly the new
  grid value, so the final cast is exact for every storage.

  It also takes an Equinox module as it is: a leaf whose update is None
  (`eqx.filter_grad` gives None for every leaf it does not differentiate)
  is returned unchanged, functions and Python numbers included. So bfloat16
  params stay bfloat16, where `eqx.apply_updates` returns `w + u` uncast
  (float32, for float32 updates).

  Args:
    params: a pytree of arrays (None leaves stay None), or a module whose
      non-array leaves have None updates.
    updates: a pytree of the same structure, with arrays shaped like the
      params' or None; as in `eqx.apply_updates`, a None may stand for a
      whole subtree of `params`, which is then returned unchanged.

  Returns:
    The updated params, each leaf in its original dtype.

  Raises:
    ValueError: an update whose shape differs from its parameter's, or an
      update for a leaf that is not an array; naming the leaf.

  Example:
    ```python
    w = lowprec.to_grid(w, "float8_e4m3fn", storage="native")
    updates, state = opt.update(grads, state, w)
    w = lowprec.apply_updates(w, updates)  # still float8_e4m3fn
    ```
  """
  is_none = lambda x: x is None

  def spread(u, p):  # a None over a subtree: no update anywhere in it
    return jax.tree.map(lambda _: None, p) if u is None else u

  updates = jax.tree.map(spread, updates, params, is_leaf=is_none)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)
  out = []
  for (path, p), u in zip(flat, treedef.flatten_up_to(updates), strict=True):
    out.append(p if p is None or u is None else _add(path_name(path), p, u))
  return jax.tree_util.tree_unflatten(treedef, out)


def _add(name: str, p, u):
  if not is_array(p):
    raise ValueError(
      f"apply_updates: parameter {name!r} is a {type(p).__name__}, not an "
      "array, but has an update; give it a None update (Equinox: take "
      "gradients with eqx.filter_grad, or filter the updates with "
      "eqx.filter(updates, eqx.is_array))"
    )
  check_shape("apply_updates", name, p, u)
  p = jnp.asarray(p)
  if jnp.issubdtype(p.dtype, jnp.floating) and p.dtype.itemsize == 1:
    return (p.astype(jnp.float32) + u).astype(p.dtype)
  return jnp.asarray(p + u).astype(p.dtype)


def check_shape(where: str, name: str, p, u) -> None:
  """Raises unless the update `u` has the shape of its parameter `p`."""
  if jnp.shape(u) != jnp.shape(p):
    raise ValueError(
      f"{where}: the update of parameter {name!r} has shape "
      f"{tuple(jnp.shape(u))}, the parameter {tuple(jnp.shape(p))}; pass "
      "updates computed for these params (the same tree, leaf for leaf)"
    )

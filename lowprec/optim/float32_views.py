"""Running an optimizer in float32 next to low-precision stored params.

Params stored natively in a narrow dtype give gradients of that dtype
(`jax.grad` returns cotangents in the primal's dtype), and optax sizes an
optimizer's state like the params: `optax.adam` on `float8_e4m3fn` params
keeps float8 moments, whose squares underflow to zero and whose updates
become NaN. `in_float32` runs any transform on float32 views of the params
and updates, so its state is float32 and its proposals are float32, as
`lowprec.writeback` requires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lowprec.engine.weights import is_array


def _widen(tree):
  def one(x):
    if not is_array(x):  # None, or an Equinox module's functions, floats
      return x
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
      return jnp.asarray(x).astype(jnp.float32)
    return x

  return jax.tree.map(one, tree, is_leaf=lambda x: x is None)


def in_float32(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Runs `inner` on float32 views of params and updates (narrower floats).

  `init(params)` is `inner.init(f32(params))`, and `update(g, s, params)` is
  `inner.update(f32(g), s, f32(params))`, where `f32` widens every floating
  leaf narrower than float32 (float8, float16, bfloat16) exactly and leaves
  the rest alone (leaves that are not arrays included). So the inner state
  (Adam's moments, say) is float32 and the proposals it returns are
  float32. No copy of the params is kept: the views exist only inside each
  call.

  Place it around the transforms that come before `lowprec.writeback`:

    optax.chain(lowprec.in_float32(optax.adamw(1e-3)),
                lowprec.writeback("float8_e4m3fn"))

  Args:
    inner: any optax transform (extra update arguments are passed on).

  Returns:
    An `optax.GradientTransformationExtraArgs` with the same state
      structure as `inner` would have for float32 params.

  Raises:
    TypeError: `inner` is not an optax transform (e.g. `optax.adam`, the
      function, rather than `optax.adam(1e-3)`).

  Example:
    ```python
    p = lowprec.to_grid({"w": w}, "float8_e4m3fn", storage="native")
    tx = optax.chain(lowprec.in_float32(optax.adam(1e-2)),
                     lowprec.writeback("float8_e4m3fn"))
    state = tx.init(p)  # Adam's moments are float32
    updates, state = tx.update(jax.grad(loss)(p), state, p)
    p = lowprec.apply_updates(p, updates)  # still float8_e4m3fn
    ```
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    called = "; call the factory first" if callable(inner) else ""
    raise TypeError(
      "in_float32 wraps an optax transform (an object with init and "
      "update, such as optax.adam(1e-3)), got "
      f"{type(inner).__name__} {inner!r:.60}{called}: "
      "lowprec.in_float32(optax.adam(1e-3))"
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return inner.init(_widen(params))

  def update_fn(updates, state, params=None, **extra):
    return inner.update(_widen(updates), state, _widen(params), **extra)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

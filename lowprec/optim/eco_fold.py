"""ECO's fold read off the optimizer: `r` and `D` in closed form.

`lowprec.eco` folds `e (1 - r) / D` into the first moment, with `r =
dm'/dm` and `D = du/dm` the derivatives of the optimizer's new moment and
of its update with respect to the moment it read. Taken by `jax.jvp`,
they cost a second pass of the optimizer's arithmetic (for Adam a
division per element, and the fold divides again). For the momentum
optimizers optax builds they have closed forms:

  trace (SGD with momentum):  r = beta,  D = beta s   (Nesterov: beta^2 s)
  scale_by_adam (Adam, AdamW): r = b1,   D = b1 s / ((1 - b1^t) den)
    (NAdam: D = b1^2 s / ((1 - b1^(t+1)) den)),
    den = sqrt(nu / (1 - b2^t) + eps_root) + eps,

where `s` is the product of the scales applied after the moment (the
learning rate, or its schedule at this step, as `-lr`) and `nu`, `t` the
second moment and count Adam has just written. The fold is then
`(e k) den` with the scalar `k = (1 - r) / (gain s)` (`gain` the factor of
`s` and `1 / den` above): one product per element for heavy ball; for
Adam two, and `den` with a square root of its own (sharing Adam's would
change Adam's bits across shardings: see `coefficients`); no division and
no tangent pass.

Where they are read. optax keeps the hyperparameters in the closures of
its update functions, not in its states. `read` walks `optax.chain` down
to its transforms, knows each by its update function's module and
qualified name, and takes the hyperparameters from the closure's
variables (`inspect.getclosurevars`). Transforms before the moment may be
anything (a gradient clip, `scale_by_rms`): they act on the gradient, on
which `r` and `D` do not depend. The moment is `trace` or
`scale_by_adam`, and every transform after it must be known: `scale`,
`scale_by_schedule` (the two `scale_by_learning_rate` builds),
`add_decayed_weights` (with or without a mask: it adds `wd W`, which does
not depend on the moment) or `identity`. Anything else around or after
the moment (`optax.inject_hyperparams`, `optax.masked` around it, a clip
of the update) leaves `read` with None, and eco takes the derivatives by
`jax.jvp`.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowprec.engine.weights import path_name

__all__ = ["Coefficients", "Form", "coefficients", "read"]

# (module, qualified name) of the update functions read here -> kind.
_KNOWN = {
  ("optax.transforms._accumulation", "trace.<locals>.update_fn"): "trace",
  ("optax._src.transform", "scale_by_adam.<locals>.update_fn"): "adam",
  ("optax._src.transform", "scale.<locals>.update_fn"): "scale",
  ("optax._src.transform", "scale_by_schedule.<locals>.update_fn"): (
    "schedule"
  ),
  ("optax.transforms._adding", "add_decayed_weights.<locals>.update_fn"): (
    "additive"
  ),
  ("optax._src.base", "identity.<locals>.update_fn"): "additive",
}
# The closure variables each kind is read from.
_NEEDS = {
  "trace": {"decay", "nesterov"},
  "adam": {"b1", "b2", "eps", "eps_root", "nesterov"},
  "scale": {"step_size"},
  "schedule": {"step_size_fn"},
  "additive": set(),
}
_MOMENTS = ("trace", "adam")
_SCALES = ("scale", "schedule")
_CHAIN = ("optax.transforms._combining", "chain.<locals>.update_fn")
_EXTRA_ARGS = ("optax._src.base", "with_extra_args_support.<locals>.update")
_MASKED = ("optax.transforms._masking", "masked.<locals>.update_fn")


class _Piece(NamedTuple):
  kind: str | None  # a value of _KNOWN; None: a transform not read here
  at: tuple[int, ...]  # chain positions from the top state to its state
  hyper: dict[str, Any]  # its closure's variables


class Form(NamedTuple):
  """How an optimizer's `r` and `D` are computed (module docstring)."""

  moment: _Piece  # the `trace` or `scale_by_adam` that keeps the moment
  scales: tuple[_Piece, ...]  # the `scale`s and schedules after it


class Coefficients(NamedTuple):
  """`r = rate`, `D = slope / den` (`den` for Adam only)."""

  rate: jax.Array  # float32 []
  slope: jax.Array  # float32 []
  den: dict[str, jax.Array] | None  # per parameter path, like the param


def read(tx) -> Form | None:
  """The closed form of `tx`'s `r` and `D`, or None where `tx` is not
  built of transforms read here (see the module docstring)."""
  pieces = _walk(tx.update, ())
  at = [i for i, p in enumerate(pieces) if p.kind in _MOMENTS]
  if len(at) != 1:
    return None
  after = pieces[at[0] + 1 :]
  if any(p.kind is None for p in after):
    return None
  return Form(pieces[at[0]], tuple(p for p in after if p.kind in _SCALES))


def _walk(fn, at: tuple[int, ...]) -> list[_Piece]:
  """The transforms under update function `fn`, in the order they run."""
  name = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
  free = _closure(fn)
  if name == _CHAIN and "update_fns" in free:
    return [
      p for i, f in enumerate(free["update_fns"]) for p in _walk(f, (*at, i))
    ]
  if name == _EXTRA_ARGS and "tx" in free:
    return _walk(free["tx"].update, at)
  if name == _MASKED and "inner" in free:
    # A mask around transforms that add what does not depend on the
    # moment (AdamW's decay with a mask) scales nothing.
    inner = _walk(free["inner"].update, at)
    additive = all(p.kind == "additive" for p in inner)
    return [_Piece("additive" if additive else None, at, {})]
  kind = _KNOWN.get(name)
  if kind is None or not _NEEDS[kind] <= set(free):
    return [_Piece(None, at, {})]
  return [_Piece(kind, at, free)]


def _closure(fn) -> dict[str, Any]:
  try:
    return dict(inspect.getclosurevars(fn).nonlocals)
  except TypeError:  # not a Python function (a callable object, a partial)
    return {}


def coefficients(form: Form, old, new) -> Coefficients:
  """`r` and `D` of this step, from the inner state before (`old`) and
  after (`new`) the update, as the optimizer computed its update."""
  hyper = form.moment.hyper
  f32 = jnp.float32
  if form.moment.kind == "trace":
    beta = jnp.asarray(hyper["decay"], f32)
    rate = beta
    gain = beta * beta if hyper["nesterov"] else beta
    den = None
  else:
    b1 = hyper["b1"]
    rate = jnp.asarray(b1, f32)
    # Adam's t (its count after the step) from the count before it: the
    # same float32 value below 2^24 steps (within a rounding above) by
    # another expression. Nothing here may be an expression of Adam's, which
    # XLA would merge with it: a second user of Adam's corrections
    # changes how XLA compiles Adam's divisions by them, in one program
    # and not another, and the update's last bit would then differ
    # between one device and several.
    t = _at(old, form.moment.at).count.astype(f32) + 1
    # The tangent optax's Adam would carry: b1, divided by the correction.
    if hyper["nesterov"]:
      gain = b1 * (rate / (1 - rate ** (t + 1)))
    else:
      gain = rate / (1 - rate**t)
    inv = 1 / (1 - jnp.asarray(hyper["b2"], f32) ** t)
    nus = _at(new, form.moment.at).nu
    den = {
      path_name(p): _adam_den(nu, inv, hyper)
      for p, nu in jax.tree_util.tree_flatten_with_path(nus)[0]
    }
  slope = jnp.asarray(gain, f32)
  for piece in form.scales:
    if piece.kind == "scale":
      step = piece.hyper["step_size"]
    else:
      step = piece.hyper["step_size_fn"](_at(old, piece.at).count)
    slope = slope * jnp.asarray(step, f32)
  return Coefficients(rate, slope, den)


def _adam_den(nu, inv, hyper):
  """Adam's `sqrt(nu / (1 - b2^t) + eps_root) + eps`, with `1 / (1 - b2^t)`
  given (`inv`): a product, which XLA compiles the same way everywhere,
  where a division by a broadcast scalar it may compile as a product with
  the rounded reciprocal in one program and not in another."""
  nu_hat = nu.astype(jnp.float32) * inv
  eps_root = hyper["eps_root"]
  if not (isinstance(eps_root, int | float) and eps_root == 0):
    nu_hat = nu_hat + eps_root
  return jnp.sqrt(nu_hat) + hyper["eps"]


def _at(state, at: tuple[int, ...]):
  for i in at:
    state = state[i]
  return state

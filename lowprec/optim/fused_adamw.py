"""AdamW with stored moments and its write-back in one kernel per leaf.

`stored_adamw_writeback` is the chain

    scale_by_stored_adam(b1, b2, eps, eps_root, mu=, nu=)
    -> optax.add_decayed_weights(weight_decay)
    -> optax.scale_by_learning_rate(learning_rate)
    -> lowprec.writeback(fmt, rounding)

(its state, its bits), with every leaf that both kernels take stepped by
one: it reads the gradient, the moments' codes and scales and the
weights, and writes the new codes, scales and the write-back's exact
deltas, each array read or written once. Chained as four transforms,
with a kernel for the moments and one for the write-back, Adam's
direction goes through memory between them, and the decay and the step
size in XLA's ops between: about 48 bytes a parameter for the q8
moments and float32 weights by the arrays' sizes, against 28 in one
pass, which is AdamW's own (`optax.adamw`'s float32 moments: 28). The
kernel is FlashOptim's design (dequantize, Adam, requantize and apply in
one pass), here with `lowprec.writeback`'s rounding and counts.

A leaf takes the one kernel where `scale_by_stored_adam`'s kernel takes
it (a last axis of whole blocks) and its weights are on a plain float
grid and stored in float32, bfloat16 or float16 (optax multiplies the
decay in the weights' dtype, and Triton's float8 products would not be
XLA's); other leaves step through the chain leaf by leaf, each
transform on the XLA path. Where the kernel runs (`kernel`) is
`scale_by_stored_adam`'s choice; `"xla"` is the chain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lowprec.engine import counting, leafwise
from lowprec.engine.weights import format_lookup, path_name
from lowprec.grids import choices
from lowprec.grids import rng as rng_lib
from lowprec.grids.formats import Format
from lowprec.optim import fused_adam
from lowprec.optim import stored_state as stored_lib
from lowprec.optim import writeback as writeback_lib
from lowprec.optim.stored_state import _FIELDS

__all__ = ["stored_adamw_writeback"]

# Weights' dtypes the one kernel takes.
_DTYPES = ("float32", "bfloat16", "float16")


def stored_adamw_writeback(
  learning_rate: optax.ScalarOrSchedule,
  fmt,
  rounding: str = "nearest",
  *,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  weight_decay: float = 1e-4,
  mu: str = "companded8:block32",
  nu: str = "sqrt8:block32",
  key: jax.Array | None = None,
  writeback_key: jax.Array | None = None,
  telemetry: bool = True,
  overflow: str = "saturate",
  nonfinite: str = "keep",
  kernel: str = "auto",
) -> optax.GradientTransformation:
  """AdamW with 8- or 4-bit moments, then the write-back of the weights
  onto `fmt`, each leaf in one kernel (module docstring).

  The same transform, state and bits as

  ```python
  key_mu, key_w = jax.random.split(key)
  optax.chain(
      lowprec.scale_by_stored_adam(b1, b2, eps, eps_root, mu=mu, nu=nu,
                                   key=key_mu, telemetry=telemetry),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
      lowprec.writeback(fmt, rounding, key=key_w, telemetry=telemetry,
                        overflow=overflow, nonfinite=nonfinite),
  )
  ```

  (each key None where its transform rounds to nearest). Its updates are the
  write-back's deltas: land them with `optax.apply_updates` (or
  `lowprec.apply_updates`), and read its counts with `lowprec.telemetry`.

  Args:
    learning_rate: a float or an optax schedule, as `optax.adamw` takes it.
    fmt: the weights' grid, as `lowprec.writeback` takes it.
    rounding: the write-back's, "nearest", "stochastic" or "deadzone".
    b1: Adam's first-moment decay, as `optax.scale_by_adam` takes it.
    b2: Adam's second-moment decay.
    eps: added to the root of the second moment.
    eps_root: added to the second moment inside the root.
    weight_decay: a float, decoupled as `optax.adamw` applies it.
    mu: the first moment's spec, as `scale_by_stored_adam` takes it.
    nu: the second moment's spec, likewise.
    key: a JAX PRNG key, required where the write-back or a moment
      rounds at random; split in two, the first for the moments and the
      second for the write-back.
    writeback_key: the write-back's own key, in place of `key`'s second
      half: `key` is then the moments' whole (None where they round to
      nearest), so that the chain's two transforms keep the keys a
      training loop gave them before.
    telemetry: the moments' counts and the write-back's (a bool).
    overflow: the write-back's, as `lowprec.writeback` takes it.
    nonfinite: the write-back's, as `lowprec.writeback` takes it.
    kernel: "auto", "pallas" or "xla", as `scale_by_stored_adam` takes it.

  Raises:
    ValueError: what `scale_by_stored_adam` or `lowprec.writeback` raise
      for their arguments; a weight decay that is not a float;
      `telemetry` that is not a bool (counting every k-th update is
      `lowprec.writeback`'s, in the chain).
  """
  choices.check_choice("kernel", kernel, fused_adam.KERNELS)
  if not isinstance(weight_decay, int | float):
    raise ValueError(
      "stored_adamw_writeback takes a float weight_decay; for a schedule, "
      "chain the four transforms (the docstring's chain)"
    )
  if not isinstance(telemetry, bool):
    raise ValueError(
      f"stored_adamw_writeback counts every update or none (telemetry="
      f"{telemetry!r}): give True or False, or chain the four transforms "
      "with lowprec.writeback(..., telemetry=k)"
    )
  specs = {"mu": mu, "nu": nu}
  formats = {n: stored_lib.parse_state_format(s) for n, s in specs.items()}
  random_mu = any(f.rounding != "nearest" for f in formats.values())
  random_w = rounding != "nearest"
  key_mu = key_w = None
  what = "stored_adamw_writeback with a random rounding"
  if writeback_key is not None:
    key_mu, key_w = key, writeback_key
    if random_mu:
      rng_lib.state_key(key_mu, what)
  elif random_mu or random_w:
    rng_lib.state_key(key, what)
    key_mu, key_w = jax.random.split(key)
  key_mu = key_mu if random_mu else None
  key_w = key_w if random_w else None
  adam = fused_adam.scale_by_stored_adam(
    b1,
    b2,
    eps,
    eps_root,
    mu=mu,
    nu=nu,
    kernel="xla",
    key=key_mu,
    telemetry=telemetry,
  )
  decay = optax.add_decayed_weights(weight_decay)
  scale = optax.scale_by_learning_rate(learning_rate)
  wb = writeback_lib.writeback(
    fmt,
    rounding,
    key=key_w,
    telemetry=telemetry,
    overflow=overflow,
    nonfinite=nonfinite,
  )
  chain = optax.chain(adam, decay, scale, wb)

  def init_fn(params):
    _check_decayed_dtypes(params, weight_decay)
    return chain.init(params)

  reference = optax.GradientTransformation(init_fn, chain.update)
  if kernel == "xla" or fused_adam._unheld(formats):
    return reference
  codecs = {n: f.codec() for n, f in formats.items()}
  hyper = (b1, b2, eps, eps_root)
  lookup = format_lookup(fmt)
  leaf = leafwise.Plain(rounding, overflow, nonfinite, telemetry, "recompute")
  impl = {
    n: rng_lib.state_key(k, "")[1]
    for n, k in (("mu", key_mu), ("w", key_w))
    if k is not None
  }

  def takes(g, w, f) -> bool:
    return (
      fused_adam._held(g, codecs)
      and isinstance(f, Format)
      and f.is_float
      and jnp.dtype(w.dtype).name in _DTYPES
      and jnp.shape(w) == jnp.shape(g)
    )

  def update_fn(updates, state, params=None):
    if params is None or not fused_adam._kernel_here(kernel, codecs):
      return reference.update(updates, state, params)
    s_adam, s_decay, s_scale, s_wb = state
    count, corrections = fused_adam._corrections(hyper, s_adam)
    flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
    mus = treedef.flatten_up_to(s_adam.inner.mu)
    nus = treedef.flatten_up_to(s_adam.inner.nu)
    ws = treedef.flatten_up_to(params)
    names = [path_name(path) for path, _ in flat_g]
    fmts = [
      leafwise.weight_format(lookup, path, w)
      for (path, _), w in zip(flat_g, ws, strict=True)
    ]
    held = {
      n
      for n, (_, g), w, f in zip(names, flat_g, ws, fmts, strict=True)
      if f is not None and takes(g, w, f)
    }
    # The moments' keys as scale_by_stored_adam draws them, and the
    # write-back's of the leaves stepped here as writeback draws them
    # (each leaf's fold is its own, so the others' are as they were).
    moments_random = [n for n, f in formats.items() if f.rounding != "nearest"]
    new_key, keys = fused_adam._step_keys(
      s_adam, impl.get("mu"), moments_random, names
    )
    wb_keys = {}
    if rounding != "nearest" and held:
      _, wb_step = rng_lib.next_step(s_wb.key, impl["w"])
      wb_keys = rng_lib.leaf_keys(wb_step, sorted(held))
    step_size = _step_size(learning_rate, s_scale)
    directions, out_mu, out_nu = [], [], []
    deltas, scales, per, per_wb = {}, {}, {}, {}
    for name, (_, g), m, v, w, f in zip(
      names, flat_g, mus, nus, ws, fmts, strict=True
    ):
      mu_s = s_adam.scales[f"mu/{name}"]
      nu_s = s_adam.scales[f"nu/{name}"]
      seeds = fused_adam._seeds([keys.get(f"{n}/{name}") for n in ("mu", "nu")])
      if name in held:
        wb_seeds = fused_adam._seeds([wb_keys.get(name)])
        delta, m2, ms, v2, vs, *counts = fused_adam._leaf_step(
          codecs,
          hyper,
          corrections,
          jnp.concatenate([seeds, wb_seeds]),
          g,
          m,
          mu_s,
          v,
          nu_s,
          telemetry=telemetry,
          interpret=kernel == "pallas",
          apply=fused_adam.Apply(leaf, f, weight_decay),
          w=w,
          step_size=step_size,
        )
        deltas[name] = delta
        directions.append(None)
        if telemetry:
          per_wb[name] = counts[2 * len(_FIELDS) :]
      else:
        step = fused_adam._moment_step(kernel, g, codecs, telemetry)
        u, m2, ms, v2, vs, *counts = step(
          codecs, hyper, corrections, seeds, g, m, mu_s, v, nu_s
        )
        directions.append(u)
      if telemetry:
        per[f"mu/{name}"] = counts[: len(_FIELDS)]
        per[f"nu/{name}"] = counts[len(_FIELDS) : 2 * len(_FIELDS)]
      out_mu.append(m2)
      out_nu.append(v2)
      scales[f"mu/{name}"] = ms
      scales[f"nu/{name}"] = vs
    s_adam = fused_adam._new_state(
      s_adam,
      count,
      treedef,
      (out_mu, out_nu),
      scales,
      per,
      new_key,
      telemetry,
    )
    # The other leaves through the chain's other transforms; the leaves
    # stepped here pass through them as None.
    rest = jax.tree_util.tree_unflatten(treedef, directions)
    rest, s_decay = decay.update(rest, s_decay, params)
    rest, s_scale = scale.update(rest, s_scale, params)
    rest, s_wb = wb.update(rest, s_wb, params)
    flat_rest = treedef.flatten_up_to(rest)
    out = [deltas.get(n, r) for n, r in zip(names, flat_rest, strict=True)]
    if telemetry and per_wb:
      merged = counting.by_field(per_wb, leafwise.PLAIN_COUNTS)
      s_wb = s_wb._replace(
        **{c: {**getattr(s_wb, c), **merged[c]} for c in merged}
      )
    new_state = (s_adam, s_decay, s_scale, s_wb)
    return jax.tree_util.tree_unflatten(treedef, out), new_state

  return optax.GradientTransformation(
    init_fn, fused_adam._checked(reference, update_fn)
  )


def _check_decayed_dtypes(params, weight_decay) -> None:
  """optax's `add_decayed_weights` adds `weight_decay * w` in the
  weights' dtype to a float32 direction, which JAX refuses for one-byte
  floats: say so at `init`, naming the fixes."""
  if weight_decay == 0:
    return
  for path, w in jax.tree_util.tree_leaves_with_path(params):
    dtype = jnp.dtype(getattr(w, "dtype", jnp.float32))
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
      raise ValueError(
        f"stored_adamw_writeback: parameter {path_name(path)!r} is stored "
        f"as {dtype.name}, and the weight decay multiplies the weights in "
        "their dtype (optax.add_decayed_weights), which JAX does not add "
        "to float32: store the weights as float32 holding grid values "
        "(lowprec.to_grid(params, fmt)), or give weight_decay=0"
      )


def _step_size(learning_rate, state) -> jax.Array:
  """`optax.scale_by_learning_rate`'s multiplier this update, as float32:
  `-learning_rate`, or `-1 * schedule(count)`."""
  if callable(learning_rate):
    return jnp.asarray(-1 * learning_rate(state.count), jnp.float32)
  return jnp.asarray(-learning_rate, jnp.float32)

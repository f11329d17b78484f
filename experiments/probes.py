"""Gradient probes: how far a run's gradient is, on average, from the reference.

On a fixed probe batch, for `draws` keys `k`, the run's gradient `g(k)` (its
policy and gradient rounding) and the reference gradient `r(k)` (the
reference policy, gradients passed through every rounding unchanged) are
computed with the same `lowprec` key, so each pair shares its forward pass
exactly. Averaging `d(k) = g(k) - r(k)` over the keys estimates the bias of
the run's gradient with the forward held fixed: `E[d] = 0` for an admissible
policy, whatever the noise of one draw.

For each group of parameters (a regex over paths such as
`h_0/attn/qkv/kernel`, matched in full), with means over the draws and
`S` the sample covariance of `d`:

  cos         cosine of mean g and mean r
  norm_ratio  |mean g| / |mean r|
  rel_err     |mean d| / |mean r|
  bias2       (|mean d|^2 - tr S / n) / |mean r|^2: unbiased for the
              squared relative bias |E d|^2 / |mean r|^2, so its mean over
              many probes is zero (up to its standard error) for an
              admissible policy
  bias        sqrt(max(bias2, 0)): the part of rel_err that the draws'
              noise does not explain
  noise       sqrt(tr S / n) / |mean r|: what rel_err would be without bias
  cos1        mean over draws of cos(g(k), r(k)) (one draw's agreement)

Gradient rounding (stochastic, unbiased) adds noise but no bias to `g`; a
probe may leave it out (`train.probe_grad_rounding=False`) to see a read's
bias with fewer draws.

Memory is O(selected parameters) plus one gradient pass: the draws are a
scan with running sums of the selected gradients only, the reference pass
starts after the run's, and with `chunk_rows` the batch's rows go through
in chunks one after another (each chunk with its own key folded from the
draw's), so the probe of a large model needs the activations of
`chunk_rows` rows, not of the whole batch; with a rematerialised model
(`train.probe_remat`) those of one block of them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

STATS = ("cos", "norm_ratio", "rel_err", "bias2", "bias", "noise", "cos1")


def parse_groups(spec: str) -> dict[str, str]:
  """`"name=regex,name=regex"` -> `{name: regex}`."""
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, pattern = item.partition("=")
    if not sep or not name.strip() or not pattern.strip():
      raise ValueError(
        f"bad probe group {item!r} in {spec!r}: expected 'name=regex' items "
        "separated by commas, e.g. 'qkv=.*attn/qkv/kernel,gain=.*norm_scale'"
      )
    out[name.strip()] = pattern.strip()
  if not out:
    raise ValueError("train.probe_groups names no group")
  return out


def path_of(path) -> str:
  """`h_0/attn/qkv/kernel` for a pytree key path."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _members(params, groups: dict[str, str]) -> dict[str, list[int]]:
  """Leaf indices (flattening order) of each group; every group non-empty."""
  paths = [path_of(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  out = {}
  for name, pattern in groups.items():
    out[name] = [i for i, p in enumerate(paths) if re.fullmatch(pattern, p)]
    if not out[name]:
      raise ValueError(
        f"probe group {name}={pattern!r} matches no parameter; paths: "
        + ", ".join(paths)
      )
  return out


def gradient_probe(
  run_loss: Callable,
  ref_loss: Callable,
  batch,
  groups: dict[str, str],
  draws: int,
  chunk_rows: int = 0,
) -> Callable:
  """A jittable `probe(params, key) -> {"probe/<group>/<stat>": scalar}`.

  Args:
    run_loss: `(params, batch, key) -> scalar`, the run's loss; its gradient
      is the run's gradient.
    ref_loss: the same forward with the reference numerics: same roundings
      (same draws for the same key), reference reads, no gradient rounding.
    batch: the fixed probe batch.
    groups: `{name: regex}` over parameter paths.
    draws: keys per probe (at least 2).
    chunk_rows: rows per gradient pass (the gradient is the mean over the
      chunks); 0: the whole batch in one pass.
  """
  _check(batch, draws, chunk_rows)

  def probe(params, key):
    run_grad = _selected_grad(run_loss, params, groups, chunk_rows)
    ref_grad = _selected_grad(ref_loss, params, groups, chunk_rows)

    def body(acc, k):
      g = run_grad(params, batch, k)
      # The reference pass waits for the run's, so their activations are
      # never live at once.
      after, g = jax.lax.optimization_barrier((params, g))
      return _add(acc, g, ref_grad(after, batch, k)), None

    init = {}
    for n, ix in _members(params, groups).items():
      size = sum(jax.tree.leaves(params)[i].size for i in ix)
      init[n] = _zero(jnp.zeros(size, jnp.float32))
    acc, _ = jax.lax.scan(body, init, jax.random.split(key, draws))
    return _finish(acc, draws)

  return probe


def lean_gradient_probe(
  run_loss: Callable,
  ref_loss: Callable,
  batch,
  groups: dict[str, str],
  draws: int,
  chunk_rows: int = 0,
) -> Callable:
  """`gradient_probe` as separately compiled programs and a host loop.

  The same statistics from the same keys, for models too large for the
  one-program probe: the run's gradient, the reference gradient and the
  running sums are three jitted programs called once per draw, so a
  compilation holds one backward pass, not two inside a scan, and at run
  time only one pass's temporaries are live. The results have the bits of
  `gradient_probe`'s (tests/probes_test.py). Given the losses of a
  rematerialised model (`model.remat`, `train.probe_remat`) a pass holds
  one block's activations; the recomputed forward is then not always the
  same bits as the forward (XLA compiles it apart), so two passes with the
  same numerics may differ by about 1e-5 relative. Not itself jittable;
  `probe.programs(params, key)` lists the compiled programs (for their
  memory analysis).
  """
  _check(batch, draws, chunk_rows)

  def selected(loss):
    def grads(params, key):
      return _selected_grad(loss, params, groups, chunk_rows)(
        params, batch, key
      )

    return jax.jit(grads)

  run_grad, ref_grad = selected(run_loss), selected(ref_loss)
  init = jax.jit(lambda g: {n: _zero(v) for n, v in g.items()})
  add = jax.jit(_add, donate_argnums=0)
  finish = jax.jit(functools.partial(_finish, draws=draws))

  def probe(params, key):
    acc = None
    for k in jax.random.split(key, draws):
      g = run_grad(params, k)
      r = ref_grad(params, k)
      acc = add(init(g) if acc is None else acc, g, r)
      del g, r
    return finish(acc)

  def programs(params, key):
    k = jax.random.split(key, draws)[0]
    g = jax.eval_shape(run_grad, params, k)
    acc = jax.eval_shape(init, g)
    return [
      run_grad.lower(params, k).compile(),
      ref_grad.lower(params, k).compile(),
      add.lower(acc, g, g).compile(),
    ]

  probe.programs = programs
  return probe


def _check(batch, draws: int, chunk_rows: int) -> None:
  if draws < 2:
    raise ValueError(f"train.probe_draws must be at least 2, got {draws}")
  rows = len(jax.tree.leaves(batch)[0]) if chunk_rows else 0
  if chunk_rows < 0 or (chunk_rows and rows % chunk_rows):
    raise ValueError(
      f"train.probe_chunk_rows={chunk_rows} must divide the probe batch's "
      f"{rows} rows (or be 0: all at once)"
    )


def _selected_grad(loss, params, groups, chunk_rows) -> Callable:
  """`(params, batch, key) -> {group: float32 vector}`: the gradient of the
  groups' parameters only, concatenated per group, summed over row chunks
  (the other weight gradients are never computed)."""
  members = _members(params, groups)

  def pick(tree):
    leaves = jax.tree.leaves(tree)
    return {
      n: jnp.concatenate([leaves[i].ravel().astype(jnp.float32) for i in ix])
      for n, ix in members.items()
    }

  return _in_chunks(lambda *a: pick(jax.grad(loss)(*a)), chunk_rows)


def _zero(v):
  """The running sums of one group: sum g, sum r, sum |d|^2, sum cos1."""
  zero = jnp.float32(0)
  return (jnp.zeros_like(v), jnp.zeros_like(v), zero, zero)


def _add(acc, g, r):
  """One draw's run and reference gradients added to the running sums."""
  new = {}
  for n in acc:
    d = g[n] - r[n]
    cos1 = jnp.vdot(g[n], r[n]) / _safe(_norm(g[n]) * _norm(r[n]))
    sg, sr, sdd, sc = acc[n]
    new[n] = (sg + g[n], sr + r[n], sdd + jnp.vdot(d, d), sc + cos1)
  return new


def _finish(acc, draws):
  out = {}
  for n, (sg, sr, sdd, sc) in acc.items():
    for stat, v in _stats(sg / draws, sr / draws, sdd, sc, draws).items():
      out[f"probe/{n}/{stat}"] = v
  return out


def _in_chunks(grad_fn: Callable, rows: int) -> Callable:
  """`grad_fn(params, batch, key)` (a pytree of float32 arrays) as the mean
  over chunks of `rows` rows, computed in sequence; chunk `i` reads
  `fold_in(key, i)`."""
  if not rows:
    return grad_fn

  def chunked(params, batch, key):
    n = len(jax.tree.leaves(batch)[0]) // rows
    parts = jax.tree.map(lambda x: x.reshape(n, rows, *x.shape[1:]), batch)

    def body(acc, xs):
      part, i = xs
      g = grad_fn(params, part, jax.random.fold_in(key, i))
      return jax.tree.map(jnp.add, acc, g), None

    like = jax.eval_shape(
      grad_fn, params, jax.tree.map(lambda x: x[0], parts), key
    )
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
    total, _ = jax.lax.scan(body, zero, (parts, jnp.arange(n)))
    return jax.tree.map(lambda t: t / n, total)

  return chunked


def _norm(x):
  return jnp.sqrt(jnp.vdot(x, x))


def _safe(x):
  return jnp.where(x > 0, x, 1.0)


def _stats(mg, mr, sum_dd, sum_cos, n) -> dict:
  md = mg - mr
  nr = _safe(_norm(mr))
  md2 = jnp.vdot(md, md)
  # tr S = (sum |d_k|^2 - n |mean d|^2) / (n - 1)
  tr_s = jnp.maximum(sum_dd - n * md2, 0.0) / (n - 1)
  bias2 = (md2 - tr_s / n) / (nr * nr)
  return {
    "cos": jnp.vdot(mg, mr) / _safe(_norm(mg) * _norm(mr)),
    "norm_ratio": _norm(mg) / nr,
    "rel_err": jnp.sqrt(md2) / nr,
    "bias2": bias2,
    "bias": jnp.sqrt(jnp.maximum(bias2, 0.0)),
    "noise": jnp.sqrt(tr_s / n) / nr,
    "cos1": sum_cos / n,
  }

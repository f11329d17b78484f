"""The calling convention shared by the operators: policy, keys, custom_vjp.

An operator is a frozen dataclass (hashable, so a static argument) holding one
`Rounding` per saved tensor plus `grad`, the rounding of incoming gradients
(the emulated FP8 backward). Calling it resolves the policy against its uses,
derives keys, and runs a `jax.custom_vjp` whose forward rounds and keeps what
the policy's reads need, and whose backward reads per use what the policy
says. `reference` runs the same forward with straight-through roundings, so
`jax.grad` of it is the reference gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from lowprec.backward import policy as policy_lib
from lowprec.backward.ops import requirements as req_lib
from lowprec.backward.ops import saved
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding

_NONE = Rounding()

# `_forward(KEEP_ALL, ...)` keeps the residuals of every policy; `_backward`
# can then run any policy on them with the forward held fixed (lowprec.audit).
KEEP_ALL = ("<keep all>",)


class Op:
  """Base class of the operators in `lowprec.ops`."""

  name: ClassVar[str]  # a key of `lowprec.policy.USES`
  args: ClassVar[tuple[str, ...]]  # names of the differentiable inputs
  tensors: ClassVar[tuple[str, ...]]  # fields holding saved tensors' Rounding
  table: ClassVar[tuple[Requirement, ...]]
  # The policy values its uses can read (`lowprec.policy.VALUES`).
  values: ClassVar[tuple[str, ...]] = policy_lib.OP_VALUES

  def _coerce(self):
    for field in (*self.tensors, "grad"):
      if hasattr(self, field):
        object.__setattr__(self, field, Rounding.parse(getattr(self, field)))

  @property
  def grad_rounding(self) -> Rounding:
    """Rounding of incoming gradients (no rounding for ops without matmul)."""
    return getattr(self, "grad", _NONE)

  # ---- static facts -------------------------------------------------------

  @property
  def uses(self) -> tuple[str, ...]:
    return policy_lib.USES[self.name]

  def rounding(self, tensor: str) -> Rounding:
    """The `Rounding` of saved tensor `tensor` (a name in `self.tensors`)."""
    return getattr(self, tensor)

  @property
  def requirements(self) -> dict[str, Requirement]:
    """The requirements table, `{use: Requirement}` (see the class doc)."""
    return {r.use: r for r in self.table}

  @property
  def reference_policy(self) -> policy_lib.Policy:
    """The policy reading, for every use, what the reference reads."""
    return policy_lib.Policy(tuple((r.use, r.must_read) for r in self.table))

  def grad_roundings(self) -> tuple[Rounding, ...]:
    """Every rounding of incoming gradients (`lowprec.audit` predicts
    their effect: nearest biases every gradient, stochastic does not)."""
    return (self.grad_rounding,)

  def without_grad_rounding(self) -> Op:
    """This operator with its gradient roundings off (the reference)."""
    if not hasattr(self, "grad"):
      return self
    return dataclasses.replace(self, grad=_NONE)

  def unrounded(self) -> Op:
    """This operator with every rounding (and gradient rounding) off."""
    off = {t: _NONE for t in self.tensors}
    if hasattr(self, "grad"):
      off["grad"] = _NONE
    return dataclasses.replace(self, **off)

  def kind(self, tensor: str) -> str:
    """How `tensor`'s rounded value is produced (see `requirements.KINDS`)."""
    r = self.rounding(tensor)
    if r.is_identity:
      return "none"
    return "stochastic" if r.mode == "stochastic" else "nearest"

  def produces(self, req: Requirement, value: str) -> str:
    """What reading `value` for `req.use` gives, up to equality (one of
    `requirements.PRODUCTS`)."""
    r = self.rounding(req.tensor)
    return req_lib.produces(
      value, self.kind(req.tensor), r.is_identity, req.storage_only,
      r.saturates,
    )  # fmt: skip

  def copy_value(self, tensor: str) -> str | None:
    """The policy value that reads an independent copy of `tensor`'s
    forward rounding from the same distribution; None when the tensor is
    not rounded or no value reads such a copy."""
    r = self.rounding(tensor)
    return req_lib.copy_value(r.mode, r.is_identity)

  def resolve(self, policy) -> tuple[str, ...]:
    """The value each use reads, in `self.uses` order (None: reference)."""
    if policy is None:
      policy = self.reference_policy
    values = policy_lib.Policy.parse(policy).resolve(self)
    return tuple(values[u] for u in self.uses)

  def reads(self, values) -> dict[str, frozenset[str]]:
    """`{tensor: values its uses read}` for resolved `values` (`KEEP_ALL`:
    every value, so one forward serves every policy's backward)."""
    if values is KEEP_ALL:
      return {t: frozenset(self.values) for t in self.tensors}
    out = {t: set() for t in self.tensors}
    for r, v in zip(self.table, values, strict=True):
      out[r.tensor].add(v)
    return {t: frozenset(v) for t, v in out.items()}

  def _needs_forward_key(self) -> bool:
    return any(self.rounding(t).stochastic for t in self.tensors)

  def _needs_backward_key(self, values) -> bool:
    fresh = any(
      v == "fresh" and not self.rounding(r.tensor).is_identity
      for r, v in zip(self.table, values, strict=True)
    )
    return fresh or self.grad_rounding.stochastic

  # ---- calling ------------------------------------------------------------

  def __call__(self, *args, policy=None, key=None, backward_key=None):
    """Runs the operator; its backward reads what `policy` says per use.

    Args:
      *args: the inputs named in `self.args` (optional ones may be None).
      policy: a `Policy` or anything `Policy.parse` takes; None reads the
        reference values.
      key: PRNG key for the forward's stochastic roundings; the backward's
        draws (fresh reads, gradient rounding) use `backward_key`, derived
        from `key` when not given.
      backward_key: PRNG key for the backward's draws.

    Raises:
      ValueError: a use the policy does not cover or an unknown use name; a
        missing key where a rounding is stochastic.
    """
    return self.apply(self.resolve(policy), args, key, backward_key)

  def apply(self, values: tuple[str, ...], args, key, backward_key=None):
    """`__call__` with the policy already resolved to `values`."""
    if len(args) != len(self.args):
      raise TypeError(
        f"{self.name} takes {len(self.args)} inputs "
        f"({', '.join(self.args)}), got {len(args)}"
      )
    keys = self._keys(values, key, backward_key)
    dtypes = tuple(None if a is None else jnp.result_type(a) for a in args)
    return _custom(self, values, dtypes, tuple(args), keys)

  def reference(self, *args, key=None):
    """The forward with straight-through roundings; `jax.grad` of it is the
    reference gradient.

    Draws: with the same `key`, every stochastic rounding of a saved tensor
    uses the same random bits per element as `__call__` (keys derived from
    `key` by the tensor's name), so it rounds equal values to equal grid
    values. The values fed to a rounding are computed by each program:
    where they are the operator's input itself (`Dense`'s and
    `Activation`'s `x`) the rounded tensors are equal bit for bit, in any
    program. Where the forward computes them (softmax probabilities, a
    norm's output, attention's output), two separately compiled programs
    may evaluate them in another order and differ in their last bits; an
    element that close to its rounding threshold then rounds to the
    adjacent grid value instead (one grid step apart, never more). For a
    difference of `k` float32 ulps that happens to about `k * 2**(m - 23)`
    of the elements, `m` the format's mantissa bits (1e-6 per ulp for
    e4m3: a few elements in some draws of a 65k-element tensor).
    """
    if key is None and self._needs_forward_key():
      raise ValueError(f"{self.name} rounds stochastically: pass key=...")
    keys = dict(self._forward_keys(key), backward=None)
    return self._forward(None, tuple(args), keys)[0]

  def _keys(self, values, key, backward_key) -> dict:
    fwd = self._needs_forward_key()
    bwd = self._needs_backward_key(values)
    if key is None and (fwd or (bwd and backward_key is None)):
      why = [f"{t}={self.rounding(t)!r}" for t in self.tensors]
      why.append(f"grad={self.grad_rounding!r}")
      if any(v == "fresh" for v in values):
        why.append("fresh reads")
      raise ValueError(
        f"{self.name} draws random numbers ({', '.join(why)}) but got "
        "key=None; pass key=jax.random.key(seed) (lowprec.nn modules: "
        "apply(..., rngs={'lowprec': key}))"
      )
    keys = self._forward_keys(key)
    if bwd:
      keys["backward"] = (
        backward_key
        if backward_key is not None
        else saved.key_for(key, "backward")
      )
    else:
      keys["backward"] = None
    return keys

  def _forward_keys(self, key) -> dict:
    """`{tensor: key of its forward draw}` (None where nothing is drawn)."""
    return {
      t: saved.key_for(key, t) if self.rounding(t).stochastic else None
      for t in self.tensors
    }

  # ---- helpers for subclasses ---------------------------------------------

  def _round(self, tensor, x, keys, reads, res):
    """Rounds `x` for the forward; records residuals unless `reads` is None
    (straight-through reference forward)."""
    r = self.rounding(tensor)
    if reads is None:
      return saved.straight_through(r, x, keys[tensor])
    xr, res[tensor] = saved.save(r, x, keys[tensor], reads[tensor])
    return xr

  def _read(self, values, use, res, bkey):
    """What `use` reads in the backward."""
    i = self.uses.index(use)
    r = self.table[i]
    fresh_key = None if bkey is None else saved.key_for(bkey, use)
    return per_value(
      values[i],
      lambda v: saved.read(
        self.rounding(r.tensor), res[r.tensor], v, fresh_key
      ),
      self.values,
    )

  def _round_grad(self, g, bkey, name):
    """Incoming-gradient rounding (emulated FP8 backward)."""
    r = self.grad_rounding
    if r.is_identity:
      return g
    k = None if bkey is None else saved.key_for(bkey, "grad:" + name)
    return r.round(g, k)[0]

  # ---- implemented by each operator ---------------------------------------

  def _forward(self, values, args, keys):
    """`(output, residuals)`; `values` None means straight-through."""
    raise NotImplementedError

  def _backward(self, values, res, g) -> tuple:
    raise NotImplementedError


def per_value(value, fn, values=policy_lib.OP_VALUES):
  """`fn(value)`; for a traced index into `values` (the operator's) instead
  of a name, every value's `fn` is computed and the indexed one selected,
  so one traced backward serves every policy (used by `lowprec.audit`)."""
  if isinstance(value, str):
    return fn(value)
  outs = [fn(v) for v in values]
  which = [value == i for i in range(len(outs))]
  return jax.tree.map(lambda *c: jnp.select(which, c), *outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _custom(op: Op, values, dtypes, args, keys):
  return op._forward(values, args, keys)[0]


def _custom_fwd(op: Op, values, dtypes, args, keys):
  out, res = op._forward(values, args, keys)
  res["backward_key"] = keys["backward"]
  return out, res


def _custom_bwd(op: Op, values, dtypes, res, g):
  grads = op._backward(values, res, g)
  grads = tuple(
    None if d is None else grads[i].astype(d) for i, d in enumerate(dtypes)
  )
  return grads, None


_custom.defvjp(_custom_fwd, _custom_bwd)

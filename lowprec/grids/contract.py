"""The compiler-proof contract: roundings no XLA backend may skip.

A rounding the numerics depend on must survive the compiler. Two
rewrites are known to skip one silently on GPU, and neither happens on
XLA:CPU, so a CPU-only test suite cannot see them:

* a narrowing conversion whose result is widened again,
  `convert(convert(x, bf16), f32)`, is simplified to `x`
  (openxla/xla#41605);
* arithmetic on narrow floats is fused and computed in float32, rounding
  once at the end of the fusion instead of after every operation
  ("excess precision", on by default; jax-ml/jax#23007).

A third rewrite changes bits on GPU that XLA:CPU computes exactly:

* a division by a constant is computed as a product with the constant's
  rounded reciprocal, one ulp off for some quotients (`x / 448`), even
  when an optimization barrier hides the constant from XLA's own
  simplifier.

The contract: every rounding a step relies on is computed on integer bit
patterns (`bitcast_convert_type`, as `lowprec.grids.rounding` does) or guarded
by `jax.lax.reduce_precision`, which XLA must honour; a narrowing
conversion is only ever applied to a value already on the narrow grid (so
skipping it changes nothing), or is the step's stored output, and never
feeds arithmetic or a comparison once widened; no arithmetic runs on
narrow floats; and no float is divided by a constant other than a power
of two (an exact reciprocal).

`check(fn, *args)` traces `fn` to the program JAX hands to XLA (its
jaxpr: one StableHLO operation per equation, nested calls, loops and
conditionals included) and returns a `Finding` for every operation that
breaks the contract; `check_step` does the same for a user's step and
warns, naming the operation and the fix. lowprec's own recipes are
checked by tests/contract_test.py.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend.core import Literal

__all__ = ["CompilerContractWarning", "Finding", "check", "check_step"]

# Operations that move or select values without computing new ones: a value
# they pass on keeps what the contract knows of it.
_MOVES = frozenset(
  {
    "broadcast_in_dim",
    "concatenate",
    "copy",
    "copy_p",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "pad",
    "reshape",
    "rev",
    "select_n",
    "slice",
    "squeeze",
    "transpose",
    "expand_dims",
    "optimization_barrier",
  }
)
# Operations whose float result is exact by construction.
_EXACT = frozenset({"bitcast_convert_type", "reduce_precision", "iota"})
# Comparisons: no float value, but a widened round trip compared with the
# value it came from is the test XLA:GPU simplifies away.
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
# Operations that compute no float value (tests, bit logic).
_NO_VALUE = frozenset(
  {
    "is_finite",
    "and",
    "or",
    "not",
    "xor",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "population_count",
    "clz",
    "sign",
    "stop_gradient",
  }
)
_NARROW = ("bfloat16", "float16", "float8", "float6", "float4")


class Finding(NamedTuple):
  """One operation that breaks the contract."""

  kind: str  # "round trip", "narrow arithmetic" or "constant division"
  operation: str  # the operation, e.g. "convert_element_type f32[4] -> bf16[4]"
  use: str  # what uses its result in arithmetic
  where: str  # the source line that wrote it, if known

  def __str__(self) -> str:
    fix = _FIXES[self.kind]
    return (
      f"{self.kind}: {self.operation}, then {self.use} ({self.where}). {fix}"
    )


_FIXES = {
  "round trip": "XLA:GPU may simplify convert(convert(x, narrow), f32) "
  "to x and skip the rounding. Round with jax.lax.reduce_precision(x, "
  "exponent_bits, mantissa_bits) before the conversion (or use "
  "lowprec.round_nearest / round_stochastic, which round on bit patterns)",
  "constant division": "XLA:GPU divides by a constant as a product with "
  "its rounded reciprocal (one ulp off for some quotients), even through "
  "an optimization barrier. Divide by a power of two, or compute the "
  "quotient on integer bit patterns (as lowprec's block scales do: "
  "lowprec.engine.codec)",
  "narrow arithmetic": "XLA may compute narrow-float arithmetic in float32 "
  "(excess precision) and round once at the end of a fusion. Compute in "
  "float32 and round explicitly (jax.lax.reduce_precision or lowprec's "
  "roundings), or run with XLA_FLAGS=--xla_allow_excess_precision=false",
}


class CompilerContractWarning(UserWarning):
  """A step relies on a rounding that an XLA backend may skip."""


def _is_narrow(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return False
  return np.dtype(dtype).name.startswith(_NARROW)


def _is_float(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _describe(aval) -> str:
  return aval.str_short(short_dtypes=True)


def _where(eqn) -> str:
  try:
    frame = source_info_util.user_frame(eqn.source_info.traceback)
  except Exception:  # noqa: BLE001 (source info is best effort)
    frame = None
  if frame is None:
    return "source unknown"
  return f"{frame.file_name}:{frame.start_line}"


def _sub_jaxprs(eqn):
  """`(jaxpr, maps_operands)` of each program an equation calls;
  `maps_operands` where its inputs are the equation's inputs, one for one
  (calls), not loop carries or branch operands."""
  out = []
  for name, v in eqn.params.items():
    for j in v if isinstance(v, tuple | list) else (v,):
      inner = getattr(j, "jaxpr", j)
      if hasattr(inner, "eqns"):
        direct = eqn.primitive.name in (
          "pjit",
          "jit",
          "closed_call",
          "core_call",
        )
        direct |= name == "call_jaxpr"
        out.append((inner, direct and len(inner.invars) == len(eqn.invars)))
  return out


# Operations through which a scalar constant stays that constant.
_CONSTANT_MOVES = frozenset(
  {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "optimization_barrier",
    "copy",
    "copy_p",
    "convert_element_type",
  }
)


def _exact_reciprocal(c: np.ndarray) -> bool:
  """Whether dividing by `c` is multiplying by an exact reciprocal: a
  power of two (or zero, inf, NaN: no rounding to differ)."""
  v = float(np.asarray(c, np.float64).reshape(()))
  if v == 0 or not np.isfinite(v):
    return True
  mantissa, _ = np.frexp(abs(v))
  return mantissa == 0.5


def _walk(jaxpr, facts, found, seen, narrow_ops=True, consts=None) -> dict:
  """Propagates what is known of each variable through `jaxpr`."""
  consts = {} if consts is None else consts

  def fact(v):
    if isinstance(v, Literal):
      return ("exact",)
    return facts.get(v, ("computed",))

  def constant(v):
    """The value of `v` where it is a scalar constant, else None."""
    if isinstance(v, Literal):
      return np.asarray(v.val)
    return consts.get(v)

  for eqn in jaxpr.eqns:
    prim = eqn.primitive.name
    ins = [fact(v) for v in eqn.invars]
    for inner, direct in _sub_jaxprs(eqn):
      sub = dict(zip(inner.invars, ins, strict=True)) if direct else {}
      inner_consts = {}
      if direct:
        for iv, v in zip(inner.invars, eqn.invars, strict=True):
          c = constant(v)
          if c is not None:
            inner_consts[iv] = c
      inner_facts = _walk(inner, sub, found, seen, narrow_ops, inner_consts)
      if direct and len(inner.outvars) == len(eqn.outvars):
        for o, io in zip(eqn.outvars, inner.outvars, strict=True):
          if not isinstance(io, Literal):
            facts[o] = inner_facts.get(io, ("computed",))
    if _sub_jaxprs(eqn):
      continue
    out = eqn.outvars[0] if eqn.outvars else None
    if out is not None and prim in _CONSTANT_MOVES and eqn.invars:
      c = constant(eqn.invars[-1] if prim == "select_n" else eqn.invars[0])
      if c is not None and c.size == 1:
        consts[out] = c
    if prim == "div" and _is_float(out.aval):
      c = constant(eqn.invars[1])
      if c is not None and not _exact_reciprocal(c):
        desc = (
          f"div {_describe(eqn.invars[0].aval)} by the constant {c.item()!r}"
        )
        if (desc, prim) not in seen:
          seen.add((desc, prim))
          found.append(Finding("constant division", desc, prim, _where(eqn)))
    if prim == "convert_element_type":
      src, dst = eqn.invars[0].aval, out.aval
      if _is_narrow(dst) and _is_float(src) and not _is_narrow(src):
        # A narrowing: safe if the value is on the narrow grid already.
        guarded = ins[0][0] == "exact" or not _is_float(src)
        desc = f"convert_element_type {_describe(src)} -> {_describe(dst)}"
        facts[out] = ("narrow", guarded, desc, _where(eqn))
      elif _is_narrow(src) and not _is_narrow(dst) and ins[0][0] == "narrow":
        facts[out] = ("widened", *ins[0][1:])
      elif not _is_float(src):
        facts[out] = ("exact",)
      else:
        facts[out] = ins[0]
      continue
    if prim in _EXACT:
      for o in eqn.outvars:
        facts[o] = ("exact",)
      continue
    if prim in _MOVES:
      values = ins[1:] if prim == "select_n" else ins
      kinds = {f[0] for f in values}
      # A select between a rounded value and another counts as rounded:
      # lowprec's roundings pass NaN (and kept values) through that way.
      if kinds == {"exact"} or (prim == "select_n" and "exact" in kinds):
        facts[out] = ("exact",)
      else:
        tagged = [f for f in values if f[0] in ("widened", "narrow")]
        facts[out] = tagged[0] if tagged else ("computed",)
      continue
    if prim in _NO_VALUE:
      continue
    # Arithmetic or a comparison: a widened round trip feeding it, or
    # narrow operands.
    for f in ins:
      if f[0] == "widened" and not f[1] and (f[2], prim) not in seen:
        seen.add((f[2], prim))
        found.append(Finding("round trip", f[2], prim, f[3]))
    if prim in _COMPARISONS:
      continue
    if narrow_ops and out is not None and _is_narrow(out.aval):
      key = (prim, _describe(out.aval), _where(eqn))
      if key not in seen:
        seen.add(key)
        desc = f"{prim} -> {_describe(out.aval)}"
        found.append(Finding("narrow arithmetic", desc, prim, key[2]))
  return facts


def check(fn, *args, narrow_arithmetic: bool = True, **kwargs) -> list[Finding]:
  """The operations of `fn(*args, **kwargs)` that break the contract.

  Traces `fn` (jitted or not) with the given arguments (arrays, or
  `jax.ShapeDtypeStruct`s) without running it. `narrow_arithmetic=False`
  leaves out arithmetic on narrow floats (a model that computes its
  forward in bfloat16 on purpose, where excess precision only makes it
  more precise).

  Returns:
    A list of `Finding`s: round trips (a narrowing conversion of a value
      not known to be on the narrow grid, widened again and used in
      arithmetic) and narrow arithmetic (an arithmetic operation whose
      result is a narrow float). Empty where the step keeps the contract.
  """
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  found: list[Finding] = []
  _walk(closed.jaxpr, {}, found, set(), narrow_arithmetic)
  return found


def check_step(
  fn, *args, narrow_arithmetic: bool = True, **kwargs
) -> list[Finding]:
  """`check`, warning once per finding with the operation and the fix.

  Example:
    ```python
    findings = lowprec.contract.check_step(train_step, state, batch)
    ```
  """
  found = check(fn, *args, narrow_arithmetic=narrow_arithmetic, **kwargs)
  for f in found:
    warnings.warn(str(f), CompilerContractWarning, stacklevel=2)
  return found

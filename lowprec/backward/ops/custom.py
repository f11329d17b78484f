"""Operators of your own: a plain JAX forward, saved tensors, named uses.

You write the forward as a plain JAX function of the operator's inputs and
one more argument, `read`. Every backward read of a saved tensor goes
through `read`, one call per use, so that each use reads its own slot:

  read(use, t)         the forward goes on with `t~ = Q(t)` (it multiplies
                       the rounded value, as a dense layer's FP8 operand);
  read.stored(use, t)  the forward goes on with `t` itself; `t~` is only
                       what the backward keeps (as an activation's input
                       stored in FP8 for its derivative).

`use` is the use's name, `<tensor>@<what it feeds>`, with `<tensor>` one of
the saved tensors the operator declares, each with its `Rounding`. All reads
of one tensor get the same array and share one forward draw.

From this `Custom` builds a `jax.custom_vjp`. The forward runs `fn` once with
the forward's values and keeps the inputs plus, per saved tensor, only what
the policy's reads need: the narrow `t~` where a use reads `rounded`, `t`
where one reads `original`, `fresh` or `nearest`. The backward recomputes
`fn` with every `read` returning the value the policy names for that use
(`rounded`: the kept `t~`; `original`: the forward's `t`; `fresh`: a new
stochastic rounding of `t`; `nearest`: its round-to-nearest), the gradient
passed straight through each read, and pulls the incoming gradient back
through it (`jax.vjp`). So each use's part of the VJP is evaluated at the
value its read returns, and everything the forward computes from a read is
recomputed from it.

The requirements table (which value each use must read; whether `fresh` is
admissible) is derived, not written: `lowprec.audit.derive` finds it from
the reference gradient (the forward as it ran, roundings straight through)
and checks it by Monte Carlo; `op.with_table(table)` stores it.

Example:
  ```python
  def scaled_product(x, w, read):
    return read("sp.in@dw", x) @ w
  op = Custom("sp", scaled_product, args=("x", "w"),
              saved={"sp.in": "float8_e4m3fn:stochastic"},
              uses=("sp.in@dw",))
  d = audit.derive(op, (x, w), jax.random.key(0))
  op = d.op  # carries the derived table
  y = op(x, w, key=jax.random.key(1))  # reads what the reference reads
  ```

Reference: "Backward-State Policy Is Part of the Learning Algorithm" (2026).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from lowprec.backward import policy as policy_lib
from lowprec.backward.ops import saved as saved_lib
from lowprec.backward.ops.base import KEEP_ALL, Op, per_value
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.backward.policy import VALUES

_NONE = Rounding()


def _straight(t, value):
  """`value`, with the gradient passed to `t` unchanged (exact: t - t = 0)."""
  return (t - jax.lax.stop_gradient(t)) + jax.lax.stop_gradient(value)


class Reader:
  """The `read` argument of a custom operator's forward.

  `read(use, t)` returns what `use` reads of saved tensor `t`; the forward
  continues with the rounded value. `read.stored(use, t)`: the forward
  continues with `t`; the rounded value is kept for the backward only. In
  the backward both return what the policy names for `use`. Created by
  `Custom`; you never build one.
  """

  def __init__(self, op: Custom, mode: str, **state):
    self._op = op
    self._mode = mode  # "reference", "forward" or "backward"
    self._state = state
    self._first = {}  # tensor -> the array its first read was given
    self._cache = {}  # tensor -> its rounded value (one draw per tensor)
    self.kept = {}  # forward: tensor -> {"rounded": Stored, "original": t}
    self.seen = {}  # use -> True (forward goes on rounded) / False

  def __call__(self, use: str, t):
    """What `use` reads of `t`; the forward goes on with `t~ = Q(t)`."""
    return self._read(use, t, rounded=True)

  def stored(self, use: str, t):
    """What `use` reads of `t`; the forward goes on with `t` itself."""
    return self._read(use, t, rounded=False)

  def _read(self, use, t, rounded):
    op = self._op
    if use not in op.uses:
      raise ValueError(
        f"the forward of {op.name} reads use {use!r}, which the operator "
        f"does not declare.{policy_lib._suggest(use, op.uses)} Declared "
        f"uses: {', '.join(op.uses)}."
      )
    tensor = use.split("@")[0]
    if tensor in self._first and self._first[tensor] is not t:
      raise ValueError(
        f"{op.name}: the reads of saved tensor {tensor!r} were given "
        f"different arrays ({use!r} and an earlier read); pass the same "
        "array to every read of one tensor"
      )
    self._first[tensor] = t
    if self.seen.get(use, rounded) != rounded:
      raise ValueError(
        f"{op.name}: use {use!r} is read both with read() and "
        "read.stored(); a use is one or the other"
      )
    self.seen[use] = rounded
    r = op.rounding(tensor)
    if self._mode == "backward":
      return self._backward_value(use, tensor, r, t)
    if self._mode == "reference":
      if not rounded or r.is_identity:
        return t
      if tensor not in self._cache:
        key = self._state["keys"][tensor]
        self._cache[tensor] = saved_lib.straight_through(r, t, key)
      return self._cache[tensor]
    # forward: round once per tensor; keep the narrow copy if a use reads
    # it, the original if a use reads it or a draw of it (the backward's
    # recomputation of `t` follows the other uses' reads, not the forward).
    if tensor not in self._cache:
      need = self._state["reads"][tensor]
      kept = {}
      if r.is_identity:
        value = t
        kept["original"] = t
      else:
        value, stored = r.round(t, self._state["keys"][tensor])
        if "rounded" in need:
          kept["rounded"] = stored
        if need - {"rounded"}:
          kept["original"] = t
      self._cache[tensor] = value
      self.kept[tensor] = kept
    return self._cache[tensor] if rounded else t

  def _backward_value(self, use, tensor, r, t):
    overrides = self._state.get("overrides") or {}
    if use in overrides:  # lowprec.audit.derive's midpoint reads
      value = overrides[use]
      return _straight(t, value(t) if callable(value) else value)
    kept = self._state["kept"][tensor]
    x = kept.get("original", t)
    if r.is_identity:
      return _straight(t, x)
    values = self._state["values"]
    bkey = self._state["bkey"]

    def value(v):
      if v == "original":
        return x
      if v == "rounded":
        return kept["rounded"].value().astype(t.dtype)
      if v == "nearest":  # as the built-ins read it: through the format
        return r.quantize(x, mode="nearest").value().astype(t.dtype)
      key = saved_lib.key_for(bkey, use)
      return r.round(x, key, mode="stochastic")[0]

    v = values[self._op.uses.index(use)]
    choices = self._state.get("choices")
    if choices is None or isinstance(v, str):
      return _straight(t, per_value(v, value))
    # A traced index into VALUES, restricted to `choices`
    # (lowprec.audit.derive).
    which = [v == VALUES.index(c) for c in choices]
    return _straight(t, jnp.select(which, [value(c) for c in choices]))

  def check_complete(self):
    """Every declared use was read (after running the forward)."""
    missing = [u for u in self._op.uses if u not in self.seen]
    if missing:
      raise ValueError(
        f"{self._op.name} declares use(s) {', '.join(map(repr, missing))} "
        "but its forward never reads them: read each use once, "
        "read(use, t) or read.stored(use, t), or remove it from uses"
      )


@dataclasses.dataclass(frozen=True)
class Custom(Op):
  """An operator built from your own plain JAX forward.

  The forward `fn(*inputs, read) -> output` reads each saved tensor through
  `read`, once per use (see the module doc). The operator's forward is
  `fn` with `read(use, t) = t~` and `read.stored(use, t) = t`; its
  backward, for a policy `{use: value}`, is

    d inputs = VJP of fn at inputs, with read(use, t) := value(use, t),

  each read passing its gradient straight through to `t`. The reference
  gradient is `jax.grad` of the forward as it ran (`reference`). The
  requirements table is derived by `lowprec.audit.derive`; until then the
  operator runs only with explicit policies that cover its uses.

  Attributes:
    name: the operator's name (`Policy.resolve` messages, a `Registry`).
    fn: the forward, `fn(*inputs, read)`. Hashed by identity: define it
      once, not inside a jitted function.
    args: names of the inputs (their gradients are `feeds` in the table).
    saved: `{tensor: Rounding or "format:mode" or None}` (None: no
      rounding), stored as sorted pairs. A tensor name is the part of its
      use names before `@`.
    uses: the use names `<tensor>@<what it feeds>`, in table order.
    table: the requirements table, one `Requirement` per use in `uses`
      order, or None until derived.

  Raises:
    ValueError: a malformed or repeated use name, a use of an undeclared
      tensor, a saved tensor without uses, a table that does not match the
      uses. At the first call: a declared use the forward never reads, or a
      read of an undeclared use.

  Example:
    ```python
    def act(x, read):
      return jax.nn.gelu(read.stored("my.in@dact", x))
    op = Custom("my_act", act, args=("x",),
                saved={"my.in": "float8_e4m3fn"}, uses=("my.in@dact",))
    op = audit.derive(op, (x,), jax.random.key(0)).op
    op.requirements["my.in@dact"].must_read
    # 'original'
    ```
  """

  name: str = ""
  fn: Callable | None = None
  args: tuple[str, ...] = ()
  saved: Mapping[str, Rounding | str | None] | tuple = ()
  uses: tuple[str, ...] = ()
  table: tuple[Requirement, ...] | None = None

  def __post_init__(self):
    if not self.name or not callable(self.fn):
      raise ValueError("Custom needs a name and a forward function fn")
    items = (
      self.saved.items() if isinstance(self.saved, Mapping) else self.saved
    )
    saved = tuple(sorted((str(t), Rounding.parse(r)) for t, r in items))
    object.__setattr__(self, "saved", saved)
    object.__setattr__(self, "args", tuple(self.args))
    uses = tuple(policy_lib.check_use_name(u) for u in self.uses)
    object.__setattr__(self, "uses", uses)
    tensors = [t for t, _ in saved]
    if len(set(uses)) != len(uses):
      raise ValueError(f"{self.name} lists a use twice: {uses}")
    for use in uses:
      tensor = use.split("@")[0]
      if tensor not in tensors:
        raise ValueError(
          f"use {use!r} of {self.name} names tensor {tensor!r}, which is "
          f"not saved.{policy_lib._suggest(tensor, tensors)} Saved "
          f"tensors: {', '.join(tensors) or '(none)'}"
        )
    for tensor in tensors:
      if not any(u.split("@")[0] == tensor for u in uses):
        raise ValueError(
          f"saved tensor {tensor!r} of {self.name} has no uses: declare "
          f"at least one, e.g. uses=('{tensor}@<what it feeds>', ...), or "
          "do not save it"
        )
    if self.table is not None:
      table = tuple(self.table)
      if tuple(r.use for r in table) != uses:
        raise ValueError(
          f"the table of {self.name} lists uses "
          f"{tuple(r.use for r in table)}, the operator {uses}"
        )
      object.__setattr__(self, "table", table)

  # ---- static facts ---------------------------------------------------------

  @property
  def tensors(self) -> tuple[str, ...]:
    return tuple(t for t, _ in self.saved)

  def rounding(self, tensor: str) -> Rounding:
    return dict(self.saved)[tensor]

  def tensor_of(self, use: str) -> str:
    """The saved tensor `use` reads."""
    return use.split("@")[0]

  @property
  def requirements(self) -> dict[str, Requirement]:
    return {r.use: r for r in self._table()}

  @property
  def reference_policy(self) -> policy_lib.Policy:
    """Reads, per use, the derived must-read value; its registry knows
    this operator, so it can be combined with `ops.REFERENCE`."""
    return policy_lib.Policy(
      tuple((r.use, r.must_read) for r in self._table()),
      policy_lib.BUILTIN.register(self),
    )

  def _table(self) -> tuple[Requirement, ...]:
    if self.table is None:
      raise ValueError(
        f"{self.name} has no requirements table yet: derive it with "
        "lowprec.audit.derive(op, inputs, key) and use the returned .op "
        "(or op.with_table(table)), or pass an explicit policy"
      )
    return self.table

  def with_table(self, table) -> Custom:
    """This operator carrying requirements table `table`."""
    return dataclasses.replace(self, table=tuple(table))

  def with_roundings(self, **roundings) -> Custom:
    """This operator with some saved tensors' roundings replaced."""
    saved = dict(self.saved)
    for t, r in roundings.items():
      if t not in saved:
        raise ValueError(f"{self.name} saves no tensor {t!r}")
      saved[t] = r
    return dataclasses.replace(self, saved=saved)

  def unrounded(self) -> Custom:
    return dataclasses.replace(self, saved={t: _NONE for t in self.tensors})

  def reads(self, values) -> dict[str, frozenset[str]]:
    if values is KEEP_ALL:
      return {t: frozenset(policy_lib.VALUES) for t in self.tensors}
    out = {t: set() for t in self.tensors}
    for use, v in zip(self.uses, values, strict=True):
      out[self.tensor_of(use)].add(v)
    return {t: frozenset(v) for t, v in out.items()}

  def _needs_backward_key(self, values) -> bool:
    return any(
      v == "fresh" and not self.rounding(self.tensor_of(u)).is_identity
      for u, v in zip(self.uses, values, strict=True)
    )

  def forward_values(self, *args) -> tuple[str, ...]:
    """Per use, the value its read takes in the forward: `rounded` for
    `read(use, t)`, `original` for `read.stored(use, t)` (traced, not run).
    """
    reader = Reader(
      self, "forward", keys={t: jax.random.key(0) for t in self.tensors},
      reads={t: frozenset() for t in self.tensors},
    )  # fmt: skip
    shapes = [None if a is None else jax.ShapeDtypeStruct(
      jnp.shape(a), jnp.result_type(a)) for a in args]  # fmt: skip
    jax.eval_shape(lambda *a: self.fn(*a, reader), *shapes)
    reader.check_complete()
    return tuple("rounded" if reader.seen[u] else "original" for u in self.uses)

  # ---- forward and backward -------------------------------------------------

  def _forward(self, values, args, keys):
    if values is None:
      reader = Reader(self, "reference", keys=keys)
      out = self.fn(*args, reader)
      reader.check_complete()
      return out, None
    reader = Reader(self, "forward", keys=keys, reads=self.reads(values))
    out = self.fn(*args, reader)
    reader.check_complete()
    return out, {"args": tuple(args), "kept": reader.kept}

  def _backward(self, values, res, g, overrides=None) -> tuple:
    """The inputs' gradients, each use reading per `values` (names or
    traced indices into `VALUES`), or the array `overrides[use]`."""

    def f(*args):
      reader = Reader(
        self,
        "backward",
        values=values,
        kept=res["kept"],
        bkey=res.get("backward_key"),
        overrides=overrides,
        choices=res.get("choices"),
      )
      return self.fn(*args, reader)

    _, pullback = jax.vjp(f, *res["args"])
    return pullback(g)


def custom(name, fn, *, args, saved, uses) -> Custom:
  """`Custom(name, fn, args=args, saved=saved, uses=uses)`."""
  return Custom(name, fn, tuple(args), saved, tuple(uses))

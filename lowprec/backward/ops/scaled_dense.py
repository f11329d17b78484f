"""A dense layer whose three GEMMs read block-scaled operands, per use.

An FP8 or FP4 training recipe is a set of choices about the three GEMMs of
every linear layer `y = x W + b`:

  forward        y  = Q_x(x) Q_w(W)          blocks along K (x's last axis,
                                             W's first)
  data gradient  dx = Q_g(dy) Q_w'(W)^T      blocks along N
  weight grad.   dW = Q_x'(x)^T Q_g'(dy)     blocks along M (the tokens)

Block-scaled hardware contracts along the block axis, so a recipe either
re-quantizes `W` along N for the data gradient (MXFP8: two copies, one per
orientation) or scales `W` in square tiles, whose transpose is the same
tiles (NVFP4: one copy); it re-quantizes `x` along M for the weight
gradient, optionally after a random Hadamard transform of both of that
GEMM's inputs along M (NVFP4: 16 x 16, one random sign vector). Which value
the backward reads for `W` and `x` is a use with a policy, like every saved
tensor of `lowprec.ops`:

  sdense.in@dw       x as the weight gradient reads it
  sdense.kernel@dx   W as the data gradient reads it

with the values of `lowprec.policy` plus `requantized`: a new quantization
of the original tensor in the orientation the GEMM contracts along (`x_dw`
for x, after the Hadamard transform when there is one; `kernel_dx` for W),
nearest or stochastic as that rounding says. The reference gradient (the
exact gradient of the forward as it ran) reads `rounded` for both: the
`requantized` copy is what it is predicted to be by `produces` (the
forward's copy again for square tiles rounded to nearest; otherwise a
different deterministic rounding, biased, or a stochastic draw of the
original, biased where the forward rounded and unbiased where it did not).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.backward import policy as policy_lib
from lowprec.backward.ops import saved
from lowprec.backward.ops.base import Op, per_value
from lowprec.backward.ops.dense import Dense
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.grids import choices
from lowprec.grids import scaled as scaled_lib

VALUES = (*policy_lib.OP_VALUES, "requantized")
LAYOUTS = ("1d", "2d")

_TABLE = (
  Requirement(
    "sdense.in@dw",
    "x",
    "rounded",
    True,
    ("kernel",),
    "y = x~ W~ + b, so dL/dW = x~^T dy reads the x~ the forward multiplied "
    "(blocked along K); the weight-gradient GEMM contracts along M",
  ),
  Requirement(
    "sdense.kernel@dx",
    "kernel",
    "rounded",
    True,
    ("x",),
    "straight through x~ -> x, dL/dx = dy W~^T reads the W~ the forward "
    "multiplied; the data-gradient GEMM contracts along N",
  ),
)

_NONE = Rounding()


def check_hadamard(n) -> int:
  """`n` if it is 0 (no transform) or a power of two >= 2."""
  ok = isinstance(n, int | np.integer) and not isinstance(n, bool)
  if not ok or n < 0 or (n and (n < 2 or n & (n - 1))):
    raise ValueError(
      f"hadamard={n!r}: the random Hadamard transform needs a power of two "
      ">= 2 (NVFP4 uses 16), or 0 for none"
    )
  return int(n)


def hadamard_matrix(n: int) -> np.ndarray:
  """The `n x n` Hadamard matrix of Sylvester's construction divided by
  `sqrt(n)`: symmetric and orthogonal (`H @ H = I`)."""
  check_hadamard(n)
  h = np.ones((1, 1), np.float64)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return (h / np.sqrt(n)).astype(np.float32)


def random_hadamard(t, signs, n: int):
  """`t[M, C]` transformed along M in blocks of `n` rows: each block `b`
  becomes `H diag(signs) b`. The same `signs` on both inputs of a product
  `a^T c` leave it unchanged: `(H D a)^T (H D c) = a^T c`."""
  m, c = t.shape
  h = jnp.asarray(hadamard_matrix(n))
  blocks = signs[:, None] * t.reshape(m // n, n, c).astype(jnp.float32)
  return jnp.einsum("ij,bjc->bic", h, blocks).reshape(m, c)


def _oriented(r: Rounding, axis: int, block: int | None = None) -> Rounding:
  """`r` with its scaled format's blocks along `axis` (and of `block`
  elements); unscaled and per-tensor formats are returned as they are."""
  if not r.is_scaled_format or r.format.block is None:
    return r
  fmt = scaled_lib.get_scaled_format(r.format, axis=axis, block=block)
  return dataclasses.replace(r, format=fmt)


def _block(r: Rounding) -> int | None:
  if r.is_scaled_format:
    return r.format.block
  return None


def _to_tiles(w, b):
  k, n = w.shape
  return (
    w.reshape(k // b, b, n // b, b)
    .transpose(0, 2, 1, 3)
    .reshape(k // b, n // b, b * b)
  )


def _from_tiles(t, shape, b):
  k, n = shape
  return t.reshape(k // b, n // b, b, b).transpose(0, 2, 1, 3).reshape(k, n)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class _TiledStored:
  """A tensor's narrow form kept in `b x b` tiles; `value()` in its shape."""

  stored: object  # the rounding's narrow form of the tiled tensor
  shape: tuple[int, int]
  b: int

  def value(self) -> jax.Array:
    return _from_tiles(self.stored.value(), self.shape, self.b)

  def tree_flatten(self):
    return (self.stored,), (self.shape, self.b)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


@dataclasses.dataclass(frozen=True)
class Oriented:
  """A `Rounding` applied with its blocks in one layout: `"rows"` (along
  the last axis), `"cols"` (along the first axis of a matrix) or `"tiles"`
  (square `b x b` tiles of a matrix, `b` the format's block). It has what
  `lowprec.ops.saved` asks of a rounding, so saved tensors are kept and
  read by that module in any layout."""

  rounding: Rounding
  kind: str

  @property
  def is_identity(self) -> bool:
    return self.rounding.is_identity

  @property
  def mode(self) -> str:
    return self.rounding.mode

  def round(self, t, key=None, *, mode=None):
    """`(value, stored)`: `t` rounded in this layout; `stored.value()` is
    the value again, in `t`'s shape."""
    r, b = self.rounding, _block(self.rounding)
    if self.kind == "tiles" and b:
      v, s = _oriented(r, -1, b * b).round(_to_tiles(t, b), key, mode=mode)
      return _from_tiles(v, t.shape, b), _TiledStored(s, t.shape, b)
    axis = 0 if self.kind == "cols" else -1
    return _oriented(r, axis).round(t, key, mode=mode)

  def quantize(self, t, key=None, *, mode=None):
    return self.round(t, key, mode=mode)[1]


@dataclasses.dataclass(frozen=True)
class ScaledDense(Op):
  """`y = Q_x(x) Q_w(W) + b` with block-scaled data- and weight-gradient
  GEMMs; the backward reads `x` and `W` per use (module docstring).

  Forward: `x` (`[..., K]`) rounded by `x` with blocks along K, `W`
  (`[K, N]`) by `kernel` with blocks along K (`kernel_blocks="1d"`) or in
  square tiles (`"2d"`); float32 product, bias added. Backward, with `dy`
  `[..., N]` flattened to `[M, N]`:

    dx = Q_grad(dy) W_r^T            Q_grad blocked along N
    dW = H(x_r)^T Q_grad_dw(H(dy))   Q_grad_dw blocked along M
    db = sum(dy)                     (not rounded)

  `W_r` is what `sdense.kernel@dx` reads, `x_r` what `sdense.in@dw` reads
  (`requantized`: `Q_x_dw(H(x))` blocked along M), and `H` the random
  Hadamard transform along M in blocks of `hadamard` rows with one random
  sign vector per call (identity when `hadamard=0`).

  Every rounding is a `Rounding` or its string: a scaled format
  (`"nvfp4"`, `"mxfp8_e4m3"`, `"mxfp4_e2m1"`, ...; its block size along
  the axis this operator puts it on; the scale rule is the format's, e.g.
  `get_scaled_format("mxfp8_e4m3", rule="noclip")` for MXFP8's rounded-up
  scales), a plain format (`"bfloat16"`), or None (not rounded).

  Attributes:
    x: the forward's rounding of the input.
    kernel: the forward's rounding of the kernel.
    grad: rounding of `dy` for the data gradient.
    grad_dw: rounding of `dy` for the weight gradient.
    x_dw: the `requantized` read of `x` (None: `x`'s rounding).
    kernel_dx: the `requantized` read of `W` (None: `kernel`'s rounding).
    kernel_blocks: `"1d"` or `"2d"` (square tiles of the kernel format's
      block size; the data gradient's copy then shares the forward's tiles).
    hadamard: rows per random Hadamard block of the weight gradient's
      inputs, a power of two; 0 for none.

  Example:
    ```python
    op = ScaledDense.nvfp4()  # NVIDIA's NVFP4 recipe, reads as it does
    y = op(x, w, b, key=jax.random.key(0), policy=op.recipe_policy)
    ```
  """

  x: Rounding | str | None = None
  kernel: Rounding | str | None = None
  grad: Rounding | str | None = None
  grad_dw: Rounding | str | None = None
  x_dw: Rounding | str | None = None
  kernel_dx: Rounding | str | None = None
  kernel_blocks: str = "1d"
  hadamard: int = 0

  name = "scaled_dense"
  args = ("x", "kernel", "bias")
  tensors = ("x", "kernel")
  table = _TABLE
  values = VALUES

  def __post_init__(self):
    self._coerce()
    for f in ("grad_dw", "x_dw", "kernel_dx"):
      object.__setattr__(self, f, Rounding.parse(getattr(self, f)))
    choices.check_choice("kernel_blocks", self.kernel_blocks, LAYOUTS)
    object.__setattr__(self, "hadamard", check_hadamard(self.hadamard))

  # ---- recipes ------------------------------------------------------------

  @classmethod
  def nvfp4(cls, **changes) -> ScaledDense:
    """NVIDIA's NVFP4 recipe: NVFP4 everywhere (1 x 16 blocks, E4M3 block
    scales times a float32 tensor scale), weights in 16 x 16 tiles, inputs
    and weights rounded to nearest, gradients stochastically, a 16-row
    random Hadamard transform on the weight gradient's inputs. Read it
    with `recipe_policy`; `changes` are ablations (`kernel_blocks="1d"`,
    `hadamard=0`, `grad="nvfp4"`)."""
    base = dict(
      x="nvfp4",
      kernel="nvfp4",
      grad="nvfp4:stochastic",
      grad_dw="nvfp4:stochastic",
      kernel_blocks="2d",
      hadamard=16,
    )
    return cls(**{**base, **changes})

  @classmethod
  def mxfp8(cls, rule: str = "noclip", **changes) -> ScaledDense:
    """The MXFP8 recipe: every tensor, gradients included, e4m3 in blocks
    of 32 with E8M0 scales, rounded to nearest; `rule="noclip"` rounds
    the scales up (the recipe's), `"ocp"` is the OCP floor rule; weights
    quantized once per orientation (1 x 32 and 32 x 1)."""
    fmt = scaled_lib.get_scaled_format("mxfp8_e4m3", rule=rule)
    base = dict(x=fmt, kernel=fmt, grad=fmt, grad_dw=fmt)
    return cls(**{**base, **changes})

  @property
  def recipe_policy(self) -> policy_lib.Policy:
    """The reads block-scaled hardware makes: both uses `requantized`
    (the GEMM's own orientation; for square tiles rounded to nearest, the
    forward's copy)."""
    return policy_lib.Policy.parse(
      "sdense.in@dw=requantized,sdense.kernel@dx=requantized"
    )

  # ---- what each read gives ----------------------------------------------

  def requantizer(self, tensor: str) -> Rounding:
    """The rounding of the `requantized` read of `tensor`."""
    own = self.x_dw if tensor == "x" else self.kernel_dx
    return self.rounding(tensor) if own.is_identity else own

  def _requantized_is_forward_grid(self, tensor: str) -> bool:
    """Whether `requantized` rounds `tensor` onto the forward's grid by the
    same map (a square-tiled kernel; an unblocked format of `x` without a
    Hadamard transform)."""
    q, r = self.requantizer(tensor), self.rounding(tensor)
    if q.format != r.format:
      return False
    if _block(q) is None:
      return tensor == "kernel" or self.hadamard == 0
    return tensor == "kernel" and self.kernel_blocks == "2d"

  def produces(self, req: Requirement, value: str) -> str:
    """`Op.produces`, and for `requantized`: the forward's product when it
    is the same map onto the same grid (`nearest`), else `requantized` (a
    different deterministic rounding) or `draw` (a stochastic one,
    independent of the forward, with mean the original; `offset_draw`
    where its scales can clip, `Rounding.saturates`)."""
    if value != "requantized":
      return super().produces(req, value)
    q = self.requantizer(req.tensor)
    if q.is_identity:
      return "original"
    if q.mode == "stochastic":
      return "offset_draw" if q.saturates else "draw"
    if self._requantized_is_forward_grid(req.tensor):
      return "nearest"
    return "requantized"

  def grad_roundings(self) -> tuple[Rounding, ...]:
    return (self.grad, self.grad_dw)

  def unrounded(self) -> ScaledDense:
    return dataclasses.replace(
      self, x=None, kernel=None, grad=None, grad_dw=None, x_dw=None,
      kernel_dx=None, hadamard=0,
    )  # fmt: skip

  def without_grad_rounding(self) -> ScaledDense:
    return dataclasses.replace(self, grad=None, grad_dw=None, hadamard=0)

  def _needs_backward_key(self, values) -> bool:
    if super()._needs_backward_key(values) or self.hadamard:
      return True
    if self.grad_dw.stochastic:
      return True
    return any(
      v == "requantized" and self.requantizer(r.tensor).stochastic
      for r, v in zip(self.table, values, strict=True)
    )

  # ---- bytes --------------------------------------------------------------

  def kernel_bytes(self, k: int, n: int) -> tuple[float, float]:
    """Bytes a `[k, n]` kernel takes on hardware that contracts along the
    block axis: `(forward copy, data-gradient copy)`. The data gradient's
    copy is 0 with square tiles (it is the forward's) and the re-quantized
    copy along N otherwise (block-scaled GEMMs cannot read the forward's
    copy transposed). Elements at their bit width, one byte per block
    scale (E8M0 or E4M3), 4 bytes per tensor scale (NVFP4)."""

    def one(r: Rounding) -> float:
      if r.is_identity:
        return 4.0 * k * n
      fmt = r.format
      if not r.is_scaled_format:
        return fmt.bits / 8 * k * n + (4 if r.scaled else 0)
      out = fmt.element.bits / 8 * k * n
      if fmt.block is None:
        return out + 4
      tiles = self.kernel_blocks == "2d"
      out += k * n / (fmt.block**2 if tiles else fmt.block)
      return out + (4 if fmt.scale_type == "e4m3" else 0)

    first = one(self.kernel)
    if self._requantized_is_forward_grid("kernel"):
      return first, 0.0
    return first, one(self.requantizer("kernel"))

  # ---- shapes -------------------------------------------------------------

  def check_shapes(self, x_shape, kernel_shape) -> None:
    """Raises a ValueError naming the fix when a block or the Hadamard
    size does not divide the axis it runs along."""
    if len(kernel_shape) != 2 or not x_shape:
      raise ValueError(
        f"scaled_dense takes x [..., K] and kernel [K, N], got {x_shape} "
        f"and {kernel_shape}"
      )
    k, n = kernel_shape
    if x_shape[-1] != k:
      raise ValueError(
        f"scaled_dense: x {tuple(x_shape)} and kernel {tuple(kernel_shape)} "
        f"do not contract: x's last axis (K = {x_shape[-1]}) must equal the "
        f"kernel's first ({k}); a kernel for this x is [{x_shape[-1]}, N]"
      )
    m = int(np.prod(x_shape[:-1], dtype=np.int64))
    checks = [
      ("x (blocks along K)", self.x, k),
      ("grad (blocks along N)", self.grad, n),
      ("grad_dw (blocks along M, the tokens)", self.grad_dw, m),
      ("x_dw (blocks along M, the tokens)", self.requantizer("x"), m),
      ("kernel (blocks along K)", self.kernel, k),
      ("kernel_dx (blocks along N)", self.requantizer("kernel"), n),
    ]
    if self.kernel_blocks == "2d":
      checks.append(("kernel (2d tiles, along N)", self.kernel, n))
    for what, r, size in checks:
      b = _block(r)
      if b and size % b:
        raise ValueError(
          f"scaled_dense: {what}: {r.format.name} blocks of {b} do not "
          f"divide {size}. Choose a width or token count that is a "
          f"multiple of {b} (pad with zeros), or a format with a block "
          "that divides it (get_scaled_format(..., block=k))"
        )
    if self.hadamard and m % self.hadamard:
      raise ValueError(
        f"scaled_dense: hadamard={self.hadamard} does not divide the "
        f"{m} tokens (M) of the weight gradient; use a batch x length "
        f"that is a multiple of {self.hadamard}, or a smaller power of two"
      )

  def apply(self, values, args, key, backward_key=None):
    if len(args) >= 2:  # Op.apply counts the arguments
      self.check_shapes(jnp.shape(args[0]), jnp.shape(args[1]))
    return super().apply(values, args, key, backward_key)

  def reference(self, *args, key=None):
    if len(args) >= 2:
      self.check_shapes(jnp.shape(args[0]), jnp.shape(args[1]))
    return super().reference(*args, key=key)

  # ---- telemetry ----------------------------------------------------------

  def telemetry(self, x, kernel) -> dict[str, jax.Array]:
    """Counts of what the forward meets, as int32 arrays (traceable).

    `nonfinite/x` and `nonfinite/kernel`: the elements of each operand
    that are NaN or infinite; `nonfinite`: their sum. A block-scaled
    rounding saturates an infinite element onto its grid (by design of
    the formats: with a block whose other values are at most 1, inf
    becomes 1.75 in MXFP8 and 1.0 in NVFP4), so `y` stays finite where
    `x @ W` is not, and a diverged weight or activation would not show
    in the loss. Read the counts beside the loss, e.g. return
    `op.telemetry(x, w)` as an auxiliary output of the loss function.

    Example:
      >>> op = ScaledDense.mxfp8()
      >>> x = jnp.ones((32, 32)).at[0, 0].set(jnp.inf)
      >>> int(op.telemetry(x, jnp.ones((32, 32)))["nonfinite"])
      1
    """
    self.check_shapes(jnp.shape(x), jnp.shape(kernel))
    counts = {
      f"nonfinite/{name}": jnp.sum(~jnp.isfinite(t), dtype=jnp.int32)
      for name, t in (("x", x), ("kernel", kernel))
    }
    return {"nonfinite": sum(counts.values()), **counts}

  # ---- forward and backward ----------------------------------------------

  def _oriented(self, tensor: str) -> Oriented:
    """`tensor`'s forward rounding in its forward layout: x in rows, the
    kernel in columns or tiles."""
    kind = "rows"
    if tensor == "kernel":
      kind = "tiles" if self.kernel_blocks == "2d" else "cols"
    return Oriented(self.rounding(tensor), kind)

  def _round(self, tensor, t, keys, reads, res):
    """`Op._round` with the rounding in its forward layout, and the
    original kept where a use re-quantizes it."""
    o = self._oriented(tensor)
    if reads is None:  # straight through: the reference forward
      return saved.straight_through(o, t, keys[tensor])
    need = reads[tensor]
    if "requantized" in need:  # a new quantization of the original
      need = need | {"original"}
    value, res[tensor] = saved.save(o, t, keys[tensor], need)
    return value

  # The forward is `ops.Dense`'s: round x, round W (by `_round` above),
  # multiply, add the bias.
  _forward = Dense._forward

  def _read_tensor(self, tensor, value, res, bkey):
    """The value one use reads of `tensor` (not `requantized`)."""
    k = None if bkey is None else saved.key_for(bkey, f"fresh:{tensor}")
    o = self._oriented(tensor)
    return saved.read(o, res[tensor], value, k).astype(jnp.float32)

  def _backward(self, values, res, g):
    bkey = res["backward_key"]
    kept_x = res["x"]
    xo = kept_x.get("original")
    n = g.shape[-1]
    g2 = g.reshape(-1, n).astype(jnp.float32)
    m = g2.shape[0]

    def key(name):
      return None if bkey is None else saved.key_for(bkey, name)

    # Data gradient: dy blocked along N, W as `sdense.kernel@dx` reads it.
    gx = g2
    if not self.grad.is_identity:
      gx = Oriented(self.grad, "rows").round(g2, key("grad:dx"))[0]
    i_w = self.uses.index("sdense.kernel@dx")
    w_shape = self._kernel_shape(res)

    def read_kernel(v):
      if v == "requantized":
        w = res["kernel"]["original"]
        q = self.requantizer("kernel")
        if q.is_identity:
          return w.astype(jnp.float32)
        kind = "tiles" if self.kernel_blocks == "2d" else "rows"
        return Oriented(q, kind).round(w, key("requantized:kernel"))[0]
      return self._read_tensor("kernel", v, res, bkey)

    wv = per_value(values[i_w], read_kernel, self.values)
    dx = jnp.matmul(gx, wv.T)

    # Weight gradient: both inputs through H along M, dy blocked along M.
    signs = None
    if self.hadamard:
      bits = jax.random.bernoulli(key("hadamard"), 0.5, (self.hadamard,))
      signs = jnp.where(bits, 1.0, -1.0).astype(jnp.float32)

    def h(t):
      return t if signs is None else random_hadamard(t, signs, self.hadamard)

    gw = h(g2)
    if not self.grad_dw.is_identity:
      gw = Oriented(self.grad_dw, "cols").round(gw, key("grad:dw"))[0]
    i_x = self.uses.index("sdense.in@dw")
    k_dim = w_shape[0]

    def read_x(v):
      if v == "requantized":
        xo2 = xo.reshape(m, k_dim).astype(jnp.float32)
        q = self.requantizer("x")
        hx = h(xo2)
        if q.is_identity:
          return hx
        return Oriented(q, "cols").round(hx, key("requantized:x"))[0]
      return h(self._read_tensor("x", v, res, bkey).reshape(m, k_dim))

    xv = per_value(values[i_x], read_x, self.values)
    dw = jnp.matmul(xv.T, gw)
    dx = dx.reshape(*g.shape[:-1], k_dim)
    return dx, dw, g2.sum(0)

  def _kernel_shape(self, res):
    kept = res["kernel"]
    if "original" in kept:
      return kept["original"].shape
    return next(iter(kept.values())).value().shape


def scaled_dense(x, kernel, bias=None, *, policy=None, key=None, **config):
  """`ScaledDense(**config)(x, kernel, bias, policy=policy, key=key)`."""
  return ScaledDense(**config)(x, kernel, bias, policy=policy, key=key)


RECIPES = ("nvfp4", "mxfp8")
_FIELDS = ("x", "kernel", "grad", "grad_dw", "x_dw", "kernel_dx")


def recipe(name: str, changes: str | dict = "") -> ScaledDense:
  """A named recipe with changes: `recipe("nvfp4", "kernel_blocks=1d")`.

  Args:
    name: `"nvfp4"` (`ScaledDense.nvfp4`) or `"mxfp8"` (`ScaledDense.mxfp8`).
    changes: `"field=value,..."` or a dict: a rounding field (`x`,
      `kernel`, `grad`, `grad_dw`, `x_dw`, `kernel_dx`) takes a rounding
      string or `none`; `kernel_blocks` `1d`/`2d`; `hadamard` an integer;
      `rule` (MXFP8's scale rule) `noclip`/`ocp`.

  Raises:
    ValueError: an unknown recipe or field, a malformed item (the message
      lists the valid ones).
  """
  choices.check_choice("block-scaled recipe", name, RECIPES)
  if isinstance(changes, str):
    items = {}
    for item in filter(None, (s.strip() for s in changes.split(","))):
      key, sep, value = item.partition("=")
      if not sep:
        raise ValueError(
          f"malformed recipe change {item!r}: expected 'field=value' items "
          "separated by commas, e.g. 'kernel_blocks=1d,hadamard=0'"
        )
      items[key.strip()] = value.strip()
    changes = items
  valid = (*_FIELDS, "kernel_blocks", "hadamard") + (
    ("rule",) if name == "mxfp8" else ()
  )
  kw = {}
  for key, value in changes.items():
    choices.check_choice(f"{name} recipe field", key, valid)
    if key == "hadamard":
      try:
        value = int(value)
      except ValueError:
        raise ValueError(
          f"hadamard={value!r}: expected an integer (a power of two, or 0)"
        ) from None
    elif key in _FIELDS and value in ("none", "None", ""):
      value = None
    kw[key] = value
  return ScaledDense.nvfp4(**kw) if name == "nvfp4" else ScaledDense.mxfp8(**kw)

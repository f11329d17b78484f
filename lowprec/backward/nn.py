"""Flax (linen) modules over `lowprec.ops`, with per-use backward policies.

The modules are the pieces of a pre-norm GPT block: `Dense`, `NormDense` (a
LayerNorm or RMSNorm fused with the projection it feeds, so that the norm
output is a saved tensor with per-use reads), `CausalSelfAttention` (pre-norm,
fused QKV projection, optional rotary embedding) and `MLP` (pre-norm, 4x
width, GELU). Every module takes one `Numerics`: what the forward rounds, what
the backward reads per use, and the RNG stream that stochastic rounding draws
from. With `Numerics()` nothing is rounded and each module computes exactly
what the plain Flax layers compute (`flax.linen.Dense`, `LayerNorm` with
`epsilon=1e-5`, softmax attention).

Parameter names follow `flax.linen`: `kernel`/`bias` for dense layers;
`norm_scale`/`norm_bias` for the norm fused into `NormDense`.

Examples:
  A GPT-2 block with an emulated FP8 forward and backward:

  ```python
  import flax.linen as fnn
  from lowprec.backward import nn
  num = nn.Numerics.fp8()  # e4m3 SR activations and e4m3 weights,
  # e5m2 SR gradients, reference reads
  class Block(fnn.Module):
    @fnn.compact
    def __call__(self, x):
      x = x + nn.CausalSelfAttention(num_heads=12, numerics=num)(x)
      return x + nn.MLP(numerics=num)(x)
  params = Block().init(jax.random.key(0), x)
  y = Block().apply(params, x, rngs={"lowprec": jax.random.key(1)})
  ```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import LazyRng

from lowprec.backward import ops
from lowprec.backward.ops.norm_dense import normalise
from lowprec.backward.ops.rounding import Rounding
from lowprec.backward.policy import Policy
from lowprec.engine import stacked as stacked_lib

Initializer = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class Numerics:
  """What `lowprec.nn` modules round, and what their backward reads.

  Attributes:
    policy: the backward-state policy for every op of the module (a `Policy`
      or anything `Policy.parse` takes); None reads what the reference
      gradient reads (`lowprec.ops.REFERENCE`). Start from
      `ops.REFERENCE.override(...)` to change some uses only.
    saved: rounding of the activations the forward rounds and keeps: dense
      inputs, norm outputs, attention probabilities and outputs, activation
      inputs.
    weights: rounding of kernels.
    grads: rounding of gradients entering the backward's matmuls.
    rng: the Flax RNG stream stochastic roundings draw from; pass
      `rngs={rng: key}` to `apply`.
    attn_fresh_out: what a `fresh` read of attention's output redraws
      (`ops.Attention.fresh_out`): `"redraw"`, every rounding upstream of
      it (a copy from the distribution of the reused output), or
      `"output"`, the output's rounding only.
    compute: an `ops.ScaledDense` run by every dense layer in place of
      `ops.Dense` (a block-scaled FP8/FP4 recipe, e.g.
      `ops.ScaledDense.nvfp4()`); its inputs and kernels are rounded by it,
      not by `saved` and `weights`. A `NormDense` then computes its norm
      unrounded and feeds the recipe. None: `ops.Dense`.
    fused_attention: run attention as `jax.nn.dot_product_attention`
      (cuDNN's fused kernel on a GPU where it applies, XLA's otherwise)
      wherever that is the same function: when neither the probabilities,
      the output nor the incoming gradients are rounded, every read of
      every attention use is the reference's, whatever the policy says.
      Where any of them is rounded, `ops.Attention` runs (its reads are
      the point); `attention_kind` says which.
    native_fp8: dense layers whose input and kernel both round to a
      float8 format compute their forward product as a float8 dot with a
      float32 result (an FP8 GEMM where the hardware has one; equal to the
      emulation up to float32 rounding, `ops.Dense.native_fp8`).
  """

  policy: Policy | str | None = None
  saved: Rounding | str | None = None
  weights: Rounding | str | None = None
  grads: Rounding | str | None = None
  rng: str = "lowprec"
  attn_fresh_out: str = "redraw"
  compute: ops.ScaledDense | None = None
  fused_attention: bool = False
  native_fp8: bool = False

  def __post_init__(self):
    policy = ops.REFERENCE if self.policy is None else self.policy
    object.__setattr__(self, "policy", Policy.parse(policy))
    for f in ("saved", "weights", "grads"):
      object.__setattr__(self, f, Rounding.parse(getattr(self, f)))
    if self.compute is not None and not isinstance(
      self.compute, ops.ScaledDense
    ):
      raise TypeError(
        f"Numerics.compute takes an ops.ScaledDense (e.g. "
        f"ops.ScaledDense.nvfp4()), got {self.compute!r}"
      )

  def without_grad_rounding(self) -> Numerics:
    """The same numerics with no gradient rounding (`grads`, and the
    recipe's, `ops.ScaledDense.without_grad_rounding`)."""
    compute = self.compute
    if compute is not None:
      compute = compute.without_grad_rounding()
    return dataclasses.replace(self, grads=None, compute=compute)

  def reference(self) -> Numerics:
    """The same forward, the reference reads, no gradient rounding: the
    numerics whose gradient is the reference gradient."""
    return dataclasses.replace(self.without_grad_rounding(), policy=None)

  @classmethod
  def fp8(cls, policy=None, *, saved_mode: str = "stochastic", **kw):
    """Emulated FP8: e4m3 activations (`saved_mode`) and weights (nearest),
    e5m2 stochastic gradients, all with per-tensor scaling."""
    return cls(
      policy=policy,
      saved=Rounding("float8_e4m3fn", saved_mode),
      weights=Rounding("float8_e4m3fn", "nearest"),
      grads=Rounding("float8_e5m2", "stochastic"),
      **kw,
    )


def attention_kind(numerics: Numerics) -> str:
  """`"fused"` where `CausalSelfAttention` runs
  `jax.nn.dot_product_attention` under `numerics`, else `"op"`
  (`ops.Attention`, whose backward reads per use).

  Example:
    >>> attention_kind(Numerics(fused_attention=True))
    'fused'
    >>> attention_kind(Numerics.fp8(fused_attention=True))  # rounds P, O
    'op'
  """
  if not numerics.fused_attention:
    return "op"
  if not (numerics.saved.is_identity and numerics.grads.is_identity):
    return "op"
  return "fused"


def call(module: nn.Module, op: ops.Op, numerics: Numerics, *args):
  """Runs any operator, built-in or your own, inside a linen module.

  The policy is `numerics.policy` (it must cover `op`'s uses: for an
  `ops.Custom`, combine `ops.REFERENCE.override(op.reference_policy)`); the
  key, when `op` draws, comes from the module's `numerics.rng` stream.

  Args:
    module: the calling module (`self` inside `@nn.compact`).
    op: an operator of `lowprec.ops`, e.g. an `ops.Custom`.
    numerics: the module's `Numerics`.
    *args: the operator's inputs.

  Returns:
    The operator's output.

  Raises:
    ValueError: the policy does not cover `op`; `op` draws and the module
      has no `numerics.rng` stream.

  Example:
    ```python
    y = nn.call(self, my_op, self.numerics, x, kernel)
    ```
  """
  return _call(module, op, numerics, *args)


def _call(module: nn.Module, op: ops.Op, num: Numerics, *args):
  """Runs `op` with the module's policy and, if it draws, a key."""
  values = op.resolve(num.policy)
  key = None
  if op._needs_forward_key() or op._needs_backward_key(values):
    if not (module.has_rng(num.rng) or module.is_initializing()):
      raise ValueError(
        f"{type(module).__name__} rounds stochastically ({op.name}) and "
        f"needs the RNG stream {num.rng!r}: call apply(..., "
        f"rngs={{{num.rng!r}: jax.random.key(seed)}})"
      )
    key = _key(module, num.rng)
  return op.apply(values, args, key)


# A layer applied inside a scan cannot hash its own name (`h_3`) into its
# keys, so `rolled` draws each layer's keys outside the scan, exactly as
# the unrolled layer would, and hands them in through this collection.
KEYS = "lowprec_keys"


def _key(module: nn.Module, stream: str) -> jax.Array:
  """The module's next key of `stream`: its own draw, or the one `rolled`
  computed for it (recorded when the collection is mutable)."""
  key = module.make_rng(stream)
  if not module.has_rng(stream):  # init without the stream: `params` draws
    return key
  name = f"{stream}_{module.scope.rng_counters[stream]}"
  if module.is_mutable_collection(KEYS):
    module.put_variable(KEYS, name, key)
  elif module.has_variable(KEYS, name):
    key = module.get_variable(KEYS, name)
  return key


def rolled(
  parent: nn.Module,
  make: Callable[..., nn.Module],
  names: Sequence[str],
  x: jax.Array,
  *,
  remat: bool = False,
  rng: str = "lowprec",
) -> jax.Array:
  """Applies one block under each of `names` in turn, compiled once.

  The same bits as the unrolled loop

      for name in names:
        x = make(name=name)(x)

  (forward, gradients and every stochastic rounding), with the parameters
  where the loop puts them (`params[name]`, so rules, telemetry and
  checkpoints see the same tree), but traced and compiled as one
  `jax.lax.scan` body: compile time stays flat as depth grows. Inside
  `apply`, the blocks' parameters are stacked along a new leading axis
  (one copy, read once per step), or read as they are where the params
  store them stacked (`params["h_0:12"]`, `lowprec.engine.stacked`), and
  each layer's random keys are computed outside the scan from its path,
  as the unrolled layer draws them. `init` runs the loop, so initial
  values are the loop's too.

  Args:
    parent: the calling module (`self` inside `@nn.compact`).
    make: builds the block; called as `make(name=...)` or
      `make(parent=None)`. Every block must have the same structure.
    names: the blocks' names, in order (e.g. `h_0`, ..., `h_11`).
    x: the input of the first block.
    remat: recompute each block's forward in its backward
      (`jax.checkpoint`; `flax.linen.remat` in the loop).
    rng: the RNG stream the blocks' stochastic roundings draw from
      (`Numerics.rng`).

  Returns:
    The output of the last block.
  """
  # Parameters stored stacked (`lowprec.engine.stacked`: `h_0:12` holding
  # `h_0` to `h_11`) are read as they are, with no stack built per step.
  params = {} if parent.is_initializing() else parent.variables["params"]
  key = stacked_lib.key_of(names)
  held = params.get(key) if key is not None else None
  if held is None and (parent.is_initializing() or len(names) < 2):
    cls = nn.remat(make) if remat else make
    for name in names:
      x = cls(name=name)(x)
    return x
  if held is None:
    held = jax.tree.map(
      lambda *a: jnp.stack(a), *[params[name] for name in names]
    )
  first = jax.tree.map(lambda a: a[0], held)
  block = make(parent=None)
  keys = None
  if parent.has_rng(rng):
    base = parent.scope.rngs[rng]
    dummy = base.as_jax_rng()
    table = jax.eval_shape(
      lambda: block.apply(
        {"params": first}, x, rngs={rng: dummy}, mutable=[KEYS]
      )[1]
    ).get(KEYS, {})
    keys = _layer_keys(base, table, names)

  def body(x, layer):
    p, k = layer
    variables = {"params": p} | ({} if k is None else {KEYS: k})
    rngs = {} if k is None else {rng: dummy}
    return block.apply(variables, x, rngs=rngs), None

  if remat:
    body = jax.checkpoint(body, prevent_cse=False)
  return jax.lax.scan(body, x, (held, keys))[0]


def _layer_keys(base, table: dict, names: Sequence[str]):
  """Each layer's keys at the paths `table` names (`{path: {stream_n:
  ...}}`), as `make_rng` inside that layer draws them, stacked."""

  def draw(name: str, path, leaf: str) -> jax.Array:
    counter = int(leaf.rsplit("_", 1)[1])
    return LazyRng.create(base, name, *path, counter).as_jax_rng()

  flat = jax.tree_util.tree_flatten_with_path(table)[0]
  per_layer = []
  for name in names:
    layer = {}
    for path, _ in flat:
      *scope, leaf = [p.key for p in path]
      node = layer
      for part in scope:
        node = node.setdefault(part, {})
      node[leaf] = draw(name, scope, leaf)
    per_layer.append(layer)
  return jax.tree.map(lambda *a: jnp.stack(a), *per_layer)


class Dense(nn.Module):
  """`y = x~ W~ + b` (`ops.Dense`); input rounded by `numerics.saved`
  unless `round_input=False` (an input that is already rounded)."""

  features: int
  use_bias: bool = True
  round_input: bool = True
  numerics: Numerics = Numerics()
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x):
    num = self.numerics
    kernel = self.param(
      "kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32
    )
    bias = None
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.features,), jnp.float32)
    if num.compute is not None:
      return _call(self, num.compute, num, x, kernel, bias)
    op = ops.Dense(
      x=num.saved if self.round_input else None,
      kernel=num.weights,
      grad=num.grads,
      native_fp8=num.native_fp8,
    )
    return _call(self, op, num, x, kernel, bias)


class NormDense(nn.Module):
  """LayerNorm/RMSNorm, output rounded and stored, then a dense layer
  (`ops.NormDense`). Pass `kernel` (shape `[in, features]`) to use an
  external kernel, e.g. the transposed token embedding of a tied head."""

  features: int
  norm: str = "layer"
  epsilon: float = 1e-5
  use_bias: bool = True
  use_norm_bias: bool = True  # LayerNorm only
  numerics: Numerics = Numerics()
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x, kernel=None):
    num = self.numerics
    d = x.shape[-1]
    gain = self.param("norm_scale", nn.initializers.ones_init(), (d,))
    shift = None
    if self.norm == "layer" and self.use_norm_bias:
      shift = self.param("norm_bias", nn.initializers.zeros_init(), (d,))
    if kernel is None:
      kernel = self.param("kernel", self.kernel_init, (d, self.features))
    bias = None
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.features,))
    if num.compute is not None:
      y = normalise(x, self.norm, self.epsilon)[0]
      y = y * gain + (0.0 if shift is None else shift)
      return _call(self, num.compute, num, y, kernel, bias)
    op = ops.NormDense(
      norm=self.norm,
      eps=self.epsilon,
      out=num.saved,
      kernel=num.weights,
      grad=num.grads,
      native_fp8=num.native_fp8,
    )
    return _call(self, op, num, x, gain, shift, kernel, bias)


def rotary(x, base: float = 10000.0):
  """Rotary position embedding of `x[batch, length, heads, head_dim]`.

  Rotates the pairs `(x[..., i], x[..., i + head_dim/2])` by the angle
  `position * base**(-2i / head_dim)` (the half-split convention of
  GPT-NeoX and LLaMA).
  """
  t, d = x.shape[1], x.shape[-1]
  if d % 2:
    raise ValueError(f"rotary embedding needs an even head_dim, got {d}")
  inv = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
  cos = jnp.cos(angle)[None, :, None, :]
  sin = jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class CausalSelfAttention(nn.Module):
  """Pre-norm causal self-attention: norm + fused QKV projection
  (`NormDense`), optional rotary embedding, `ops.Attention`, output
  projection. Input and output are `[batch, length, width]`.

  `norm=None` drops the norm (the QKV projection is then a `Dense`).
  `out_kernel_init` lets GPT-2 scale its residual projections.
  """

  num_heads: int
  norm: str | None = "layer"
  epsilon: float = 1e-5
  rotary_base: float | None = None
  use_bias: bool = True
  numerics: Numerics = Numerics()
  kernel_init: Initializer = nn.initializers.lecun_normal()
  out_kernel_init: Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x):
    num = self.numerics
    b, t, width = x.shape
    if width % self.num_heads:
      raise ValueError(f"width {width} is not a multiple of num_heads")
    head = width // self.num_heads
    if self.norm is None:
      proj = Dense(
        3 * width,
        self.use_bias,
        numerics=num,
        kernel_init=self.kernel_init,
        name="qkv",
      )
    else:
      proj = NormDense(
        3 * width,
        self.norm,
        self.epsilon,
        self.use_bias,
        numerics=num,
        kernel_init=self.kernel_init,
        name="qkv",
      )
    q, k, v = jnp.split(proj(x), 3, axis=-1)
    q, k, v = (a.reshape(b, t, self.num_heads, head) for a in (q, k, v))
    if self.rotary_base is not None:
      q, k = rotary(q, self.rotary_base), rotary(k, self.rotary_base)
    if attention_kind(num) == "fused":
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
      o = o.reshape(b, t, width)
    else:
      op = ops.Attention(
        probs=num.saved,
        out=num.saved,
        grad=num.grads,
        fresh_out=num.attn_fresh_out,
      )
      o = _call(self, op, num, q, k, v).reshape(b, t, width)
    # The attention output is already rounded (by `saved`).
    return Dense(
      width,
      self.use_bias,
      round_input=False,
      numerics=num,
      kernel_init=self.out_kernel_init,
      name="out",
    )(o)


class MLP(nn.Module):
  """Pre-norm MLP: norm + `hidden`-wide projection (`NormDense`, default
  4x the input width), activation (`ops.Activation`, input stored rounded),
  projection back."""

  hidden: int | None = None
  activation: str = "gelu"
  norm: str | None = "layer"
  epsilon: float = 1e-5
  use_bias: bool = True
  numerics: Numerics = Numerics()
  kernel_init: Initializer = nn.initializers.lecun_normal()
  out_kernel_init: Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x):
    num = self.numerics
    width = x.shape[-1]
    hidden = self.hidden or 4 * width
    if self.norm is None:
      h = Dense(
        hidden,
        self.use_bias,
        numerics=num,
        kernel_init=self.kernel_init,
        name="fc",
      )(x)
    else:
      h = NormDense(
        hidden,
        self.norm,
        self.epsilon,
        self.use_bias,
        numerics=num,
        kernel_init=self.kernel_init,
        name="fc",
      )(x)
    h = _call(self, ops.Activation(self.activation, x=num.saved), num, h)
    return Dense(
      width,
      self.use_bias,
      numerics=num,
      kernel_init=self.out_kernel_init,
      name="proj",
    )(h)

"""A task = a model, its loss and its data, built from the config."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from experiments import data as data_lib
from experiments import lowprec_config, models, probes
from lowprec import nn as lpnn
from lowprec.engine import stacked
from lowprec.grids import choices


@dataclasses.dataclass(frozen=True)
class Task:
  init: Callable[[jax.Array], Any]  # key -> params
  loss: Callable[..., tuple[jax.Array, dict]]  # (params, batch, key)
  data: Any  # .batch_size, .batch(step, rows=None) and .eval_batches()
  model: Any
  # (params, key) -> {name: scalar}, logged every train.probe_every_steps;
  # compiled on its first call; `.programs(params, key)` its compiled parts
  probe: Callable[..., dict] | None = None
  # how the model computes: jit `compute.precise(fn)` for its precision
  compute: Compute | None = None
  # runs of layers whose leaves `init` stores stacked and `loss` and
  # `probe` take so (`model.layer_storage`; `lowprec.engine.stacked`):
  # checkpoints and summaries hold them apart
  layers: tuple = ()


# model.compute_dtype: the dtype the forward and backward compute in.
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# model.matmul_precision: how float32 matmuls and convolutions are
# computed (jax.default_matmul_precision); "default" is XLA's own choice,
# which is TF32 on NVIDIA GPUs from Ampere on, one bfloat16 pass on TPUs
# and full float32 on CPUs. bfloat16 products: model.compute_dtype.
MATMUL_PRECISIONS = {
  "default": None,
  "highest": "float32",
  "tf32": "tensorfloat32",
}


@dataclasses.dataclass(frozen=True)
class Compute:
  """How a model computes: `dtype` for its floating parameters (cast for
  the forward; the stored parameters, their gradients, the optimizer and
  the loss stay float32) and the matmul precision of float32 products."""

  dtype: str = "float32"
  matmul_precision: str = "default"

  @classmethod
  def of(cls, m) -> Compute:
    """The `model` section's choice, checked."""
    c = cls(
      m.get("compute_dtype", "float32"), m.get("matmul_precision", "default")
    )
    choices.check_choice("model.compute_dtype", c.dtype, COMPUTE_DTYPES)
    choices.check_choice(
      "model.matmul_precision", c.matmul_precision, MATMUL_PRECISIONS
    )
    return c

  def __call__(self, apply):
    """`apply(params, *args, **kw)` with the floating parameters cast to
    `dtype` (their gradients flow back to the float32 parameters)."""
    dtype = COMPUTE_DTYPES[self.dtype]
    if dtype == jnp.float32:
      return apply

    def cast(x):
      if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        return x.astype(dtype)
      return x

    def run(params, *args, **kw):
      return apply(jax.tree.map(cast, params), *args, **kw)

    return run

  def precise(self, fn):
    """`fn` traced under the matmul precision: wrap the whole function
    that is jitted (a train step with its gradient, an evaluation), so the
    backward's products, traced after the forward returns, have it too."""
    precision = MATMUL_PRECISIONS[self.matmul_precision]
    if precision is None:
      return fn

    @functools.wraps(fn)
    def run(*args, **kw):
      with jax.default_matmul_precision(precision):
        return fn(*args, **kw)

    return run


def _gpt_cfg(m) -> dict:
  return {
    k: m[k]
    for k in (
      "vocab_size",
      "seq_len",
      "n_layer",
      "n_head",
      "d_model",
      "mlp_ratio",
      "positions",
      "norm",
      "parallel_block",
      "tie_embeddings",
      "init_std",
      "activation",
    )
  } | {
    "remat": m.get("remat", False),
    "scan_layers": m.get("scan_layers", False),
  }


def compute_header(config) -> str:
  """The run header's line on how the model computes: dtype, matmul
  precision and, for a GPT, which attention runs and how its blocks'
  leaves are stored.

  Example: `compute float32, matmul precision default, attention fused
  (jax.nn.dot_product_attention), layers stored stacked`.
  """
  c = Compute.of(config.model)
  line = f"compute {c.dtype}, matmul precision {c.matmul_precision}"
  if config.model.kind == "gpt":
    kind = attention_kind(config)
    line += ", attention " + (
      "fused (jax.nn.dot_product_attention)"
      if kind == "fused"
      else "per-use operator (lowprec.ops.Attention)"
    )
    stored = "stacked" if lowprec_config.stacked_layers(config) else "apart"
    line += f", layers stored {stored}"
  if config.lowprec.get("native_fp8", False):
    line += ", float8 products as float8 dots"
  return line


def attention_kind(config) -> str:
  """Which attention a GPT config runs: "fused"
  (`jax.nn.dot_product_attention`) or the per-use operator's kind."""
  return lpnn.attention_kind(_numerics(config))


def _numerics(config):
  """The model's `lowprec.nn.Numerics`, with `model.fused_attention`."""
  num = models.numerics_from(config.lowprec)
  fused = bool(config.model.get("fused_attention", False))
  return dataclasses.replace(num, fused_attention=fused)


def gpt_task(config) -> Task:
  m, d = config.model, config.data
  cfg = _gpt_cfg(m) | {"compute_keep_last": config.lowprec.compute_keep_last}
  model = models.GPT(cfg, _numerics(config))
  compute = Compute.of(m)
  common = dict(
    seq_len=m.seq_len,
    batch_size=d.batch_size,
    seed=config.train.seed,
    vocab_size=m.vocab_size,
  )
  if d.name == "tokens":
    data = data_lib.build("tokens", data_dir=d.path, **common)
  else:
    data = data_lib.build(d.name, **common)

  def init(key):
    return model.init(key, jnp.zeros((1, m.seq_len), jnp.int32))["params"]

  data = _EvalLimited(data, d.eval_batches)
  probe = None
  if config.train.probe_every_steps:
    probe = _gpt_probe(config.train, model, data.eval_batches()[0], compute)
  loss = _lm_loss(model, compute)
  if not lowprec_config.stacked_layers(config):
    return Task(init, loss, data, model, probe, compute)
  # The blocks' leaves stored stacked: the optimizer's per-leaf programs
  # are one per kind of leaf at any depth.
  layers = tuple(models.layer_groups(cfg))
  return Task(
    lambda key: stacked.stack(init(key), layers),
    lambda params, *a: loss(_as_model_reads(params, layers, cfg), *a),
    data,
    model,
    None if probe is None else _unstacked_probe(probe),
    compute,
    layers,
  )


def _as_model_reads(params, layers, cfg):
  """Stacked params as the GPT reads them: a run of blocks that
  `lowprec.nn.rolled` scans, as it is stored; the others (unrolled
  blocks, a run of one, which the loop steps) apart."""
  if cfg.get("scan_layers", True) and all(b - a > 1 for _, a, b in layers):
    return params
  return stacked.unstack(params)


def _unstacked_probe(probe):
  """The probe, given params with stacked layers: it reads them apart."""

  def run(params, key):
    return probe(stacked.unstack(params), key)

  if hasattr(probe, "programs"):
    run.programs = lambda params, key: probe.programs(
      stacked.unstack(params), key
    )
  return run


def _gpt_probe(t, model, batch, compute):
  """The gradient probe of `experiments.probes` on (part of) `batch`.

  The reference: the same forward draws, the reference reads, gradients
  passed through every rounding unchanged.
  """
  lean = t.get("probe_lean", False)
  cfg = model.cfg | ({"remat": True} if t.get("probe_remat", False) else {})
  ref = model.numerics.reference()
  ref_loss = _lm_loss(models.GPT(cfg, ref), compute)
  run = model.numerics
  if not t.probe_grad_rounding:
    run = run.without_grad_rounding()
  loss = _lm_loss(models.GPT(cfg, run), compute)
  if t.probe_batch_size:
    batch = tuple(x[: t.probe_batch_size] for x in batch)
  build = probes.lean_gradient_probe if lean else probes.gradient_probe
  fn = build(
    lambda p, b, k: loss(p, b, k)[0],
    lambda p, b, k: ref_loss(p, b, k)[0],
    batch,
    probes.parse_groups(t.probe_groups),
    t.probe_draws,
    t.probe_chunk_rows,
  )
  fn = compute.precise(fn)
  if lean:
    return fn
  jitted = jax.jit(fn)

  def probe(params, key):
    return jitted(params, key)

  probe.programs = lambda params, key: [jitted.lower(params, key).compile()]
  return probe


def _lm_loss(model, compute: Compute = Compute()):
  apply = compute(
    lambda params, *a, **kw: model.apply({"params": params}, *a, **kw)
  )

  def loss(params, batch, key):
    inputs, targets = batch
    logits = apply(params, inputs, rngs={"lowprec": key})
    ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets
    )
    return ce.mean(), {}

  return loss


def _classifier_task(config, model) -> Task:
  d = config.data
  kwargs = dict(batch_size=d.batch_size, seed=config.train.seed)
  if d.name == "mnist":
    kwargs["data_dir"] = d.path
  data = data_lib.build(d.name, **kwargs)
  example = data.batch(0)[0][:1]

  def init(key):
    return model.init(key, jnp.asarray(example))["params"]

  def loss(params, batch, key):
    del key
    x, y = batch
    logits = model.apply({"params": params}, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    acc = (logits.argmax(-1) == y).mean()
    return ce, {"accuracy": acc}

  return Task(init, loss, _EvalLimited(data, d.eval_batches), model)


def mlp_task(config) -> Task:
  m = config.model
  return _classifier_task(
    config, models.MLP(tuple(m.hidden), 10, activation="relu")
  )


def cnn_task(config) -> Task:
  return _classifier_task(config, models.CNN(tuple(config.model.channels), 10))


def regression_task(config) -> Task:
  d = config.data
  data = data_lib.build(
    "regression",
    batch_size=d.batch_size,
    seed=config.train.seed,
    num_train=d.n_train,
    num_test=d.n_test,
    d_in=d.d_in,
    n_features=d.n_features,
    noise=d.noise,
  )
  model = models.Linear()

  def init(key):
    return model.init(key, jnp.zeros((1, d.n_features)))["params"]

  def loss(params, batch, key):
    del key
    x, y = batch
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2), {}

  return Task(init, loss, _EvalLimited(data, d.eval_batches), model)


class _EvalLimited:
  """A data set whose evaluation uses the config's number of batches."""

  def __init__(self, data, n: int):
    self._data, self._n = data, n

  @property
  def batch_size(self) -> int:
    return self._data.batch_size

  def batch(self, step: int, rows=None):
    return self._data.batch(step, rows=rows)

  def eval_batches(self, rows=None):
    return self._data.eval_batches(self._n, rows=rows)


TASKS: dict[str, Callable[[Any], Task]] = {
  "gpt": gpt_task,
  "mlp": mlp_task,
  "cnn": cnn_task,
  "regression": regression_task,
}


# Tasks with a gradient probe (train.probe_every_steps).
PROBED = ("gpt",)


def build(config) -> Task:
  """The task of `config.model.kind` (checked by `study.validate`)."""
  return TASKS[config.model.kind](config)

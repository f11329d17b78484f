"""What the full-scale configs cost: FLOPs, bytes per device, wall-clock.

For each full-scale study config that names an arm to plan
(`study.plan_arm`), from XLA's own analyses of the compiled programs on
this machine's backend:

* FLOPs per step: `cost_analysis()` of one gradient pass over a
  per-device batch (no microbatch scan, whose loop body XLA would count
  once), scaled to the global batch; checked against the model FLOPs
  `6 N T + 12 L d s T` (`model_flops`);
* bytes per device: parameters and optimizer state from the state's arrays
  (divided by `train.fsdp` where sharded), activations and temporaries of
  one microbatch of `per_device_batch` rows from `memory_analysis()` of the
  train step, and the probe's temporaries likewise;
* wall-clock of the whole run on `chips` chips at `ASSUMED_MFU` of each
  device's peak (`PEAK_FLOPS`), and the MFU a step time would give.

Emulated low precision (the roundings, the reference trace) runs in float32
on every backend, so XLA's FLOPs exceed the model's; their ratio is in the
table. `scripts/plan_full_scale.py` prints the table; `synthetic_tokens`
makes token files to compile and step on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import lowprec
from experiments import lowprec_config

# Dense bf16 peak FLOP/s per chip (no sparsity), from the vendors' sheets:
# H100 SXM5 and H200 SXM: 989.4 TFLOPS BF16 Tensor Core dense (NVIDIA H100
# datasheet, "1,979 teraFLOPS*" with *sparsity, halved; NVIDIA H200
# datasheet, same figure); TPU v5e: 197 TFLOPS bf16 per chip (Google Cloud
# TPU v5e documentation, "System architecture").
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "TPU v5e": 197e12}
# Bytes of HBM per chip, same sources: H100 SXM 80 GB, H200 141 GB, v5e 16 GB.
HBM_BYTES = {"H100": 80e9, "H200": 141e9, "TPU v5e": 16e9}
# A typical MFU for a GPT of this size in JAX; wall-clock is stated at it.
ASSUMED_MFU = 0.4


def planned() -> dict[str, str]:
  """Config name -> the arm it plans (`study.plan_arm`, the study's most
  expensive arm), for every study config in configs/ that names one."""
  import importlib
  import pkgutil

  import configs

  out = {}
  for info in pkgutil.iter_modules(configs.__path__):
    module = importlib.import_module(f"configs.{info.name}")
    if not hasattr(module, "get_config"):
      continue
    arm = module.get_config("scale=full").study.get("plan_arm", "")
    if arm:
      out[info.name] = arm
  return out


def model_flops(params: int, n_layer: int, d_model: int, seq_len: int) -> float:
  """Training FLOPs per token: 6 N + 12 L d s (PaLM, Appendix B).

  `N` counts the parameters of matmuls (everything but position
  embeddings; a tied token embedding is the output layer's matmul); the
  second term is attention's QK^T and AV, forward and backward.
  """
  return 6 * params + 12 * n_layer * d_model * seq_len


def synthetic_tokens(
  directory: str, vocab_size: int, tokens: int = 1 << 20, seed: int = 0
) -> str:
  """Uniform random `train.bin` / `val.bin` (uint16) and `meta.json`."""
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  for split, n in (("train", tokens), ("val", max(tokens // 8, 1 << 14))):
    ids = rng.integers(0, vocab_size, n, dtype=np.int64).astype("<u2")
    ids.tofile(os.path.join(directory, f"{split}.bin"))
  with open(os.path.join(directory, "meta.json"), "w") as f:
    json.dump({"vocab_size": vocab_size, "tokenizer": "synthetic"}, f)
  return directory


def full_config(name: str, data_dir: str, **train):
  """The resolved full-scale config of the arm `name` plans, seed 0."""
  import importlib

  from experiments import study

  module = importlib.import_module(f"configs.{name}")
  arm = module.get_config("scale=full").study.plan_arm
  c = module.get_config(f"scale=full,arm={arm},seed=0")
  c = study.resolve(c, arm, 0)
  c.unlock()
  c.data.path = data_dir
  c.train.update(train)
  c.lock()
  return c


def _bytes(tree, fsdp: int) -> int:
  """Bytes per device of a state's arrays (sharded ones divided)."""
  total = 0
  for x in jax.tree.leaves(tree):
    n = x.size * x.dtype.itemsize
    shards = getattr(getattr(x, "sharding", None), "num_devices", 1)
    sharded = shards > 1 and not x.sharding.is_fully_replicated
    total += n // fsdp if sharded else n
  return total


@dataclasses.dataclass
class Plan:
  name: str
  params: int
  tokens_per_step: int
  steps: int
  model_flops_per_step: float
  xla_flops_per_step: float
  bytes_params: int
  bytes_opt_state: int
  bytes_step_temp: int  # activations and temporaries of one microbatch
  bytes_probe_temp: int
  per_device_batch: int
  compile_s: float

  def wall_clock_s(self, device: str, chips: int, mfu=ASSUMED_MFU) -> float:
    return (
      self.steps
      * self.model_flops_per_step
      / (chips * PEAK_FLOPS[device] * mfu)
    )

  def mfu(self, device: str, chips: int, step_s: float) -> float:
    return self.model_flops_per_step / (step_s * chips * PEAK_FLOPS[device])


def microbatch(config) -> int:
  """Rows of one microbatch: what one device holds activations for."""
  parts = config.train.virtual_shards or 1
  return config.data.batch_size // parts


def plan(
  name: str,
  data_dir: str,
  per_device_batch: int | None = None,
  probe: bool = True,
) -> Plan:
  """Compiles (does not run) the full-scale step and probe of `name`.

  `per_device_batch` rows per microbatch; by default the config's
  (`microbatch`). `probe=False` leaves the probe out (its compilation is
  the largest).
  """
  from experiments import train

  t0 = time.time()
  c = full_config(name, data_dir)
  per_device_batch = per_device_batch or microbatch(c)
  c = full_config(name, data_dir, virtual_shards=0, fsdp=1)
  full_batch, seq = c.data.batch_size, c.model.seq_len
  c.unlock()
  c.data.batch_size = per_device_batch
  c.train.probe_batch_size = min(c.train.probe_batch_size, per_device_batch)
  c.lock()
  run = train.build_run(c)
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, jnp.int32, sharding=run.mesh.batch),
    run.task.data.batch(0),
  )
  step = run.step_fn.lower(run.state, batch).compile()
  flops = float(step.cost_analysis()["flops"]) * full_batch / per_device_batch
  mem = step.memory_analysis()
  probe_temp = 0
  if probe and run.probe_fn is not None:
    probe_temp = max(
      int(compiled.memory_analysis().temp_size_in_bytes)
      for compiled in run.probe_fn.programs(run.state.params, run.eval_key)
    )
  params = run.state.params
  n = sum(int(x.size) for x in jax.tree.leaves(params))
  matmul = n - int(params["wpe"].size) if "wpe" in params else n
  m = c.model
  return Plan(
    name=name,
    params=n,
    tokens_per_step=full_batch * seq,
    steps=c.train.steps,
    model_flops_per_step=model_flops(matmul, m.n_layer, m.d_model, seq)
    * full_batch
    * seq,
    xla_flops_per_step=flops,
    bytes_params=_bytes(params, c.train.fsdp),
    bytes_opt_state=_bytes(run.state.opt_state, c.train.fsdp),
    bytes_step_temp=int(mem.temp_size_in_bytes),
    bytes_probe_temp=probe_temp,
    per_device_batch=per_device_batch,
    compile_s=time.time() - t0,
  )


def _gb(b: float) -> str:
  return f"{b / 1e9:.2f}"


def table(plans: list[Plan], chips: int = 8) -> str:
  """The plans as a Markdown table (one row per config, then per device)."""
  rows = [
    "| config | params | tokens/step | model TFLOP/step | XLA/model | "
    "GB params | GB opt state | GB step temp | GB probe temp |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for p in plans:
    rows.append(
      f"| {p.name} | {p.params:,} | {p.tokens_per_step:,} | "
      f"{p.model_flops_per_step / 1e12:,.0f} | "
      f"{p.xla_flops_per_step / p.model_flops_per_step:.2f} | "
      f"{_gb(p.bytes_params)} | {_gb(p.bytes_opt_state)} | "
      f"{_gb(p.bytes_step_temp)} | {_gb(p.bytes_probe_temp)} |"
    )
  rows += [
    "",
    f"Wall-clock of the whole run on {chips} chips at "
    f"{ASSUMED_MFU:.0%} MFU (hours):",
    "",
    "| config | steps | " + " | ".join(PEAK_FLOPS) + " |",
    "|---|---|" + "---|" * len(PEAK_FLOPS),
  ]
  for p in plans:
    hours = [p.wall_clock_s(d, chips) / 3600 for d in PEAK_FLOPS]
    rows.append(
      f"| {p.name} | {p.steps:,} | "
      + " | ".join(f"{h:.1f}" for h in hours)
      + " |"
    )
  return "\n".join(rows)


_COMPUTATION = re.compile(
  r"^%?([\w.\-]+) (\([^\n]*\)) -> [^\n]* \{\n(.*?)\n\}", re.M | re.S
)
_FUSION_CALL = re.compile(r" fusion\([^\n]*calls=%?([\w.\-]+)")


def fusions(hlo: str) -> tuple[int, int]:
  """The fusions of an optimized HLO module (`compiled.as_text()`), and how
  many of them differ (their fused computations compared without names
  and metadata).

  XLA:CPU generates code for every fusion; XLA:GPU's kernel reuse cache
  compiles identical fusions once. A deep model's layers make copies of
  the same fusions (one per layer for each per-parameter step), so the
  second count is what grows with depth on a GPU.
  """
  bodies = {}
  for name, params, body in _COMPUTATION.findall(hlo):
    body = re.sub(r", metadata=\{[^}]*\}", "", body)
    key = re.sub(r"[\w.\-]+:", "p:", params) + re.sub(r"%[\w.\-]+", "%", body)
    bodies[name] = key
  calls = _FUSION_CALL.findall(hlo)
  return len(calls), len({bodies.get(c, c) for c in calls})


def describe(result: dict) -> str:
  """One line of `step`'s measurements."""
  mfu = result["mfu"]
  mem = result["peak_device_bytes"] or result["peak_rss_bytes"]
  recipe = f" ({result['recipe']})" if result.get("recipe") else ""
  fused = (
    f"{result['fusions']:,} fusions, {result['distinct_fusions']:,} distinct, "
    if result.get("fusions")
    else ""
  )
  return (
    f"{result['config']}{recipe}: {result['tokens_per_s']:,.0f} tokens/s on "
    f"{result['chips']} x {result['device']}, MFU "
    f"{'n/a' if mfu is None else f'{mfu:.1%}'}, step "
    f"{result['step_s']:.2f} s (compiled in {result['compile_s']:.0f} s, "
    f"{fused}first step {result['first_step_s']:.1f} s), peak "
    f"memory {mem / 1e9:.1f} GB, loss {result['losses'][-1]:.3f}"
  )


def main(
  names: list[str],
  data_dir: str,
  per_device_batch: int | None = None,
  probe: bool = True,
) -> list:
  """Plans every config in `names` and prints the table; returns the plans."""
  plans = []
  valid = planned()
  for name in names:
    lowprec.grids.choices.check_choice("config", name, valid)
    c = full_config(name, data_dir)
    synthetic_tokens(data_dir, c.model.vocab_size)
    p = plan(name, data_dir, per_device_batch, probe)
    probed = (
      f", probe in chunks of {c.train.probe_chunk_rows or 'all'} row(s)"
      if p.bytes_probe_temp
      else ""
    )
    print(
      f"{name}: built and compiled in {p.compile_s:.0f} s; temporaries for "
      f"{p.per_device_batch} row(s) of {c.model.seq_len} tokens per "
      f"microbatch{probed}",
      flush=True,
    )
    plans.append(p)
  print(table(plans))
  return plans


def device_name(kind: str) -> str | None:
  """The `PEAK_FLOPS` key of a `device_kind` string, or None (e.g. CPU)."""
  k = kind.lower()
  for key, pattern in (("H100", "h100"), ("H200", "h200")):
    if pattern in k:
      return key
  if "v5e" in k or "v5 lite" in k or "v5litepod" in k:
    return "TPU v5e"
  return None


def peak_rss_bytes() -> int:
  """This process's peak resident memory (Linux reports KiB)."""
  import resource

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _phase(what: str) -> None:
  """A progress line on stderr with the resident and peak memory."""
  try:
    with open("/proc/self/statm") as f:
      now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError):
    now = 0
  print(
    f"[plan] {what}: resident {now / 1e9:.1f} GB, peak "
    f"{peak_rss_bytes() / 1e9:.1f} GB",
    file=sys.stderr,
    flush=True,
  )


def peak_device_bytes() -> int | None:
  """Peak bytes in use on the first local device, where the backend says."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


# The lowprec keys a recipe (`with_recipe`) replaces: the plan arm's
# write-back, its compensation, its stored state and its predictions.
_RECIPE_KEYS = {
  **lowprec_config.RECIPE_DEFAULTS,
  "state": (),
  **lowprec_config.NO_PREDICTIONS,
}


def with_recipe(c, recipe: str):
  """`c` with its weights and optimizer state stored as `recipe`
  (a `lowprec.recipes` name such as "bf16_kahan" or "bf16_sr+q8";
  "float32" for float32 AdamW), the config's own write-back, state store
  and predictions replaced; parameters it keeps in float32 stay so."""
  weights, state = lowprec.recipes.get(recipe)
  c = c.copy_and_resolve_references()
  c.unlock()
  c.lowprec.update(_RECIPE_KEYS)
  c.lowprec.update(weights.config)
  c.lowprec.state = state.config
  c.lock()
  return c


def step(name: str, data_dir: str, steps: int = 1, **overrides) -> dict:
  """Builds the full-scale config, runs `steps` steps and a probe; measures.

  `overrides` are `train.*` or `data.batch_size` values (a small batch for
  the CPU), `model`, a dict of `model.*` values (tiny shapes for a dry
  run of the same code), and `recipe`, a `lowprec.recipes` name that
  replaces the config's storage recipe (`with_recipe`). Returns losses,
  probe values, the train step's compile time (ahead of time, so the
  first step is a plain step), the time of the steps after the first and
  peak memory, as a dict.
  """
  from experiments import train

  batch_size = overrides.pop("batch_size", None)
  model = overrides.pop("model", None) or {}
  recipe = overrides.pop("recipe", None)
  c = full_config(name, data_dir, **overrides)
  if batch_size or model:
    c.unlock()
    c.data.batch_size = batch_size or c.data.batch_size
    c.model.update(model)
    c.lock()
  if recipe:
    c = with_recipe(c, recipe)
  synthetic_tokens(data_dir, c.model.vocab_size)
  t0 = time.time()
  run = train.build_run(c)
  _phase("built")
  state, losses, times = run.state, [], []
  t = time.time()
  step_fn = run.step_fn.lower(state, run.train_batch(0)).compile()
  compile_s = time.time() - t
  n_fusions, distinct = fusions(step_fn.as_text())
  _phase(f"compiled in {compile_s:.0f} s")
  for i in range(steps):
    t = time.time()
    state, m = step_fn(state, run.train_batch(i))
    losses.append(float(m["loss"]))
    times.append(time.time() - t)
    _phase(f"step {i + 1} in {times[-1]:.0f} s, loss {losses[-1]:.4f}")
  probe = {}
  if run.probe_fn is not None:
    t = time.time()
    out = run.probe_fn(state.params, run.eval_key)
    probe = {k: float(v) for k, v in jax.device_get(out).items()}
    probe_s = time.time() - t
    _phase(f"probe in {probe_s:.0f} s")
  params = run.state.params if steps == 0 else state.params
  n = sum(int(x.size) for x in jax.tree.leaves(params))
  tokens = c.data.batch_size * c.model.seq_len
  after = times[1:] or times
  step_s = float(np.mean(after)) if after else float("nan")
  flops = (
    model_flops(
      n - int(params["wpe"].size),
      c.model.n_layer,
      c.model.d_model,
      c.model.seq_len,
    )
    * tokens
  )
  device = device_name(jax.devices()[0].device_kind)
  chips = jax.device_count()
  mfu = (
    None if device is None else flops / step_s / (chips * PEAK_FLOPS[device])
  )
  return {
    "config": name,
    "recipe": recipe,
    "mfu": mfu,
    "chips": chips,
    "params": n,
    "batch_size": c.data.batch_size,
    "tokens_per_step": tokens,
    "losses": losses,
    "probe": probe,
    "probe_s": probe_s if probe else None,
    "compile_s": compile_s,
    "fusions": n_fusions,
    "distinct_fusions": distinct,
    "first_step_s": times[0] if times else None,
    "step_s": step_s,
    "tokens_per_s": tokens / step_s,
    "model_flops_per_s": flops / step_s,
    "total_s": time.time() - t0,
    "peak_rss_bytes": peak_rss_bytes(),
    "peak_device_bytes": peak_device_bytes(),
    "device": str(jax.devices()[0].device_kind),
  }


# Dense TF32 and FP8 peaks (no sparsity), from the same datasheets: half
# and twice the bf16 peak on H100 SXM and H200. HBM bandwidth per chip:
# H100 SXM 3.35 TB/s, H200 4.8 TB/s (NVIDIA datasheets).
TF32_PEAK_FLOPS = {"H100": 494.7e12, "H200": 494.7e12}
HBM_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
# The share of a matmul peak cuBLAS/cuDNN GEMMs of these shapes are
# taken to reach in the roofline below (an assumption, stated with it).
MATMUL_EFFICIENCY = 0.7


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes a train step accesses, from XLA's cost analysis, split by
  what they grow with. Per layer, and for the rest of the model (the
  embeddings, the last norm, the output layer and the loss):

  * `optimizer`: the optimizer's update and its apply, once per step;
  * `weights`: what a gradient pass reads and writes once per pass,
    however many rows it takes (weights, gradients): once per microbatch;
  * `per_token`, `per_square`: per row, `per_token * s + per_square *
    s^2` for `s`-token rows (activations; the square is attention's
    score and probability matrices where they are materialised).
  """

  layer: tuple[float, float, float, float]
  rest: tuple[float, float, float, float]

  def activations_scaled(self, factor: float) -> Traffic:
    """The same with the per-row (activation) bytes times `factor`."""

    def one(part):
      opt, weights, tok, sq = part
      return (opt, weights, tok * factor, sq * factor)

    return Traffic(one(self.layer), one(self.rest))

  def step_bytes(self, n_layer, rows, microbatches, seq, square=True):
    """Bytes of one step of `rows` rows of `seq` tokens in
    `microbatches` gradient passes; `square=False` leaves attention's
    square out (a fused attention kernel keeps it on chip)."""
    total = 0.0
    for (opt, weights, tok, sq), n in ((self.layer, n_layer), (self.rest, 1)):
      row = tok * seq + (sq * seq * seq if square else 0.0)
      total += n * (opt + microbatches * weights + rows * row)
    return total


def _fit_traffic(optimizer, grad) -> tuple[float, float, float, float]:
  """(optimizer, weights, per_token, per_square) from the optimizer's
  bytes and a gradient pass's bytes `grad[(seq, rows)]` at (s, 1), (s, 2)
  and (2 s, 1)."""
  (s, _), _, _ = sorted(grad)
  row_s = grad[(s, 2)] - grad[(s, 1)]  # one row of s tokens
  weights = grad[(s, 1)] - row_s
  row_2s = grad[(2 * s, 1)] - weights
  # row(s) = a s + b s^2 at s and 2s.
  b = (row_2s - 2 * row_s) / (2 * s * s)
  a = (row_s - b * s * s) / s
  return (optimizer, weights, a, b)


def traffic(c, seq: int = 128) -> Traffic:
  """Measures `Traffic` of config `c` on this machine's backend: the
  step's gradient pass and its optimizer compiled at 2 and 4 unrolled
  layers (their difference is two layers), rows of `seq` and `2 seq`
  tokens, one and two rows; nothing is run."""
  from experiments import optim, train

  if jax.device_count() != 1:
    raise ValueError(
      f"the roofline measures one chip's program, and this process has "
      f"{jax.device_count()} devices: run it with one (on a CPU, "
      "XLA_FLAGS=--xla_force_host_platform_device_count=1; on a GPU host, "
      "CUDA_VISIBLE_DEVICES=0)"
    )
  grads: dict[int, dict] = {}
  opts: dict[int, float] = {}
  for n_layer in (2, 4):
    grads[n_layer] = {}
    for s, rows in ((seq, 1), (seq, 2), (2 * seq, 1)):
      cc = c.copy_and_resolve_references()
      cc.unlock()
      cc.train.virtual_shards = 0
      cc.train.fsdp = 1
      cc.train.probe_every_steps = 0
      cc.data.batch_size = rows
      cc.model.update(dict(n_layer=n_layer, seq_len=s, scan_layers=False))
      cc.lock()
      run = train.build_run(cc)
      grads[n_layer][(s, rows)] = _grad_bytes(run)
    tx = optim.build(cc, jax.random.key(0), run.state.params)
    opts[n_layer] = _update_bytes(tx, run.state)
  two = {k: (grads[4][k] - grads[2][k]) / 2 for k in grads[2]}
  rest = {k: grads[2][k] - 2 * two[k] for k in grads[2]}
  layer_opt = (opts[4] - opts[2]) / 2
  return Traffic(
    _fit_traffic(layer_opt, two), _fit_traffic(opts[2] - 2 * layer_opt, rest)
  )


def _grad_bytes(run) -> float:
  """Bytes of `run`'s gradient pass over its batch."""
  from experiments import train

  loss_and_grad = train.make_loss_and_grad(run.task, run.mesh, 0)
  key = jax.random.key(0)
  fn = jax.jit(lambda p, b: loss_and_grad(p, b, key))
  return _accessed(fn, run.state.params, run.train_batch(0))


def _update_bytes(tx, state) -> float:
  """Bytes of `tx`'s update and its apply, the gradient as the params."""

  def update(params, opt_state, g):
    updates, opt_state = tx.update(g, opt_state, params)
    return lowprec.apply_updates(params, updates), opt_state

  return _accessed(jax.jit(update), state.params, state.opt_state, state.params)


def _accessed(fn, *args) -> float:
  analysis = fn.lower(*args).compile().cost_analysis()
  if isinstance(analysis, list):  # older jax: one dict per program
    analysis = analysis[0]
  return float(analysis["bytes accessed"])


def matmul_peak(c, device: str) -> tuple[float, str]:
  """The dense matmul peak `c`'s products run at on `device`, and its
  name: bf16 for `model.compute_dtype=bfloat16`, TF32 for float32 under
  XLA's default or tf32 precision (what XLA:GPU picks on NVIDIA GPUs
  from Ampere on); None where the table has no such peak."""
  dtype = c.model.get("compute_dtype", "float32")
  precision = c.model.get("matmul_precision", "default")
  if dtype == "bfloat16":
    return PEAK_FLOPS[device], "bf16"
  if precision in ("default", "tf32") and device in TF32_PEAK_FLOPS:
    return TF32_PEAK_FLOPS[device], "tf32"
  return None, precision


def roofline(c, devices=("H100", "H200"), seq: int = 128) -> list[dict]:
  """The step time of config `c` on one chip of each of `devices` that
  its FLOPs and bytes bound: the model's FLOPs at `MATMUL_EFFICIENCY` of
  the matmul peak (`matmul_peak`), plus the bytes XLA's cost analysis
  counts on this machine (`traffic`) at the chip's HBM bandwidth, the two
  not overlapped (and, as `mfu_overlapped`, overlapped). This backend's
  fusions stand in for the chip's (an
  accelerator's compiler fuses at least as much: fewer bytes); where the
  arm runs `jax.nn.dot_product_attention`, attention's square is left
  out (cuDNN's fused kernel keeps it on chip). With
  `model.compute_dtype=bfloat16` the bytes are the float32 model's with
  half its activation bytes: XLA:CPU computes bfloat16 arithmetic in
  float32 and counts the conversions, which a GPU does not. Returns, per
  device, the parts, the predicted seconds a step and the MFU (of the
  bf16 peak) it gives."""
  if c.model.get("compute_dtype", "float32") == "bfloat16":
    wide = c.copy_and_resolve_references()
    wide.unlock()
    wide.model.compute_dtype = "float32"
    wide.lock()
    t = traffic(wide, seq).activations_scaled(0.5)
  else:
    t = traffic(c, seq)
  m = c.model
  rows, seq_len = c.data.batch_size, m.seq_len
  parts = c.train.virtual_shards or 1
  fused = _attention_fused(c) if m.kind == "gpt" else False
  moved = t.step_bytes(m.n_layer, rows, parts, seq_len, square=not fused)
  flops = model_flops(_matmul_params(c), m.n_layer, m.d_model, seq_len)
  flops *= rows * seq_len
  out = []
  for device in devices:
    peak, kind = matmul_peak(c, device)
    mem_s = moved / HBM_BANDWIDTH[device]
    mm_s = flops / (MATMUL_EFFICIENCY * peak) if peak else float("nan")
    step_s = mem_s + mm_s
    out.append(
      {
        "device": device,
        "matmul": kind,
        "tokens_per_step": rows * seq_len,
        "model_tflop": flops / 1e12,
        "bytes_tb": moved / 1e12,
        "matmul_s": mm_s,
        "memory_s": mem_s,
        "step_s": step_s,
        "mfu": flops / step_s / PEAK_FLOPS[device],
        # The bound with the bytes moved while the matmuls run.
        "mfu_overlapped": flops / max(mem_s, mm_s) / PEAK_FLOPS[device],
        "of_tf32_peak": flops / step_s / TF32_PEAK_FLOPS[device],
        "tokens_per_s": rows * seq_len / step_s,
        "attention_square": not fused,
        "traffic": dataclasses.asdict(t),
      }
    )
  return out


def _attention_fused(c) -> bool:
  """Whether `c`'s GPT runs attention as `jax.nn.dot_product_attention`."""
  from experiments import tasks

  return tasks.attention_kind(c) == "fused"


def _matmul_params(c) -> int:
  """The model's parameters less its position table (`model_flops`'s
  `N`), counted on its abstract parameters."""
  from experiments import tasks

  task = tasks.build(c)
  shapes = jax.eval_shape(task.init, jax.random.key(0))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  if "wpe" in shapes:
    n -= int(np.prod(shapes["wpe"].shape))
  return n


def roofline_of(
  name: str, data_dir: str, recipe=None, model=None, devices=("H100", "H200")
) -> list[dict]:
  """`roofline` of the full-scale config `name` (its planned arm, or
  `recipe` in its place; `model`, a dict of `model.*` overrides such as
  `compute_dtype`), with its config named in each result."""
  c = full_config(name, data_dir)
  if model:
    c.unlock()
    c.model.update(model)
    c.lock()
  if recipe:
    c = with_recipe(c, recipe)
  synthetic_tokens(data_dir, c.model.vocab_size)
  m = c.model
  named = {
    "config": name,
    "recipe": recipe or c.study.arm,
    "compute": m.get("compute_dtype", "float32"),
    "matmul_precision": m.get("matmul_precision", "default"),
  }
  return [{**named, **r} for r in roofline(c, devices)]


def describe_roofline(r: dict) -> str:
  """One line of `roofline_of`'s result."""
  return (
    f"{r['config']} ({r['recipe']}, compute {r['compute']}) on {r['device']}:"
    f" {r['model_tflop']:.0f} TFLOP at {MATMUL_EFFICIENCY:.0%} of the "
    f"{r['matmul']} peak {r['matmul_s']:.2f} s + {r['bytes_tb']:.2f} TB at "
    f"HBM bandwidth {r['memory_s']:.2f} s = {r['step_s']:.2f} s a step of "
    f"{r['tokens_per_step']:,} tokens: MFU {r['mfu']:.0%} "
    f"(overlapped {r['mfu_overlapped']:.0%}) "
    f"({r['of_tf32_peak']:.0%} of TF32), {r['tokens_per_s']:,.0f} tokens/s"
  )

"""The training loop: `train_and_evaluate(config) -> summary`.

One jitted step on a `jax.sharding` mesh (data parallel, optional FSDP of
parameters and optimizer state), donated buffers, metrics as JSON lines as
they happen, progress with steps/s and ETA, orbax checkpoints with resume,
and a clear stop on a non-finite loss that keeps the last good checkpoint.

Determinism: the global batch is split into `train.virtual_shards`
microbatches; each device scans over its own, and the gradients are summed in
a fixed pairwise tree, so the result does not depend on how many devices
hold them; the gradient's norm (clipping) is summed in a fixed order too
(`optim.global_norm`). Bit for bit the same on 1, 2 or 8 devices, with
replicated or FSDP-sharded parameters (`train.fsdp`), and on several
processes (`experiments.distributed`: each reads only its rows of a batch).
Random bits for rounding are keyed by (seed, step, microbatch), data by
(seed, step).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lowprec
from experiments import (
  checkpoint,
  distributed,
  faults,
  ledger,
  lowprec_config,
  optim,
  results,
  tasks,
  tensorboard,
)
from lowprec.engine import stacked


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: optimizer updates done
  params: Any  # parameter pytree (float32 on a grid, or native dtypes)
  opt_state: Any  # optax state, write-back keys and telemetry included


class NonFiniteLoss(FloatingPointError):
  pass


@dataclasses.dataclass
class Mesh:
  mesh: jax.sharding.Mesh
  batch: NamedSharding  # leading (virtual-shard) axis over every device

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())


def make_mesh(config) -> Mesh:
  """Every device, `train.fsdp` per parameter shard group (`study.validate`
  checks that it divides the device count)."""
  devices = np.array(jax.devices())
  fsdp = config.train.fsdp
  mesh = jax.sharding.Mesh(devices.reshape(-1, fsdp), ("data", "fsdp"))
  return Mesh(mesh, NamedSharding(mesh, P(("data", "fsdp"))))


def param_sharding(mesh: Mesh, tree, fsdp: int, shapes=None):
  """FSDP: shard each array's largest dimension divisible by `fsdp`.

  With `shapes` (a set of parameter shapes), only arrays of those shapes
  (optimizer moments, say) are sharded; small state such as telemetry
  counts stays replicated, so every process can read it.
  """

  def leaf(x):
    if fsdp == 1 or not getattr(x, "ndim", 0):
      return mesh.replicated()
    if shapes is not None and tuple(x.shape) not in shapes:
      return mesh.replicated()
    dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
    for d in dims:
      if x.shape[d] % fsdp == 0:
        spec = [None] * x.ndim
        spec[d] = "fsdp"
        return NamedSharding(mesh.mesh, P(*spec))
    return mesh.replicated()

  return jax.tree.map(leaf, tree)


def _tree_sum(tree):
  """Pairwise sum over the leading axis (a power of two), in a fixed tree.

  Summing aligned blocks first and then the block sums gives the same tree,
  so devices holding consecutive blocks reproduce the one-device sum.
  """

  def total(x):
    while x.shape[0] > 1:
      x = x[0::2] + x[1::2]
    return x[0]

  return jax.tree.map(total, tree)


def _batch_axes():
  return ("data", "fsdp")


def _deterministic(fn, mesh: Mesh, parts: int):
  """Maps `fn(params, part, key, index)` over `parts` microbatches.

  Each device scans over its consecutive microbatches one at a time (the
  same program on any device count), sums them in a fixed pairwise tree,
  gathers the device sums and finishes the same tree: the result is bit
  for bit independent of the number of devices. Returns the mean. `parts`
  is a power of two, a multiple of the device count, and divides the batch
  (`config_checks.check_batch` says so before a run starts).
  """
  local = parts // mesh.mesh.size

  def per_device(params, batch, key):
    first = jax.lax.axis_index(_batch_axes()) * local

    def split(x):
      return x.reshape(local, x.shape[0] // local, *x.shape[1:])

    def body(carry, xs):
      part, i = xs
      return carry, fn(params, part, key, i)

    _, outs = jax.lax.scan(
      body, None, (jax.tree.map(split, batch), first + jnp.arange(local))
    )
    gathered = jax.lax.all_gather(_tree_sum(outs), _batch_axes())
    return jax.tree.map(lambda x: x / parts, _tree_sum(gathered))

  return jax.shard_map(
    per_device,
    mesh=mesh.mesh,
    in_specs=(P(), P(_batch_axes()), P()),
    out_specs=P(),
    check_vma=False,  # the gathered tree sum is the same on every device
  )


def make_loss_and_grad(task, mesh: Mesh, parts: int):
  """Mean loss (and aux) and gradient over the global batch.

  With `parts > 0` the reduction is deterministic across device counts
  (see `_deterministic`); with 0 it is XLA's (faster, order unspecified).
  """

  def per_part(params, batch, key, i):
    return jax.value_and_grad(task.loss, has_aux=True)(
      params, batch, jax.random.fold_in(key, i)
    )

  if parts == 0:
    return lambda params, batch, key: per_part(params, batch, key, 0)
  return _deterministic(per_part, mesh, parts)


def make_eval_loss(task, mesh: Mesh, parts: int):
  def per_part(params, batch, key, i):
    return task.loss(params, batch, jax.random.fold_in(key, i))[0]

  if parts == 0:
    return lambda params, batch, key: per_part(params, batch, key, 0)
  return _deterministic(per_part, mesh, parts)


def _progress(step, total, loss, val, rate, elapsed):
  """A progress line; `rate` (steps/s, compilation excluded) may be None
  when no step has run since the compiled one."""
  val_s = f" val {val:.4f}" if val is not None else ""
  if rate:
    speed = f"{rate:.2f} steps/s | elapsed {elapsed:.0f}s ETA "
    speed += f"{(total - step) / rate:.0f}s"
  else:
    speed = f"-- steps/s | elapsed {elapsed:.0f}s ETA --"
  return f"step {step}/{total} loss {loss:.4f}{val_s} | {speed}"


@dataclasses.dataclass
class Run:
  """Everything one run needs, built from its config (nothing trained)."""

  task: tasks.Task
  mesh: Mesh
  state: TrainState
  step_fn: Any  # jitted (state, batch) -> (state, metrics); donates state
  eval_fn: Any  # jitted (params, batch, key) -> mean loss
  eval_key: jax.Array
  probe_fn: Any = None  # (params, key) -> {name: scalar}, or None

  def put(self, batch):
    """This process's rows of a batch (numpy) as one global array.

    On one process these are all the rows; on several, `rows()`'s.
    """
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(self.mesh.batch, x),
      batch,
    )

  def rows(self, num_rows: int) -> slice:
    """The rows of a global batch that this process reads."""
    return distributed.process_rows(self.mesh.batch, num_rows)

  def train_batch(self, step: int):
    """The global batch of `step`, each process reading only its rows."""
    rows = self.rows(self.task.data.batch_size)
    return self.put(self.task.data.batch(step, rows=rows))

  def eval_batches(self) -> list:
    """The fixed evaluation batches, each process reading only its rows."""
    return [self.put(b) for b in self.task.data.eval_batches(rows=self.rows)]


def build_run(config) -> Run:
  """Builds the task, mesh, optimizer, initial state and jitted step."""
  task = tasks.build(config)
  mesh = make_mesh(config)
  parts = config.train.virtual_shards
  root = jax.random.key(config.train.seed)
  init_key, opt_key, step_key, eval_key = jax.random.split(root, 4)
  fsdp = config.train.fsdp
  source = None  # parameters to start from, when not the model's init
  if config.train.init_from_arm:
    # Checkpoints hold the layers apart, however the run stores them.
    like = jax.eval_shape(lambda k: stacked.unstack(task.init(k)), init_key)
    source = checkpoint.restore_params(
      source_checkpoints(config),
      config.train.init_from_step,
      jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        like,
        param_sharding(mesh, like, fsdp),
      ),
    )
    source = stacked.stack(source, task.layers) if task.layers else source
  first = source
  if first is None and lowprec_config.needs_params(config.lowprec):
    first = jax.jit(task.init)(init_key)  # per-tensor scales come from it
  tx = optim.build(config, opt_key, first)
  target = lowprec_config.writeback_target(config.lowprec, first)

  def init_state(source):
    params = task.init(init_key) if source is None else source
    if target is not None:  # write-back starts from weights on the grid
      params = lowprec.to_grid(params, target)
    return TrainState(jnp.int32(0), params, tx.init(params))

  abstract = jax.eval_shape(init_state, source)
  shapes = {tuple(x.shape) for x in jax.tree.leaves(abstract.params)}
  state_shard = TrainState(
    mesh.replicated(),
    param_sharding(mesh, abstract.params, fsdp),
    param_sharding(mesh, abstract.opt_state, fsdp, shapes),
  )
  state = jax.jit(init_state, out_shardings=state_shard)(source)
  loss_and_grad = make_loss_and_grad(task, mesh, parts)

  def train_step(state, batch):
    key = jax.random.fold_in(step_key, state.step)
    (loss, aux), grads = loss_and_grad(state.params, batch, key)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = lowprec.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optim.global_norm(grads), **aux}
    return TrainState(state.step + 1, params, opt_state), metrics

  # The matmul precision holds for the whole traced step, backward too.
  precise = task.compute.precise if task.compute else (lambda fn: fn)
  step_fn = jax.jit(
    precise(train_step),
    donate_argnums=0,
    out_shardings=(state_shard, mesh.replicated()),
  )
  eval_fn = jax.jit(precise(make_eval_loss(task, mesh, parts)))
  probe_fn = task.probe
  return Run(task, mesh, state, step_fn, eval_fn, eval_key, probe_fn)


def source_checkpoints(config) -> str:
  """The checkpoints of `train.init_from_arm` (same study, same seed)."""
  c = config.copy_and_resolve_references()
  c.unlock()
  c.study.arm = config.train.init_from_arm
  return os.path.join(results.run_dir(c), "checkpoints")


def train_and_evaluate(
  config, overrides: dict | None = None, options=None
) -> dict:
  """Runs one arm x seed to completion (resuming if possible).

  Opens the run directory `results.run_dir(config)` as a ledger (lock,
  config fingerprint, config.json and env.json; see `ledger.open_run`, which
  takes `options`), then writes metrics.jsonl, checkpoints/ and, at the end,
  summary.json; returns the summary. A finished run with the same config
  returns its summary without training.

  Raises:
    NonFiniteLoss: the loss became NaN or inf; the last good checkpoint (its
      params had a finite loss) and every metric written so far are kept.
    ledger.RunError: the run directory refuses this run (another writer,
      another config, damaged records); nothing was written.
  """
  with distributed.open_on_primary(
    lambda: ledger.open_run(config, overrides, options),
    results.run_dir(config),
  ) as entry:
    if entry.summary is not None:
      return entry.summary
    return _train(config, entry.path)


def _train(config, workdir: str) -> dict:
  """The loop of `train_and_evaluate`, in an open run directory: restore,
  then one step at a time (train, log, evaluate, probe, checkpoint,
  report), then the summary."""
  loop = _Loop(config, workdir)
  loop.restore()
  try:
    loop.first_evaluation()
    for step in range(loop.start, loop.total):
      loop.step(step)
  finally:
    loop.close()
  faults.point("before_summary", loop.done)
  return loop.summary()


class _Loop:
  """One run's training loop, phase by phase (`_train` says the order).

  Process 0 alone writes results and progress; every process computes.
  """

  def __init__(self, config, workdir: str):
    self.config, self.workdir = config, workdir
    self.say = distributed.primary_only(print)
    self.run = build_run(config)
    self.state = self.run.state
    self.ckpt = checkpoint.Checkpointer(
      os.path.join(workdir, "checkpoints"),
      config.ckpt.every_steps,
      config.ckpt.keep,
    )
    self.tag = ledger.tag(config)
    self.total = config.train.steps
    self.lr_fn = optim.schedule(config.opt, self.total)
    # Whether the chain holds a state lowprec.telemetry reads (it raises
    # on a state without one).
    self.telemetry = optim.has_telemetry(config.lowprec)
    self.probe_key = jax.random.fold_in(self.run.eval_key, 1)
    # A run started from another run's checkpoint continues its data stream.
    t = config.train
    self.data_start = t.init_from_step if t.init_from_arm else 0
    self.metrics_file = distributed.NullWriter()
    self.events = None
    self.start = self.done = 0
    self.last = {}  # the last record written (the restored step's line)
    self.t0 = None  # when the loop started (after the restore)
    self.compiled_at = None  # (time, step) of the end of the first step
    self.steady_from = None  # the same, kept: the rate of the whole run

  # ---- restore ------------------------------------------------------------

  def restore(self) -> None:
    """The latest checkpoint that restores (broken ones set aside), then
    the metrics file opened at that step."""
    self.start, restored, rejected = self.ckpt.restore_latest(
      self.apart(self.state), os.path.join(self.workdir, "bad_checkpoints")
    )
    if self.start:
      self.state = self.together(restored)
    for step, why in rejected:
      self.say(
        f"{self.tag} checkpoint {step} is unreadable ({why}); set aside",
        flush=True,
      )
    if self.start:
      self.say(f"{self.tag} resumed from step {self.start}", flush=True)
    faults.point("after_restore", self.start)
    self.done = self.start
    if distributed.is_primary():
      self.metrics_file = results.MetricsWriter(
        os.path.join(self.workdir, "metrics.jsonl"), resume_step=self.start
      )
      if self.config.log.get("tensorboard", False):
        self.events = tensorboard.EventWriter(self.workdir)
    self.last = self.metrics_file.last or {}
    self.eval_batches = self.run.eval_batches()
    self.t0 = time.time()

  def apart(self, state):
    """`state` with its layers stored apart, as checkpoints and summaries
    hold them whether or not the run stores them stacked
    (`model.layer_storage`). One jitted program, which every process
    runs on the global arrays."""
    return jax.jit(stacked.unstack)(state) if self.run.task.layers else state

  def together(self, state):
    """`apart`'s inverse, on the shardings of the run's state."""
    if not self.run.task.layers:
      return state
    shardings = jax.tree.map(lambda x: x.sharding, self.state)
    stack = functools.partial(stacked.stack, groups=self.run.task.layers)
    return jax.jit(stack, out_shardings=shardings)(state)

  # ---- measurements -------------------------------------------------------

  def write(self, record: dict) -> None:
    self.metrics_file.write(record)
    if self.events is not None:
      self.events.write(record)

  def evaluate(self, params) -> float:
    faults.point("during_eval", self.done)
    run = self.run
    losses = [
      float(run.eval_fn(params, b, run.eval_key)) for b in self.eval_batches
    ]
    return float(np.mean(losses))

  def probe(self, params, step: int) -> dict:
    """The task's probe at every `train.probe_every_steps` and the end."""
    every = self.config.train.probe_every_steps
    if self.run.probe_fn is None or (step % every and step != self.total):
      return {}
    out = self.run.probe_fn(params, jax.random.fold_in(self.probe_key, step))
    return {k: float(v) for k, v in jax.device_get(out).items()}

  def first_evaluation(self) -> None:
    """Step 0's validation loss (and probe) for a run that starts afresh."""
    self.say(f"{self.tag} {tasks.compute_header(self.config)}", flush=True)
    if self.start == 0:
      params = self.state.params
      val = self.evaluate(params)
      self.write({"step": 0, "val_loss": val, **self.probe(params, 0)})
    if self.start < self.total:
      self.say(f"{self.tag} compiling the train step ...", flush=True)

  # ---- one step -----------------------------------------------------------

  def step(self, step: int) -> None:
    """Trains step `step + 1`, then logs, evaluates, probes, checkpoints
    and reports it."""
    record = self.train(step)
    done = self.done
    if done % self.config.train.eval_every_steps == 0 or done == self.total:
      record["val_loss"] = self.evaluate(self.state.params)
    record.update(self.probe(self.state.params, done))
    save = self.ckpt.due(done, force=done == self.total)
    check = self.checkpoint_loss(record) if save else None
    self.write(record)
    faults.point("after_metrics", done)
    if save and not math.isfinite(check):
      raise NonFiniteLoss(
        _non_finite(
          self.tag, check, done, self.ckpt, " of the params it produced"
        )
      )
    self.last = record
    if save:
      self.ckpt.save(done, self.apart(self.state))
    self.report(record)

  def train(self, step: int) -> dict:
    """The optimizer step; its record (lr, metrics, telemetry). Stops on a
    non-finite loss, after writing the record."""
    run = self.run
    batch = run.train_batch(self.data_start + step)
    self.state, m = run.step_fn(self.state, batch)
    record = {"step": step + 1, "lr": float(self.lr_fn(step))}
    record.update({k: float(v) for k, v in jax.device_get(m).items()})
    if self.telemetry:  # a float32 run without trace reports none
      record.update(lowprec.telemetry(self.state.opt_state))
    self.done = step + 1
    if self.compiled_at is None:
      # Rates and ETAs count from the end of the first (compiled) step.
      self.compiled_at = (time.time(), self.done)
      self.steady_from = self.compiled_at
      self.say(
        f"{self.tag} compiled ({self.compiled_at[0] - self.t0:.1f}s to the "
        "first step)",
        flush=True,
      )
    faults.point("after_step", self.done)
    if not math.isfinite(record["loss"]):
      self.write(record)
      raise NonFiniteLoss(
        _non_finite(self.tag, record["loss"], self.done, self.ckpt, "")
      )
    if bad := optim.nonfinite_step(record):
      self.write(record)
      raise NonFiniteLoss(_non_finite_update(self.tag, bad, record, self.ckpt))
    return record

  def checkpoint_loss(self, record: dict) -> float:
    """A checkpoint holds params whose own loss is finite: the val loss of
    this step, else the loss on the next step's batch."""
    if record.get("val_loss") is not None:
      return record["val_loss"]
    run = self.run
    batch = run.train_batch(self.data_start + self.done)
    return float(run.eval_fn(self.state.params, batch, run.eval_key))

  def report(self, record: dict) -> None:
    """A progress line every `log.progress_every_steps` and at the end."""
    done = self.done
    if done % self.config.log.progress_every_steps and done != self.total:
      return
    now = time.time()
    t_last, s_last = self.compiled_at
    rate = (done - s_last) / max(now - t_last, 1e-9) if done > s_last else None
    self.compiled_at = (now, done)
    line = _progress(
      done,
      self.total,
      record["loss"],
      record.get("val_loss"),
      rate,
      now - self.t0,
    )
    self.say(self.tag, line, flush=True)

  # ---- the end ------------------------------------------------------------

  def close(self) -> None:
    self.metrics_file.close()
    if self.events is not None:
      self.events.close()
    self.ckpt.close()

  def summary(self) -> dict:
    """summary.json, written only when the run is whole."""
    params = self.apart(self.state).params
    summary = {
      "status": "finished",
      "steps": self.total,
      "final_loss": self.last.get("loss"),
      "final_val_loss": self.last.get("val_loss"),
      "wall_s": time.time() - self.t0,
      # Steps after the first (compiled) one per second of wall time, with
      # evaluations and checkpoints: for comparing arms run alike.
      "steps_per_s": _steady_rate(self.steady_from, self.done),
      "resumed_from": self.start,
      "param_count": int(sum(np.size(x) for x in jax.tree.leaves(params))),
      "param_digest": params_digest(params),
    }
    _check_complete(summary, self.tag, self.workdir)
    write_json = distributed.primary_only(results.write_json)
    write_json(os.path.join(self.workdir, "summary.json"), summary)
    return summary


def _steady_rate(since, done: int) -> float | None:
  if since is None or done <= since[1]:
    return None
  return (done - since[1]) / max(time.time() - since[0], 1e-9)


def _check_complete(summary: dict, tag: str, workdir: str) -> None:
  """A summary marks a run finished, so it is written only when whole."""
  final = (summary["final_loss"], summary["final_val_loss"])
  if not all(isinstance(x, float) and math.isfinite(x) for x in final):
    raise ledger.RunError(
      f"{tag} the final losses {final} are incomplete, so no summary.json "
      f"was written; check metrics.jsonl in {workdir}, or start the run over "
      "with --restart"
    )


def _non_finite(tag, loss, step, ckpt, what) -> str:
  kept = ckpt.latest_step()
  where = (
    f"The last good checkpoint (step {kept}; its params had a finite loss)"
    if kept
    else "No checkpoint had been saved yet; the metrics so far"
  )
  resume = (
    f"rerun with a lower --config.opt.lr (or --config.opt.clip_norm) and "
    f"--allow_opt_change to continue from step {kept}, or with --restart"
    if kept
    else "rerun with a lower --config.opt.lr and --restart"
  )
  return (
    f"{tag} non-finite loss {loss}{what} at step {step}; stopped. {where} "
    f"and the metrics are kept. To go on, {resume}; or check the data."
  )


def _non_finite_update(tag, count, record, ckpt) -> str:
  """A step whose every proposal was non-finite: the write-back kept the
  weights, so the loss stays finite and would never stop the run."""
  kept = ckpt.latest_step()
  where = (
    f"The metrics so far and the last checkpoint (step {kept}) are kept"
    if kept
    else "The metrics so far are kept (no checkpoint had been saved)"
  )
  return (
    f"{tag} every proposal of step {record['step']} was non-finite ({count} "
    f"NaN or inf at lr {record['lr']:g}), so the write-back kept every "
    f"weight and the run would go on without learning; stopped. {where}. "
    "Check --config.opt.lr (and the gradients: --config.opt.clip_norm), "
    "then rerun with --restart"
  )


def params_digest(params) -> str:
  """A hash of every parameter's bytes: equal digests mean equal bits."""
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    h.update(jax.tree_util.keystr(path).encode())
    h.update(distributed.to_host(x).tobytes())
  return h.hexdigest()

"""The training loop: `train_and_evaluate(config) -> summary`.

One jitted step on a `jax.sharding` mesh (data parallel, optional FSDP of
parameters and optimizer state), donated buffers, metrics as JSON lines as
they happen, progress with steps/s and ETA, orbax checkpoints with resume,
and a clear stop on a non-finite loss that keeps the last good checkpoint.

Determinism: the global batch is split into `train.virtual_shards` equal
parts whose gradients are computed side by side and summed in a fixed order,
so the result does not depend on how many devices hold the parts (bit for
bit, 1 vs 8 devices, when each device holds at least two parts). Random bits
for rounding are keyed by (seed, step, part), and data by (seed, step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lowprec
from experiments import checkpoint, optim, results, tasks


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
  devices = np.array(jax.devices())
  fsdp = config.train.fsdp
  if fsdp < 1 or len(devices) % fsdp:
    raise ValueError(
      f"train.fsdp={fsdp} must divide the device count {len(devices)}"
    )
  mesh = jax.sharding.Mesh(devices.reshape(-1, fsdp), ("data", "fsdp"))
  return Mesh(mesh, NamedSharding(mesh, P(("data", "fsdp"))))


def param_sharding(mesh: Mesh, tree, fsdp: int):
  """FSDP: shard each array's largest dimension divisible by `fsdp`."""

  def leaf(x):
    if fsdp == 1 or not getattr(x, "ndim", 0):
      return mesh.replicated()
    dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
    for d in dims:
      if x.shape[d] % fsdp == 0:
        spec = [None] * x.ndim
        spec[d] = "fsdp"
        return NamedSharding(mesh.mesh, P(*spec))
    return mesh.replicated()

  return jax.tree.map(leaf, tree)


def _shard_batch(batch, parts: int):
  """[B, ...] -> [parts, B/parts, ...] for every array of the batch."""

  def split(x):
    if x.shape[0] % parts:
      raise ValueError(
        f"global batch {x.shape[0]} is not divisible by "
        f"train.virtual_shards={parts}; change one of them"
      )
    return x.reshape(parts, x.shape[0] // parts, *x.shape[1:])

  return jax.tree.map(split, batch)


def _fixed_order_sum(tree):
  """Sums the leading axis left to right, whatever the device layout."""

  def total(x):
    acc = x[0]
    for i in range(1, x.shape[0]):
      acc = acc + x[i]
    return acc

  return jax.tree.map(total, tree)


def make_loss_and_grad(task, parts: int):
  """Mean loss and gradient over the global batch, deterministically."""

  def per_part(params, batch, key, i):
    return jax.value_and_grad(task.loss, has_aux=True)(
      params, batch, jax.random.fold_in(key, i)
    )

  def loss_and_grad(params, batch, key):
    if parts == 0:
      return per_part(params, batch, key, 0)
    split = _shard_batch(batch, parts)
    (loss, aux), grads = jax.vmap(per_part, in_axes=(None, 0, None, 0))(
      params, split, key, jnp.arange(parts)
    )
    total = _fixed_order_sum((loss, aux, grads))
    return jax.tree.map(lambda x: x / parts, total[:2]), jax.tree.map(
      lambda g: g / parts, total[2]
    )

  return loss_and_grad


def make_eval_loss(task, parts: int):
  def per_part(params, batch, key, i):
    return task.loss(params, batch, jax.random.fold_in(key, i))[0]

  def eval_loss(params, batch, key):
    if parts == 0:
      return per_part(params, batch, key, 0)
    split = _shard_batch(batch, parts)
    losses = jax.vmap(per_part, in_axes=(None, 0, None, 0))(
      params, split, key, jnp.arange(parts)
    )
    return _fixed_order_sum(losses) / parts

  return eval_loss


def _progress(step, total, loss, val, rate, elapsed):
  eta = (total - step) / rate if rate > 0 else float("nan")
  val_s = f" val {val:.4f}" if val is not None else ""
  return (
    f"step {step}/{total} loss {loss:.4f}{val_s} | {rate:.2f} steps/s | "
    f"elapsed {elapsed:.0f}s ETA {eta:.0f}s"
  )


def train_and_evaluate(config, overrides: dict | None = None) -> dict:
  """Runs one arm x seed to completion (resuming if possible).

  Writes config.json, env.json, metrics.jsonl, checkpoints/ and, at the end,
  summary.json under `results.run_dir(config)`; returns the summary.

  Raises:
    NonFiniteLoss: the loss became NaN or inf; the last good checkpoint and
      every metric written so far are kept.
  """
  workdir = results.run_dir(config)
  os.makedirs(workdir, exist_ok=True)
  results.write_json(os.path.join(workdir, "config.json"), config.to_dict())
  results.write_json(
    os.path.join(workdir, "env.json"), results.environment(overrides or {})
  )
  task = tasks.build(config)
  mesh = make_mesh(config)
  parts = config.train.virtual_shards
  n_dev = mesh.mesh.size
  if parts and parts % n_dev:
    raise ValueError(
      f"train.virtual_shards={parts} must be a multiple of the device count "
      f"{n_dev} (set it to {n_dev * max(1, parts // n_dev)} or more)"
    )

  seed = config.train.seed
  root = jax.random.key(seed)
  init_key, opt_key, step_key, eval_key = jax.random.split(root, 4)
  tx = optim.build(config, opt_key)

  def init_state():
    params = task.init(init_key)
    return TrainState(jnp.int32(0), params, tx.init(params))

  abstract = jax.eval_shape(init_state)
  p_shard = param_sharding(mesh, abstract.params, config.train.fsdp)
  o_shard = jax.tree.map(
    lambda x: (
      param_sharding(mesh, x, config.train.fsdp)
      if hasattr(x, "shape")
      else None
    ),
    abstract.opt_state,
  )
  state_shard = TrainState(mesh.replicated(), p_shard, o_shard)
  state = jax.jit(init_state, out_shardings=state_shard)()

  loss_and_grad = make_loss_and_grad(task, parts)

  def train_step(state, batch):
    key = jax.random.fold_in(step_key, state.step)
    (loss, aux), grads = loss_and_grad(state.params, batch, key)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = lowprec.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}
    return TrainState(state.step + 1, params, opt_state), metrics

  step_fn = jax.jit(
    train_step, donate_argnums=0, out_shardings=(state_shard, mesh.replicated())
  )
  eval_fn = jax.jit(make_eval_loss(task, parts))

  ckpt = checkpoint.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    config.ckpt.every_steps,
    config.ckpt.keep,
  )
  start = ckpt.latest_step() or 0
  if start:
    state = ckpt.restore(start, state)
    print(
      f"[{config.study.name}/{config.study.arm}/seed{seed}] resumed from "
      f"step {start}",
      flush=True,
    )
  metrics_file = results.MetricsWriter(
    os.path.join(workdir, "metrics.jsonl"), resume_step=start
  )
  lr_fn = optim.schedule(config.opt, config.train.steps)

  def put(batch):
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(mesh.batch, x), batch
    )

  eval_batches = [put(b) for b in task.data.eval_batches()]

  def evaluate(params):
    losses = [float(eval_fn(params, b, eval_key)) for b in eval_batches]
    return float(np.mean(losses))

  total = config.train.steps
  t0, t_last, s_last = time.time(), time.time(), start
  last = {}
  tag = f"[{config.study.name}/{config.study.arm or 'default'}/seed{seed}]"
  try:
    if start == 0:
      val = evaluate(state.params)
      metrics_file.write({"step": 0, "val_loss": val})
    for step in range(start, total):
      batch = put(task.data.batch(step))
      state, m = step_fn(state, batch)
      record = {"step": step + 1, "lr": float(lr_fn(step))}
      record.update({k: float(v) for k, v in jax.device_get(m).items()})
      record.update(lowprec.telemetry(state.opt_state))
      done = step + 1
      if not math.isfinite(record["loss"]):
        metrics_file.write(record)
        raise NonFiniteLoss(
          f"{tag} non-finite loss {record['loss']} at step {done}; stopped. "
          f"The last good checkpoint (step {ckpt.latest_step()}) and the "
          f"metrics so far are kept in {workdir}. Lower opt.lr, enable "
          "opt.clip_norm, or check the data."
        )
      if done % config.train.eval_every_steps == 0 or done == total:
        record["val_loss"] = evaluate(state.params)
      metrics_file.write(record)
      last = record
      ckpt.maybe_save(done, state, force=done == total)
      if done % config.log.progress_every_steps == 0 or done == total:
        now = time.time()
        rate = (done - s_last) / max(now - t_last, 1e-9)
        t_last, s_last = now, done
        print(
          tag,
          _progress(
            done, total, record["loss"], record.get("val_loss"), rate, now - t0
          ),
          flush=True,
        )
  finally:
    metrics_file.close()
    ckpt.close()

  summary = {
    "status": "finished",
    "steps": total,
    "final_loss": last.get("loss"),
    "final_val_loss": last.get("val_loss"),
    "wall_s": time.time() - t0,
    "resumed_from": start,
    "param_count": int(sum(np.size(x) for x in jax.tree.leaves(state.params))),
    "param_digest": params_digest(state.params),
  }
  results.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary


def params_digest(params) -> str:
  """A hash of every parameter's bytes: equal digests mean equal bits."""
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.asarray(jax.device_get(x)).tobytes())
  return h.hexdigest()

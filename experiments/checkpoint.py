"""Orbax checkpoints of the whole training state, with typed PRNG keys.

Orbax stores arrays; typed PRNG keys (inside write-back states) are saved as
their raw uint32 data and re-wrapped on restore, and empty arrays (which
orbax refuses) are stood in for by a scalar and restored from the template.
Saves are finalised by orbax with an atomic rename, so a run killed mid-save
resumes from the previous complete checkpoint; a checkpoint that is there but
cannot be read (emptied, truncated, edited) is set aside and the newest
readable one is used (`restore_latest`). Each checkpoint's metadata holds
the recipes of the stored states in it (`lowprec.record`: how optimizer
state is stored, which a checkpoint's arrays do not say); a checkpoint
whose recipes differ from the run's is refused, naming both, before
anything is restored. A save that fails (no space, no
permission) raises `CheckpointWriteError` and the manager's threads are
stopped, so the process exits instead of hanging. `restore_params` reads
only the parameters of another run's checkpoint (to start a run from it).
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from experiments import distributed, faults
from lowprec.engine import record

RECIPES = "lowprec_recipes"  # the checkpoint metadata key of the records


class CheckpointWriteError(OSError):
  """A checkpoint could not be written; earlier ones are untouched."""


class CheckpointReadError(RuntimeError):
  """Checkpoints exist but none restores into the run's training state."""


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key
  )


def _empty(x) -> bool:
  return hasattr(x, "size") and x.size == 0


def _scalar_sharding(x):
  """Replicated over `x`'s mesh: a stand-in scalar must be a global array
  on several processes (orbax refuses host-local ones)."""
  s = getattr(x, "sharding", None)
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
  return None


def _unwrap(tree):
  """Keys as raw data; empty arrays (which orbax refuses) as a scalar."""

  def leaf(x):
    if _is_key(x):
      return jax.random.key_data(x)
    if _empty(x):
      return jnp.zeros((), x.dtype, device=_scalar_sharding(x))
    return x

  return jax.tree.map(leaf, tree)


def _abstract(tree):
  def leaf(x):
    if _is_key(x):
      x = jax.random.key_data(x)
    if _empty(x):
      return jax.ShapeDtypeStruct((), x.dtype, sharding=_scalar_sharding(x))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

  return jax.tree.map(leaf, tree)


class Checkpointer:
  """Saves every `every_steps` steps and at the end; keeps the last `keep`."""

  def __init__(self, directory: str, every_steps: int, keep: int):
    self.every_steps = every_steps
    self.directory = os.path.abspath(directory)
    self._keep = keep
    self._open()

  def _open(self) -> None:
    try:
      self._mngr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
          max_to_keep=self._keep,
          create=True,
          # On several processes orbax finalises an async save only when
          # the next one starts, so a kill in between would lose it.
          enable_async_checkpointing=jax.process_count() == 1,
        ),
      )
    except OSError as e:
      raise CheckpointWriteError(
        f"cannot create the checkpoint directory {self.directory}: {e}"
      ) from None

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether `step` is saved: every `every_steps`, or forced (the end)."""
    if not force and (self.every_steps <= 0 or step % self.every_steps):
      return False
    return self._mngr.latest_step() != step

  def save(self, step: int, state) -> None:
    """Starts saving `state` as `step` (orbax finishes it in the background).

    Raises:
      CheckpointWriteError: this save, or the previous one still in flight,
        failed.
    """
    recipes = {p: r.to_json() for p, r in record.recipes_of(state).items()}
    try:
      self._mngr.save(
        step,
        args=ocp.args.StandardSave(_unwrap(state)),
        custom_metadata={RECIPES: recipes},
      )
      faults.point("checkpoint_started", step)
      faults.point("after_checkpoint", step, prepare=self.wait)
    except CheckpointWriteError:
      raise
    except Exception as e:  # orbax reports write failures as many types
      raise _write_error(self.directory, step, e) from None

  def maybe_save(self, step: int, state, *, force: bool = False) -> bool:
    if not self.due(step, force=force):
      return False
    self.save(step, state)
    return True

  def restore(self, step: int, like):
    """Restores `step` into the structure, dtypes and shardings of `like`."""
    raw = self._mngr.restore(
      step, args=ocp.args.StandardRestore(_abstract(like))
    )

    def rewrap(template, value):
      if _empty(template):
        return template
      if _is_key(template):
        return jax.random.wrap_key_data(
          value, impl=jax.random.key_impl(template)
        )
      return value

    return jax.tree.map(rewrap, like, raw)

  def restore_latest(self, like, aside: str):
    """The newest checkpoint that restores, falling back past broken ones.

    Checkpoints newer than the one restored that fail to restore are moved
    into `aside` (kept for inspection, out of orbax's way). When none
    restores, nothing is moved and the error names every step tried.

    Returns:
      (step, state, [(rejected step, reason), ...]); (0, like, []) when
      there are no checkpoints.

    Raises:
      CheckpointReadError: checkpoints exist but none restores into `like`,
        or the newest holds optimizer state stored under other recipes.
    """
    if distributed.is_primary():
      self._drop_unfinished()
    distributed.barrier("checkpoint: unfinished saves removed")
    failed = []
    for step in sorted(self._mngr.all_steps(), reverse=True):
      self._check_recipes(step, like)
      try:
        state, why = self.restore(step, like), None
      except Exception as e:  # orbax raises many types for a broken save
        state, why = None, f"{type(e).__name__}: {str(e)[:200]}"
      # Every process reads its own shards; a step counts as restored only
      # where it restored on all of them, so all resume from the same step.
      if not distributed.all_processes(why is None):
        why = why or "it failed to restore on another process"
        failed.append((step, _diagnosis(self.directory, step) + why))
        self._mngr.close()  # a failed restore leaves the manager confused
        self._open()
        continue
      if failed:
        self._set_aside([s for s, _ in failed], aside)
      return step, state, failed
    if failed:
      tried = "; ".join(f"step {s}: {why}" for s, why in failed)
      raise CheckpointReadError(
        f"no checkpoint in {self.directory} restores into this run's "
        f"training state ({tried}). If the config changed the optimizer's "
        "structure (e.g. opt.name, or opt.clip_norm to or from 0), keep it "
        "as it was; else start the run over with --restart"
      )
    return 0, like, []

  def _check_recipes(self, step: int, like) -> None:
    """Raises CheckpointReadError where checkpoint `step` recorded its
    stored states under other recipes than `like` holds. A checkpoint
    without records (written before they were) or with unreadable
    metadata is left to the restore."""
    try:
      saved = self._mngr.metadata(step).custom_metadata.get(RECIPES)
      saved = {p: record.Recipe.from_json(r) for p, r in saved.items()}
    except Exception:  # no metadata, or not ours: nothing to compare
      return
    have = record.recipes_of(like)
    for path in dict.fromkeys([*saved, *have]):
      old, new = saved.get(path), have.get(path)
      if old is None or new is None:
        kind = (old or new).kind
        why = f"{kind} state in {'this run' if old is None else 'it'} only"
      else:
        why = record.mismatch(old, new, "this run")
      if why is not None:
        raise CheckpointReadError(
          f"checkpoint {step} in {self.directory} holds optimizer state "
          f"stored under another recipe than this run's: at {path!r}, "
          f"{why}. Stored codes mean other values under another recipe, "
          "so it is not restored. Keep the config's state storage "
          "(lowprec.state, lowprec.correction_bits, lowprec.group_recipes "
          "and the recipes they name) as the checkpoint was written, or "
          "start the run over with --restart"
        )

  def _drop_unfinished(self) -> None:
    """Removes the temporary directories of saves that never finished.

    The run directory has one writer (its lock), so such a directory was
    left by a process that died mid-save; orbax would remove it too, with
    an alarming warning, at the next save of that step.
    """
    if not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if ".orbax-checkpoint-tmp" in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def _set_aside(self, steps, aside: str) -> None:
    """Process 0 moves `steps` into `aside`; every process then reopens."""
    self._mngr.close()
    if distributed.is_primary():
      os.makedirs(aside, exist_ok=True)
      stamp = time.strftime("%Y%m%d-%H%M%S")
      for step in steps:
        src = os.path.join(self.directory, str(step))
        if os.path.exists(src):
          shutil.move(src, os.path.join(aside, f"{step}-{stamp}"))
    distributed.barrier("checkpoint: broken steps set aside")
    self._open()

  def wait(self) -> None:
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # a background write failed
      raise _write_error(self.directory, None, e) from None

  def close(self) -> None:
    """Waits for saves in flight, then stops orbax's threads (always)."""
    try:
      self.wait()
    finally:
      try:
        self._mngr.close()
      except Exception:  # already reported by wait()
        pass


def _diagnosis(directory: str, step: int) -> str:
  path = os.path.join(directory, str(step))
  if os.path.isdir(path) and not os.listdir(path):
    return "an empty directory; "
  if not os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
    return "no _CHECKPOINT_METADATA; "
  return ""


def _write_error(directory: str, step, e: Exception) -> CheckpointWriteError:
  when = f" (noticed when saving step {step})" if step else ""
  return CheckpointWriteError(
    f"writing a checkpoint in {directory} failed{when}: {type(e).__name__}: "
    f"{str(e)[:300]}. Earlier checkpoints and the metrics are kept; free "
    "space (or fix permissions) and rerun the same command to resume"
  )


def restore_params(directory: str, step: int, like):
  """The parameters saved at `step` in a run's `checkpoints/` directory.

  Only `params` is read (the saved optimizer state may have another
  structure), into the structure, dtypes and shardings of `like`.

  Raises:
    FileNotFoundError: no checkpoint at `step` (the message lists the saved
      steps).
  """
  path = os.path.abspath(directory)
  steps = []
  if os.path.isdir(path):
    mngr = ocp.CheckpointManager(path)
    steps = list(mngr.all_steps())
  if step not in steps:
    raise FileNotFoundError(
      f"no checkpoint at step {step} in {path} (saved steps: "
      f"{sorted(steps) or 'none'}); run the source arm first, with "
      "ckpt.every_steps dividing the step and ckpt.keep large enough"
    )
  item = {"params": _abstract(like)}
  raw = mngr.restore(
    step,
    args=ocp.args.PyTreeRestore(
      item=item,
      restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      partial_restore=True,
    ),
  )
  mngr.close()
  return raw["params"]

"""Orbax checkpoints of the whole training state, with typed PRNG keys.

Orbax stores arrays; typed PRNG keys (inside write-back states) are saved as
their raw uint32 data and re-wrapped on restore, and empty arrays (which
orbax refuses) are stood in for by a scalar and restored from the template.
Saves are finalised by orbax with an atomic rename, so a run killed mid-save
resumes from the previous complete checkpoint. `restore_params` reads only the
parameters of another run's checkpoint (to start a run from it).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key
  )


def _empty(x) -> bool:
  return hasattr(x, "size") and x.size == 0


def _unwrap(tree):
  """Keys as raw data; empty arrays (which orbax refuses) as a scalar."""

  def leaf(x):
    if _is_key(x):
      return jax.random.key_data(x)
    if _empty(x):
      return jnp.zeros((), x.dtype)
    return x

  return jax.tree.map(leaf, tree)


def _abstract(tree):
  def leaf(x):
    if _is_key(x):
      x = jax.random.key_data(x)
    if _empty(x):
      return jax.ShapeDtypeStruct((), x.dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

  return jax.tree.map(leaf, tree)


class Checkpointer:
  """Saves every `every_steps` steps and at the end; keeps the last `keep`."""

  def __init__(self, directory: str, every_steps: int, keep: int):
    self.every_steps = every_steps
    self._mngr = ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def maybe_save(self, step: int, state, *, force: bool = False) -> bool:
    if not force and (self.every_steps <= 0 or step % self.every_steps):
      return False
    if self._mngr.latest_step() == step:
      return False
    self._mngr.save(step, args=ocp.args.StandardSave(_unwrap(state)))
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

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()


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

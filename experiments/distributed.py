"""Multi-process runs on JAX's distributed runtime (one process per host).

A run on N processes is the same program as on one: every process builds
only its rows of each global batch (`process_rows`), the global array is
assembled from the pieces (`jax.make_array_from_process_local_data`), and
process 0 alone writes result files and progress lines (`primary_only`).
Collectives go over the accelerator's interconnect, or over TCP with gloo on
CPU (selected here, so N processes run on one machine for tests).

A process that dies is noticed two ways, both bounded by the heartbeat
timeout `T` (`--heartbeat_timeout_seconds`, default `HEARTBEAT_TIMEOUT_S`):

* its peers' next collective fails at once; `exit_on_lost_process` then asks
  JAX's coordination service which processes are still alive (it answers
  once the dead one has missed its heartbeats, within `T`), prints
  `lost process(es) [k]` and exits with `LOST_PROCESS_EXIT`;
* a process that is not in a collective is terminated by the coordination
  service itself (SIGABRT, exit status 134) within `T`; if process 0 (which
  hosts the service) dies, the others abort at once with "Failed to send RPC
  to coordination service".

So every surviving process exits non-zero within `T + SLACK_S` of a death.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import traceback
import types
from collections.abc import Callable

import jax
import numpy as np

HEARTBEAT_TIMEOUT_S = 60
# Time to print, flush and exit after the coordination service has answered.
SLACK_S = 15
LOST_PROCESS_EXIT = 75  # os.EX_TEMPFAIL: rerun (it resumes) once all are up


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  auto: bool = False,
  heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_S,
) -> bool:
  """Starts `jax.distributed` when asked to; returns whether it did.

  Args:
    coordinator_address: `HOST:PORT` of process 0's coordination service.
    num_processes: how many processes the run has.
    process_id: this process's index, in [0, num_processes).
    auto: with none of the three given, let JAX detect them (SLURM, Open
      MPI, TPU slices, Kubernetes).
    heartbeat_timeout_seconds: a process silent this long counts as dead.

  Raises:
    ValueError: some but not all of the three are given, or they disagree.
  """
  given = (coordinator_address, num_processes, process_id)
  if all(v is None for v in given) and not auto:
    return False
  if any(v is None for v in given) and not all(v is None for v in given):
    raise ValueError(
      "--coordinator_address, --num_processes and --process_id go together "
      "(e.g. --coordinator_address=10.0.0.1:1234 --num_processes=2 "
      "--process_id=0 on the first host); or give none of them with "
      "--multihost to let JAX detect the cluster"
    )
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(
      f"--process_id={process_id} must be in [0, --num_processes="
      f"{num_processes})"
    )
  # Only the CPU client reads this: CPU processes talk over TCP (gloo).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address,
    num_processes,
    process_id,
    heartbeat_timeout_seconds=heartbeat_timeout_seconds,
    shutdown_timeout_seconds=heartbeat_timeout_seconds,
  )
  return True


def is_primary() -> bool:
  """Whether this is process 0, the one that writes results."""
  return jax.process_index() == 0


def primary_only(fn: Callable) -> Callable:
  """`fn` on process 0; a no-op returning None on the others."""

  def call(*args, **kwargs):
    return fn(*args, **kwargs) if is_primary() else None

  return call


class NullWriter:
  """Stands in for a metrics writer on processes other than 0."""

  last = None

  def write(self, record: dict) -> None:
    del record

  def close(self) -> None:
    pass


def all_processes(ok: bool) -> bool:
  """Whether `ok` holds on every process (a collective: all call it)."""
  if jax.process_count() == 1:
    return bool(ok)
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.int32(bool(ok)))
  return bool(np.all(np.asarray(flags)))


def barrier(name: str) -> None:
  """Waits until every process reaches `name` (no-op on one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


_GO, _FINISHED, _REFUSED = 0, 1, 2


def _share(verdict: int | None) -> int:
  """Process 0's verdict, on every process (a collective: all call it)."""
  from jax.experimental import multihost_utils

  value = np.int32(-1 if verdict is None else verdict)
  return int(multihost_utils.broadcast_one_to_all(value))


@contextlib.contextmanager
def open_on_primary(open_run: Callable, path: str):
  """Process 0 opens the run directory; the others follow its verdict.

  `open_run()` (lock, config check, records) runs on process 0 alone and
  returns an entry with `.path` and `.summary` (None: train). The other
  processes get the same path and summary, or an error when process 0
  refused the run, so no process trains alone.
  """
  if jax.process_count() == 1:
    with open_run() as entry:
      yield entry
    return
  if is_primary():
    try:
      entry = open_run()
    except BaseException:
      _share(_REFUSED)
      raise
    _share(_GO if entry.summary is None else _FINISHED)
    with entry:
      yield entry
    return
  verdict = _share(None)
  if verdict == _REFUSED:
    raise RuntimeError(
      f"process 0 refused to open {path} (its error says why and names the "
      "fix); this process stops too"
    )
  summary = None
  if verdict == _FINISHED:
    with open(os.path.join(path, "summary.json")) as f:
      summary = json.load(f)
  yield types.SimpleNamespace(path=path, summary=summary)


def process_rows(sharding: jax.sharding.Sharding, num_rows: int) -> slice:
  """The rows of a `[num_rows, ...]` global batch this process holds.

  Raises:
    ValueError: the batch does not split evenly over the devices, or this
      process's devices hold rows that are not one contiguous block.
  """
  n = len(sharding.device_set)
  if num_rows % n:
    raise ValueError(
      f"the global batch of {num_rows} rows does not split over {n} "
      "devices; make data.batch_size a multiple of the device count"
    )
  spans = set()
  for index in sharding.addressable_devices_indices_map((num_rows,)).values():
    s = index[0]
    spans.add((s.start or 0, num_rows if s.stop is None else s.stop))
  lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
  if sum(b - a for a, b in spans) != hi - lo:
    raise ValueError(
      f"process {jax.process_index()} holds rows {sorted(spans)} of the "
      "batch, not one contiguous block; build the mesh from jax.devices()"
    )
  return slice(lo, hi)


def to_host(x) -> np.ndarray:
  """The whole value of a global array on this host (all processes call)."""
  if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def topology() -> dict:
  """Which devices each process holds, for env.json."""
  by_process: dict[str, list[str]] = {}
  for d in jax.devices():
    by_process.setdefault(str(d.process_index), []).append(str(d))
  return {
    "process_count": jax.process_count(),
    "process_devices": by_process,
    "local_device_count": jax.local_device_count(),
  }


def _live_processes(timeout_s: float) -> list[int] | None:
  """Processes the coordination service counts as alive, or None."""
  from jax._src import distributed as jax_distributed

  client = jax_distributed.global_state.client
  if client is None:
    return None
  out: list[list[int]] = []

  def ask():
    try:
      out.append(
        sorted(client.get_live_nodes(list(range(jax.process_count()))))
      )
    except Exception:  # noqa: BLE001  (the service may be gone too)
      pass

  t = threading.Thread(target=ask, daemon=True)
  t.start()
  t.join(timeout_s)
  return out[0] if out else None


def exit_on_lost_process(fn: Callable, heartbeat_timeout_s: float):
  """Runs `fn()`; on an error in a multi-process run, names lost processes.

  An error that every process raises (a bad config, a non-finite loss) is
  re-raised as it is. If some process is gone, this one prints which and
  exits at once with `LOST_PROCESS_EXIT`, without waiting for the shutdown
  barrier that a dead process would never reach.
  """
  try:
    return fn()
  except Exception:
    if jax.process_count() == 1:
      raise
    live = _live_processes(heartbeat_timeout_s + SLACK_S / 2)
    everyone = list(range(jax.process_count()))
    if live == everyone:
      raise
    lost = "unknown" if live is None else sorted(set(everyone) - set(live))
    traceback.print_exc()
    print(
      f"process {jax.process_index()}: lost process(es) {lost} of "
      f"{len(everyone)} (no heartbeat for {heartbeat_timeout_s:.0f} s); "
      "exiting. Rerun every process with the same command: the run resumes "
      "from its last checkpoint.",
      file=sys.stderr,
      flush=True,
    )
    sys.stdout.flush()
    os._exit(LOST_PROCESS_EXIT)

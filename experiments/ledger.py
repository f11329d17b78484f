"""A run directory is a ledger: one writer, a fingerprint, atomic records.

`open_run(config)` is how a run starts writing into `results.run_dir`:

1. it takes `RunLock` on the directory (an OS lock, `fcntl.flock`, released
   when the process ends however it ends); a second process for the same run
   stops at once with `RunLocked`, naming the holder;
2. it compares the resolved config with the `config.json` already there:
   any difference in a key that can change results is refused with
   `ConfigChanged` (the differing keys, old -> new, and the fixes) before
   anything is written, for finished and unfinished runs alike. Keys that
   cannot change results (`NON_RESULT_KEYS`) may differ. Two explicit ways
   past the check: `restart` (delete the run's files and start it over) and
   `allow_opt_change` (continue an unfinished run from its checkpoint with
   changed `opt.*` keys, e.g. a lower `opt.lr` after a non-finite loss; the
   change is recorded in `env.json`);
3. only then writes `config.json` and `env.json`, atomically
   (`write_json_atomic`: temp file, fsync, rename).

A finished run (a readable `summary.json` and the same fingerprint) comes
back with its summary, to be skipped. What the files are and how they are
written is `results`'s; this module decides whether a run may write them.

Example:
  ```python
  with ledger.open_run(config) as entry:
    if entry.summary is None:
      ...  # train, writing under entry.path
  ```
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import shutil
import socket

from experiments import faults, results

# Keys that cannot change a run's results: where results go, how often
# progress is printed, how often and how many checkpoints are kept (a resume
# is bit-exact from any of them), and the study's other arms and seeds.
NON_RESULT_KEYS = (
  "log.results_dir",
  "log.progress_every_steps",
  "log.tensorboard",
  "ckpt.every_steps",
  "ckpt.keep",
  "study.arms",
  "study.seeds",
  "study.analysis",  # how the results are tabulated and drawn
  "study.figure",
)
AMENDABLE = "opt."  # keys `allow_opt_change` lets an unfinished run change
LOCK_FILE = ".lock"
RECORDS = ("config.json", "env.json", "metrics.jsonl", "summary.json")

write_json_atomic = results.write_json  # temp file, fsync, then rename


class RunError(Exception):
  """A run cannot go on as asked; the message names the fix (exit code 2)."""


class RunLocked(RunError):
  """Another live process holds the run directory's lock."""


class ConfigChanged(RunError):
  """The resolved config differs from the run directory's config.json."""


@dataclasses.dataclass(frozen=True)
class Options:
  """How `open_run` treats an existing run directory.

  Attributes:
    restart: delete the run's files (under its lock) and start it over.
    allow_opt_change: let an unfinished run continue from its checkpoint
      with changed `opt.*` keys (recorded in env.json).
  """

  restart: bool = False
  allow_opt_change: bool = False


def tag(config) -> str:
  c = config
  return f"[{c.study.name}/{c.study.arm or 'default'}/seed{c.train.seed}]"


class RunLock:
  """An exclusive `fcntl.flock` on `<run_dir>/.lock`, held while open.

  The lock belongs to the open file, so the kernel drops it when the process
  exits or is killed; the file stays (deleting it would race). The holder
  writes its pid and host into the file, for the message a second process
  gets.

  Example:
    ```python
    with RunLock("results/smoke/rn_bf16/seed0"):
      ...  # the only writer of that directory
    ```
  """

  def __init__(self, run_dir: str):
    self.path = os.path.join(run_dir, LOCK_FILE)
    self._fd = None

  def acquire(self) -> RunLock:
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.read(fd, 512).decode(errors="replace").strip()
      os.close(fd)
      raise RunLocked(
        f"{os.path.dirname(self.path)} is being written by another process "
        f"({holder or 'pid unknown'}); one writer per run. Wait for it to "
        "finish (or stop it), then rerun to resume; or write elsewhere with "
        "--config.log.results_dir"
      ) from None
    now = datetime.datetime.now(datetime.UTC).isoformat()
    os.ftruncate(fd, 0)
    holder = f"pid {os.getpid()} on {socket.gethostname()} since {now}\n"
    os.write(fd, holder.encode())
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> RunLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def flatten(tree, prefix: str = "") -> dict:
  """A nested dict as {"a.b": value}, values JSON-normalised (tuples as
  lists), so a config compares equal to its config.json."""
  out = {}
  for k, v in tree.items():
    key = prefix + str(k)
    if isinstance(v, dict):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


def _normal(config_dict: dict) -> dict:
  return json.loads(json.dumps(results._plain(config_dict), sort_keys=True))


def _counts(key: str) -> bool:
  return not any(key == k or key.startswith(k + ".") for k in NON_RESULT_KEYS)


def config_diff(old: dict, new: dict) -> dict:
  """{dotted key: (old, new)} for the keys that can change results.

  Keys that only one side has come from another version of the code (a
  key added with a default that keeps the old behaviour, or one removed);
  they are listed by `version_keys`, not here.
  """
  a, b = flatten(_normal(old)), flatten(_normal(new))
  return {
    k: (a[k], b[k])
    for k in sorted(set(a) & set(b))
    if _counts(k) and a[k] != b[k]
  }


def version_keys(old: dict, new: dict) -> list[str]:
  """Keys in only one of two configs (added or removed by a code change)."""
  a, b = flatten(_normal(old)), flatten(_normal(new))
  return sorted(k for k in set(a) ^ set(b) if _counts(k))


@dataclasses.dataclass
class Entry:
  """An open run directory: `path`, its lock, and what was found there.

  `summary` is the finished run's summary (skip it) or None (run it);
  `changed` the `opt.*` keys allowed to differ (old, new) on this launch.
  When the run stops before training because its checkpoints or metrics
  cannot be used, leaving the `with` block puts the earlier config.json and
  env.json back, so a refused run leaves the directory as it was.
  """

  path: str
  lock: RunLock
  summary: dict | None = None
  changed: dict = dataclasses.field(default_factory=dict)
  previous: dict = dataclasses.field(default_factory=dict)  # name -> JSON

  def close(self) -> None:
    self.lock.release()

  def __enter__(self) -> Entry:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if exc is not None and self.previous:
        from experiments import checkpoint

        refused = (checkpoint.CheckpointReadError, results.MetricsError)
        if isinstance(exc, refused):
          for name, obj in self.previous.items():
            write_json_atomic(os.path.join(self.path, name), obj)
    finally:
      self.close()


def _has_results(path: str) -> bool:
  names = set(os.listdir(path))
  ckpts = os.path.join(path, "checkpoints")
  return bool(names & {"metrics.jsonl", "summary.json"}) or (
    os.path.isdir(ckpts) and bool(os.listdir(ckpts))
  )


def _clear(path: str) -> int:
  """Deletes everything in the run directory but the lock; returns a count."""
  n = 0
  for name in os.listdir(path):
    if name == LOCK_FILE:
      continue
    full = os.path.join(path, name)
    if os.path.isdir(full) and not os.path.islink(full):
      shutil.rmtree(full)
    else:
      os.remove(full)
    n += 1
  return n


def _finished_summary(path: str) -> tuple[dict | None, str]:
  """(summary, "") of a finished run; (None, why) when it is unreadable,
  (None, "") when absent. An unfinished run completes its summary from its
  final checkpoint."""
  file = os.path.join(path, "summary.json")
  if not os.path.exists(file):
    return None, ""
  try:
    summary = results.read_json(file)
  except ValueError as e:
    return None, str(e)
  if not isinstance(summary, dict) or summary.get("status") != "finished":
    return None, f"{file} does not record a finished run"
  return summary, ""


def _set_aside_summary(path: str, why: str, label: str) -> None:
  file = os.path.join(path, "summary.json")
  aside = file + ".unreadable"
  os.replace(file, aside)
  print(f"{label} {why}; kept as {aside}, rebuilding the summary", flush=True)


def _refusal(path, label, diff, finished, can_amend) -> str:
  lines = [
    f"{label} {path} holds a {'finished' if finished else 'started'} run "
    "with another config; refused, nothing was written. Keys that differ "
    "(old -> new):"
  ]
  for k, (a, b) in diff.items():
    lines.append(f"  {k}: {json.dumps(a)} -> {json.dumps(b)}")
  lines.append("To run the new config, either")
  lines.append("  - put it elsewhere: --config.log.results_dir=OTHER_DIR, or")
  lines.append(
    "  - start this run over, deleting its files: --restart, or"
    if can_amend
    else "  - start this run over, deleting its files: --restart"
  )
  if can_amend:
    lines.append(
      "  - continue it from its last checkpoint with the new opt.* values "
      "(e.g. a lower opt.lr after a non-finite loss): --allow_opt_change"
    )
  lines.append(
    "Keys that may differ without a refusal: " + ", ".join(NON_RESULT_KEYS)
  )
  return "\n".join(lines)


def open_run(config, overrides: dict | None = None, options=None) -> Entry:
  """Locks the run directory, checks the fingerprint, writes the records.

  Args:
    config: the resolved config of one run.
    overrides: command-line overrides, recorded in env.json.
    options: `Options` (default: neither restart nor opt changes).

  Returns:
    An `Entry` holding the lock (use it as a context manager).

  Raises:
    RunLocked: another process writes this run.
    ConfigChanged: the config differs from the run's config.json.
    RunError: the directory has results but no readable config.json.
  """
  options = options or Options()
  label = tag(config)
  path = results.run_dir(config)
  if not path:
    raise RunError("log.results_dir is empty; set a directory")
  os.makedirs(path, exist_ok=True)
  lock = RunLock(path).acquire()
  try:
    entry = _check(config, path, label, lock, options)
    _write_records(config, entry, overrides or {})
  except BaseException:
    lock.release()
    raise
  faults.point("after_config")
  return entry


def _remove_stale_temps(path: str) -> None:
  """Temp files of atomic writes cut by a kill (only the lock holder writes
  here, so none is in use)."""
  for name in os.listdir(path):
    if name.startswith(".") and name.endswith(".tmp"):
      os.remove(os.path.join(path, name))


def _check(config, path, label, lock, options) -> Entry:
  _remove_stale_temps(path)
  if options.restart:
    n = _clear(path)
    if n:
      print(f"{label} --restart: deleted {n} entries of {path}", flush=True)
  new = config.to_dict()
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    if _has_results(path):
      raise RunError(
        f"{label} {path} holds results but no config.json, so they cannot "
        "be checked against this config; nothing was written. Restore "
        "config.json, or start this run over with --restart (deletes its "
        "files), or write elsewhere with --config.log.results_dir"
      )
    return Entry(path, lock)
  try:
    old = results.read_json(file)
  except ValueError as e:
    if not _has_results(path):
      return Entry(path, lock)  # nothing ran: config.json is written anew
    raise RunError(
      f"{label} {e}. The run's results cannot be checked against this "
      "config; nothing was written. Restore config.json, or start this run "
      "over with --restart (deletes its files), or write elsewhere with "
      "--config.log.results_dir"
    ) from None
  summary, bad_summary = _finished_summary(path)
  diff = config_diff(old, new)
  added = version_keys(old, new)
  if added:
    print(
      f"{label} keys only one of the configs has (another code version), "
      f"taken as not changing results: {', '.join(added)}",
      flush=True,
    )
  if diff and not _has_results(path):
    return Entry(path, lock)  # only config.json and env.json: nothing ran
  if diff:
    can_amend = summary is None and all(k.startswith(AMENDABLE) for k in diff)
    if not (can_amend and options.allow_opt_change):
      raise ConfigChanged(
        _refusal(path, label, diff, summary is not None, can_amend)
      )
    print(
      f"{label} continuing with changed "
      + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()),
      flush=True,
    )
  elif summary is not None:
    print(f"{label} finished already ({path}); skipped", flush=True)
  if bad_summary:
    _set_aside_summary(path, bad_summary, label)
  return Entry(path, lock, summary=summary, changed=diff)


def _write_records(config, entry: Entry, overrides: dict) -> None:
  if entry.summary is not None:
    return  # a finished run is read, not written
  env = results.environment(overrides)
  env_file = os.path.join(entry.path, "env.json")
  previous = []
  if os.path.exists(env_file):
    try:
      old = results.read_json(env_file)
      entry.previous["env.json"] = dict(old)
      previous = old.pop("previous_launches", []) + [old]
    except ValueError as e:
      print(f"{tag(config)} {e}; its launch history is not carried over")
  try:
    entry.previous["config.json"] = results.read_json(
      os.path.join(entry.path, "config.json")
    )
  except (OSError, ValueError):
    pass  # a new run, or a directory without results
  env["previous_launches"] = previous
  env["changed_keys"] = {k: list(v) for k, v in entry.changed.items()}
  write_json_atomic(os.path.join(entry.path, "config.json"), config.to_dict())
  write_json_atomic(env_file, env)

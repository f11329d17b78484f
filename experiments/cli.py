"""The entry point's flags for existing runs, its help, and its errors.

`--help` (or `-h`) prints the usage, the studies and the flags, and exits
with status 0, with or without `--config`. A mistake on the command line (no
`--config`, a bad `:arg`, an unknown or badly typed `--config.` key) and a
run refused or stopped for a reason the user can fix print one message and
exit with status 2 (1 for a stop during training: non-finite loss, a failed
write), without a traceback; `--traceback` shows it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import time

from absl import flags

USAGE_EXIT = 2  # the user can fix it: config, refused run, damaged records
STOP_EXIT = 1  # training stopped: non-finite loss, a failed write

_RESTART = flags.DEFINE_bool(
  "restart",
  False,
  "Delete the selected runs' files (config, metrics, checkpoints, summary) "
  "and start them over; needed to rerun a run dir with another config.",
)
_ALLOW_OPT_CHANGE = flags.DEFINE_bool(
  "allow_opt_change",
  False,
  "Continue an unfinished run from its last checkpoint with changed opt.* "
  "keys (e.g. a lower opt.lr after a non-finite loss); recorded in env.json.",
)
_TRACEBACK = flags.DEFINE_bool(
  "traceback", False, "Show the Python traceback of an error."
)


def options():
  """The `ledger.Options` the flags ask for."""
  from experiments import ledger

  return ledger.Options(
    restart=_RESTART.value, allow_opt_change=_ALLOW_OPT_CHANGE.value
  )


def _exit(code: int) -> None:
  """Exits; if a library thread would block the exit, waits briefly, then
  ends the process (the error is reported and every record is flushed)."""
  sys.stdout.flush()
  sys.stderr.flush()
  others = [
    t
    for t in threading.enumerate()
    if t is not threading.main_thread() and not t.daemon
  ]
  deadline = time.monotonic() + 10
  for t in others:
    try:
      t.join(timeout=max(0.0, deadline - time.monotonic()))
    except Exception:  # orbax's threads raise from join() when late
      pass
  if any(t.is_alive() for t in others):
    os._exit(code)  # a failed save's thread would block the exit for good
  sys.exit(code)


def fail(message: str, code: int = USAGE_EXIT) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  _exit(code)


def _config_first(argv) -> tuple[list, str | None]:
  """argv with `--config` moved before the `--config.` overrides (which
  config_flags requires), and its value (None when missing)."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return [argv[0], arg, *argv[1:i], *argv[i + 1 :]], arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      rest = [*argv[1:i], *argv[i + 2 :]]
      return [argv[0], arg, argv[i + 1], *rest], argv[i + 1]
  return list(argv), None


def _load(spec: str):
  """The config that `--config PATH[:ARG]` names (as config_flags loads it)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    here = os.path.dirname(path) or "."
    found = (
      sorted(
        f for f in os.listdir(here) if f.endswith(".py") and f != "__init__.py"
      )
      if os.path.isdir(here)
      else []
    )
    fail(
      f"--config {path}: no such file."
      + (f" {here} holds: {', '.join(found)}" if found else "")
    )
  module_spec = importlib.util.spec_from_file_location("_study_config", path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()
  except ValueError as e:
    fail(f"--config {spec}: {e}")


def _check_key(config, key: str) -> None:
  """An unknown `--config.` key: the valid keys of its section and the
  closest one."""
  node, seen = config, []
  for part in key.split("."):
    keys = list(node.keys()) if hasattr(node, "keys") else []
    if part not in keys:
      where = ".".join(seen) or "the config"
      from lowprec.grids.choices import (
        suggest,  # jax starts after the XLA flags
      )

      close = [".".join([*seen, k]) for k in keys]
      hint = suggest(".".join([*seen, part]), close)
      fail(
        f"--config.{key}: {where} has no key {part!r}.{hint} Valid keys of "
        f"{where}: {', '.join(sorted(keys)) or '(none: it is a value)'}"
      )
    node = node[part]
    seen.append(part)


HELP = ("-h", "-?", "--help", "--helpshort", "--helpfull")


def _studies() -> str:
  """The studies, one a line: name and what it reproduces."""
  from experiments.analysis import studies

  found = studies.summaries()
  width = max(map(len, found))
  return "\n".join(f"  {n:<{width}}  {s}" for n, s in found.items())


def help_text(doc: str, full: bool = False) -> str:
  """The usage (`doc`), the studies in configs/, and the flags."""
  if full:
    listed = flags.FLAGS.get_help()
  else:  # the runner's flags and these, without their modules' names
    modules = (sys.modules["__main__"], sys.modules[__name__])
    listed = "\n".join(
      flags.FLAGS.module_help(m).strip().split("\n", 1)[-1] for m in modules
    )
  return (
    f"{doc.strip()}\n\nStudies (--config configs/<study>.py):\n"
    f"{_studies()}\n\nFlags:\n{listed}\n"
  )


def parse_flags(argv):
  """absl's flag parsing, with config mistakes as one message (exit 2);
  `--help` prints the help and exits 0."""
  asked = [a for a in argv[1:] if a in HELP]
  if asked:
    doc = sys.modules["__main__"].__doc__ or ""
    print(help_text(doc, full="--helpfull" in asked), end="", flush=True)
    sys.exit(0)
  show = "--traceback" in argv
  given = [a for a in argv if a == "--config" or a.startswith("--config=")]
  if len(given) > 1:
    fail(f"--config is given {len(given)} times; give one study config")
  argv, spec = _config_first(argv)
  if argv[1:] and sys.argv[1:] and sys.argv[0] == argv[0]:
    sys.argv[:] = argv  # config_flags reads the overrides from sys.argv
  if spec is None:
    fail(
      "missing --config: name a study config, e.g. `python -m "
      "experiments.run --config configs/smoke.py`; --help lists the studies"
    )
  if not show:
    config = _load(spec)
    for arg in argv:
      if arg.startswith("--config.") and "=" in arg:
        _check_key(config, arg[len("--config.") :].split("=", 1)[0])
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # absl's flags.Error, or one from the config file
    if show:
      raise
    text = str(e).strip().splitlines()
    fail(text[-1] if text else type(e).__name__)


class _NoLibraryTracebacks(logging.Filter):
  """Keeps the one-line message of orbax's logged errors, not their
  tracebacks, and drops asyncio's "exception was never retrieved" echoes of
  them: a failed background write is reported by the runner itself
  (`--traceback` keeps everything)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if not record.exc_info:
      return True
    if record.name == "asyncio" or "never retrieved" in str(record.msg):
      return False
    if f"{os.sep}orbax{os.sep}" in record.pathname:
      record.exc_info = None
      record.exc_text = None
    return True


def _quiet(hook, exc_of):
  """`hook`, silent for the "Event loop is closed" errors that orbax's I/O
  callbacks raise after a failed save has shut its event loop down."""

  def quiet(*args):
    exc = exc_of(args)
    if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
      return
    hook(*args)

  return quiet


def guard(fn):
  """Runs `fn()`; errors the user can act on become one message and an exit
  status (unless --traceback)."""
  from experiments import checkpoint, ledger, results, study, train

  usage = (
    study.ConfigError,
    ledger.RunError,
    results.MetricsError,
    checkpoint.CheckpointReadError,
  )
  stops = (train.NonFiniteLoss, checkpoint.CheckpointWriteError)
  if _TRACEBACK.value:
    return fn()
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_NoLibraryTracebacks())
  sys.excepthook = _quiet(sys.excepthook, lambda a: a[1])
  sys.unraisablehook = _quiet(sys.unraisablehook, lambda a: a[0].exc_value)
  try:
    return fn()
  except usage as e:
    fail(str(e), USAGE_EXIT)
  except stops as e:
    fail(str(e), STOP_EXIT)
  except (ValueError, FileNotFoundError) as e:
    fail(f"{e}\n(--traceback shows where it was raised)", STOP_EXIT)

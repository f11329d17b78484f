r"""Entry point: `python -m experiments.run --config configs/<study>.py`.

--config configs/x.py                    every arm x seed, in turn
--config configs/x.py:arm=rn_bf16,seed=1 one run (for job arrays)
--config configs/x.py:scale=full         the full-scale variant
--config.opt.lr=3e-4                     override any field (typos are
                                         rejected with a suggestion)
--restart                                start the selected runs over (a run
                                         dir refuses another config)
--allow_opt_change                       continue an unfinished run with
                                         changed opt.* keys (a lower opt.lr)
--traceback                              show the traceback of an error
--help                                   this text, the studies and the flags
--coordinator_address=HOST:PORT --num_processes=N --process_id=I
                                         one of N processes (jax.distributed;
                                         gloo collectives on CPU)
--multihost                              the same, detected by JAX (SLURM,
                                         Open MPI, TPU slices, Kubernetes)
--heartbeat_timeout_seconds=60           a process silent this long counts as
                                         lost: the others exit non-zero
See docs/scaling.md.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import (
  cli,
  xla_flags,  # noqa: F401  (before jax starts)
)

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Study config file.", lock_config=True
)
_MULTIHOST = flags.DEFINE_bool(
  "multihost",
  False,
  "Initialise jax.distributed with the cluster JAX detects (one process per "
  "host).",
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "HOST:PORT of process 0 (jax.distributed)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "Number of processes (jax.distributed)."
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "This process's index in [0, num_processes)."
)
_HEARTBEAT = flags.DEFINE_integer(
  "heartbeat_timeout_seconds",
  60,  # experiments.distributed.HEARTBEAT_TIMEOUT_S
  "A process silent this long counts as lost; the others then exit "
  "non-zero within this time plus a few seconds.",
)


def cli_overrides(argv) -> dict:
  """`--config.a.b=v` arguments as {"a.b": "v"}."""
  out = {}
  for arg in argv:
    if arg.startswith("--config.") and "=" in arg:
      key, value = arg[len("--config.") :].split("=", 1)
      out[key] = value
  return out


def main(argv):
  del argv
  from experiments import distributed, study

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  distributed.initialize(
    _COORDINATOR.value,
    _NUM_PROCESSES.value,
    _PROCESS_ID.value,
    auto=_MULTIHOST.value,
    heartbeat_timeout_seconds=_HEARTBEAT.value,
  )
  overrides = cli_overrides(sys.argv)
  distributed.exit_on_lost_process(
    lambda: study.run_study(
      _CONFIG.value,
      cli_keys=overrides,
      overrides=overrides,
      options=cli.options(),
    ),
    _HEARTBEAT.value,
  )


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(
    lambda argv: cli.guard(lambda: main(argv)), flags_parser=cli.parse_flags
  )

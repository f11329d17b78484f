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
--multihost                              call jax.distributed.initialize()
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
  "multihost", False, "Initialise jax.distributed (one process per host)."
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
  import jax

  from experiments import study

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if _MULTIHOST.value:
    jax.distributed.initialize()
  overrides = cli_overrides(sys.argv)
  study.run_study(
    _CONFIG.value,
    cli_keys=overrides,
    overrides=overrides,
    options=cli.options(),
  )


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(
    lambda argv: cli.guard(lambda: main(argv)), flags_parser=cli.parse_flags
  )

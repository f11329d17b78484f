"""Fault injection for the reliability tests: a kill at a named moment.

`LOWPREC_FAULT=<moment>[:<arg>]` makes the process SIGKILL itself when it
reaches `point(moment, arg)` (any arg when none is given), e.g.
`LOWPREC_FAULT=after_metrics:4`. Unset, `point` does nothing. The moments
are listed in `MOMENTS`; docs/reliability.md says where each one is.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "LOWPREC_FAULT"
MOMENTS = (
  "after_config",  # config.json and env.json written, nothing trained
  "after_restore",  # a checkpoint restored, metrics not yet trimmed
  "during_metrics_trim",  # the trimmed metrics written to a temp file
  "after_step",  # a step computed, its metrics line not yet written
  "during_eval",  # inside the evaluation of the step's params
  "after_metrics",  # the step's metrics line written, no checkpoint yet
  "checkpoint_started",  # a checkpoint save started, still in flight
  "after_checkpoint",  # a checkpoint save finished
  "before_summary",  # the last checkpoint saved, no summary.json yet
  "during_write",  # a JSON record written to its temp file, not renamed
)


def point(moment: str, arg=None, prepare=None) -> None:
  """Kills the process here if `LOWPREC_FAULT` names this moment (and arg).

  `prepare` (optional) runs first, e.g. to wait for a save to finish.
  """
  spec = os.environ.get(ENV)
  if not spec:
    return
  name, _, want = spec.partition(":")
  if name != moment or (want and want != str(arg)):
    return
  if prepare is not None:
    prepare()
  sys.stdout.flush()
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)

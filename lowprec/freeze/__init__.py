"""Predicting the write-back freeze from a float32 run, and auditing it.

* `reference_trace`: an optax transform, last in a float32 chain, that
  records online the predicted erased fraction `p_t` for target formats.
* `crossing`, `compare`, `summarize`: crossing steps and comparisons of
  predicted against measured curves, per cell and over many cells.
* `common_time_share`, `directional_specificity`: across seeds, how much of
  the measured curves is their common time course, and whether per-seed
  predictions point where each seed departs from it.
* `audit_coordinates`: exact erasure events at sampled coordinates of a
  low-precision run next to the predicted ones.
* `decay_erasure`: an optax pass-through after AdamW that counts the
  erased proposals that are weight decay only, per tensor.
* `stuck`: the share of coordinates of a checkpoint still at their initial
  value, per group of tensors (norm gains, embeddings, ...).
* `compensated_trace`: an optax transform, beside `reference_trace`, that
  predicts what a compensated write-back (Kahan, two-component) would do:
  erased, carried and lost proposals, and the coordinates it moves late
  rather than never.
* `progress_trace`, `lost_cost`, `forward_cost`: what a grid costs in
  nats, measured on a float32 run's final weights: without the proposals
  its nearest rounding would have erased (summed by `progress_trace`),
  and with a group of weights on the grid (nearest, and stochastic with
  its standard error).
* `advise`: from one float32 run carrying every trace, the cheapest
  recipe per tensor group whose predicted risks stay under thresholds.
* `state_erasure`, `state_trace`, `state_at_init`: from float32 optimizer
  states, the share of state updates that `lowprec.store_state` would
  erase (one step; every step of a run, as an optax wrapper), and the
  coordinates whose stored state would never leave its initial value.

Definitions (erased, erased fraction, frozen, crossing step, categories)
follow the write-back freezing paper (see docs/freeze.md): a nonzero
proposal below half the grid gap at `w` is rounded away by nearest
write-back.

May import: lowprec.grids, lowprec.engine, lowprec.optim.
"""

from lowprec.freeze.advise import Advice, Thresholds, advise
from lowprec.freeze.coords import (
  CoordinateAudit,
  audit_coordinates,
  frozen_from,
  measured_events,
  predicted_events,
)
from lowprec.freeze.curves import (
  CATEGORIES,
  CellComparison,
  Specificity,
  Summary,
  common_time,
  common_time_share,
  compare,
  crossing,
  directional_specificity,
  rmse,
  summarize,
)
from lowprec.freeze.decay import DecayErasureState, decay_erasure
from lowprec.freeze.progress import (
  Cost,
  ProgressCounts,
  ProgressTraceState,
  forward_cost,
  lost_cost,
  progress_trace,
)
from lowprec.freeze.remedies import (
  KINDS,
  CompensatedTraceState,
  Remedy,
  RemedyLayout,
  compensated_trace,
  remedy_name,
)
from lowprec.freeze.state import (
  StateTraceState,
  state_at_init,
  state_erasure,
  state_trace,
)
from lowprec.freeze.stuck import StuckShare, stuck
from lowprec.freeze.trace import (
  ROUNDINGS,
  ReferenceTraceState,
  Target,
  TraceLayout,
  leaf_paths,
  reference_trace,
)

__all__ = [
  "Advice",
  "CATEGORIES",
  "Cost",
  "KINDS",
  "ProgressCounts",
  "ProgressTraceState",
  "ROUNDINGS",
  "CellComparison",
  "CompensatedTraceState",
  "CoordinateAudit",
  "DecayErasureState",
  "ReferenceTraceState",
  "Remedy",
  "RemedyLayout",
  "Specificity",
  "StuckShare",
  "Summary",
  "Target",
  "Thresholds",
  "TraceLayout",
  "advise",
  "audit_coordinates",
  "common_time",
  "common_time_share",
  "compare",
  "compensated_trace",
  "crossing",
  "decay_erasure",
  "directional_specificity",
  "forward_cost",
  "frozen_from",
  "leaf_paths",
  "lost_cost",
  "measured_events",
  "predicted_events",
  "progress_trace",
  "reference_trace",
  "remedy_name",
  "rmse",
  "state_at_init",
  "state_erasure",
  "state_trace",
  "StateTraceState",
  "stuck",
  "summarize",
]

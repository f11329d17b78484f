"""Coordinate-level audit: exact erasure events next to predicted ones.

The sampled coordinates of `reference_trace(..., sample=N, key=k)` give, for
the float32 reference, `(w_t, u_t)` at N fixed coordinates; the same trace
(same `sample` and `key`) placed just before `lowprec.writeback` in the
low-precision run records the realized `(w_t, u_t)` there. Stack the logged
values into `[steps, N]` arrays and audit them here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lowprec.grids import rounding
from lowprec.grids.formats import get_format


def _q(x, fmt) -> np.ndarray:
  return np.asarray(rounding.round_nearest(np.asarray(x, np.float32), fmt))


def _arrays(w, u):
  w = np.asarray(w, np.float32)
  u = np.asarray(u, np.float32)
  if u.ndim != 2 or w.ndim != 2:
    raise ValueError(
      f"expected [steps, coordinates] arrays, got w {w.shape}, u {u.shape}"
    )
  return w, u


def predicted_events(w, u, fmt) -> tuple[np.ndarray, np.ndarray]:
  """Predicted erasures from a float32 reference trajectory.

  `erased[t, i] = u != 0 and Q_RN(Q_RN(w) + u) == Q_RN(w)` at step t and
  coordinate i: the rule `reference_trace` evaluates online.

  Args:
    w: reference weights, `[steps, N]` (a trailing final row is ignored).
    u: reference proposals, `[steps, N]`.
    fmt: the target format.

  Returns:
    `(erased, proposed)` boolean arrays of `u`'s shape.
  """
  fmt = get_format(fmt)
  w, u = _arrays(w, u)
  w = w[: u.shape[0]]
  q = _q(w, fmt)
  proposed = u != 0
  return proposed & (_q(q + u, fmt) == q), proposed


def measured_events(w, u, fmt=None) -> tuple[np.ndarray, np.ndarray]:
  """Exact erasure events of a realized low-precision trajectory.

  With `w` one row longer than `u` (the weights after the last step
  included), the event is read off the trajectory itself, for any rounding:
  `erased[t] = u_t != 0 and w_{t+1} == w_t`. With equal lengths it is
  computed by the nearest write-back rule `Q_RN(w_t + u_t) == w_t`, which
  needs `fmt`.

  Returns:
    `(erased, proposed)` boolean arrays of `u`'s shape.

  Raises:
    ValueError: shapes that fit neither form, or `fmt` missing.
  """
  w, u = _arrays(w, u)
  proposed = u != 0
  if w.shape[0] == u.shape[0] + 1 and w.shape[1:] == u.shape[1:]:
    return proposed & (w[1:] == w[:-1]), proposed
  if w.shape != u.shape:
    raise ValueError(
      f"w {w.shape} must have u's shape {u.shape} or one more step"
    )
  if fmt is None:
    raise ValueError(
      "pass fmt= (nearest write-back), or w with one more step than u"
    )
  return proposed & (_q(w + u, get_format(fmt)) == w), proposed


def frozen_from(erased, proposed) -> np.ndarray:
  """Per coordinate, the step from which every proposal is erased, or -1.

  A coordinate is frozen from step t when its proposals are erased at every
  step from t to the end of the run; steps without a proposal neither start
  nor break a freeze. -1 when its last proposal moves it (or it has none).
  """
  erased = np.asarray(erased, bool)
  proposed = np.asarray(proposed, bool)
  steps, n = erased.shape
  out = np.full(n, -1, np.int64)
  moved = proposed & ~erased
  t_idx = np.arange(steps)[:, None]
  last_move = np.where(moved, t_idx, -1).max(0)
  after = proposed & (t_idx > last_move[None, :])
  has = after.any(0)
  out[has] = np.argmax(after, axis=0)[has]
  return out


@dataclasses.dataclass(frozen=True)
class CoordinateAudit:
  """Predicted vs exact erasure events at sampled coordinates.

  Attributes:
    predicted: `[steps, N]` predicted erasures (from the reference).
    measured: `[steps, N]` exact erasures (from the low-precision run).
    both_proposed: `[steps, N]` where both runs made a nonzero proposal; the
      agreement counts are taken over these entries.
    agreement: share of those entries where the events agree.
    agreement_per_step: `[steps]`, NaN at steps without entries.
    confusion: counts of `both`, `predicted_only`, `measured_only`,
      `neither` erased.
    predicted_frozen_from, measured_frozen_from: `[N]` freeze steps (-1 for
      none), see `frozen_from`.
    diverged_at: `[N]` first step where the low-precision weight differs
      from the reference weight rounded to the grid, -1 if never.
  """

  predicted: np.ndarray
  measured: np.ndarray
  both_proposed: np.ndarray
  agreement: float
  agreement_per_step: np.ndarray
  confusion: dict[str, int]
  predicted_frozen_from: np.ndarray
  measured_frozen_from: np.ndarray
  diverged_at: np.ndarray

  @property
  def freeze_agreement(self) -> float:
    """Share of coordinates whose freeze steps agree exactly."""
    return float(
      np.mean(self.predicted_frozen_from == self.measured_frozen_from)
    )


def audit_coordinates(
  reference_w, reference_u, measured_w, measured_u, fmt
) -> CoordinateAudit:
  """Audits sampled coordinates: exact events next to predicted ones.

  Args:
    reference_w: the float32 reference's sampled weights `w_t`, `[steps, N]`
      (logged as `pred/sample/w`).
    reference_u: its sampled proposals `u_t`, `[steps, N]` (`pred/sample/u`).
    measured_w: the low-precision run's weights at the same coordinates; it
      may carry one more step (see `measured_events`).
    measured_u: the low-precision run's proposals there.
    fmt: the target format (nearest rounding).

  Returns:
    A `CoordinateAudit`.

  Raises:
    ValueError: mismatched shapes.

  Reference: the write-back freezing paper (see docs/freeze.md): the exact
  target-code event is auditable coordinatewise on a realized target
  trajectory.

  Example:
    ```python
    a = audit_coordinates(ref_w, ref_u, lp_w, lp_u, "bfloat16")
    a.agreement, a.measured_frozen_from
    ```
  """
  fmt = get_format(fmt)
  rw, ru = _arrays(reference_w, reference_u)
  mw, mu = _arrays(measured_w, measured_u)
  if ru.shape != mu.shape:
    raise ValueError(
      f"reference u {ru.shape} and measured u {mu.shape} differ in shape"
    )
  pred, p_prop = predicted_events(rw, ru, fmt)
  meas, m_prop = measured_events(mw, mu, fmt)
  both = p_prop & m_prop
  agree = both & (pred == meas)
  per_step = np.full(ru.shape[0], np.nan)
  n_step = both.sum(1)
  per_step[n_step > 0] = agree.sum(1)[n_step > 0] / n_step[n_step > 0]
  steps = ru.shape[0]
  differ = _q(rw[:steps], fmt) != mw[:steps]
  diverged = np.where(differ.any(0), np.argmax(differ, axis=0), -1)
  return CoordinateAudit(
    predicted=pred,
    measured=meas,
    both_proposed=both,
    agreement=float(agree.sum() / both.sum()) if both.any() else float("nan"),
    agreement_per_step=per_step,
    confusion={
      "both": int((both & pred & meas).sum()),
      "predicted_only": int((both & pred & ~meas).sum()),
      "measured_only": int((both & ~pred & meas).sum()),
      "neither": int((both & ~pred & ~meas).sum()),
    },
    predicted_frozen_from=frozen_from(pred, p_prop),
    measured_frozen_from=frozen_from(meas, m_prop),
    diverged_at=diverged,
  )

"""Crossing steps and prediction-vs-measurement comparisons of curves.

Pure numpy functions on erased-fraction curves: the predicted curve `p_t`
logged from `reference_trace`, the measured curve `e_t` logged from
`lowprec.writeback`. A curve is a sequence indexed by step (index 0 is the
first update); NaN marks a step without proposals and is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

CATEGORIES = ("at_init", "post_init", "never")


def _curve(curve) -> np.ndarray:
  c = np.asarray(curve, np.float64)
  if c.ndim != 1:
    raise ValueError(f"a curve is one-dimensional, got shape {c.shape}")
  return c


def crossing(curve, theta: float = 0.5, *, steps=None):
  """The crossing step of a curve and its category.

  The crossing step is the first step `t` with `curve[s] >= theta` for every
  step `s >= t` of the run (steps with NaN, i.e. without proposals, are
  skipped). Category: `at_init` when that is the first step with a value,
  `post_init` when later, `never` when the last value is below `theta`.
  A curve that dips below `theta` and re-crosses crosses at the last rise.

  Args:
    curve: erased fractions, one per step.
    theta: the threshold (default 0.5).
    steps: optional step numbers of the entries (e.g. logged step numbers);
      by default the index.

  Returns:
    `(step, category)`, with `step` None for `never`.

  Raises:
    ValueError: a curve without any value (empty, or NaN at every step: no
      step had a proposal, so it cannot say whether anything froze), an
      infinite entry, or `steps` of another shape.

  Example:
    ```python
    crossing([0.1, 0.6, 0.4, 0.7, 0.9])
    # (3, 'post_init')
    crossing([float("nan"), 0.6, 0.7])  # step 0 had no proposals
    # (1, 'at_init')
    ```
  """
  c = _curve(curve)
  steps = np.arange(c.size) if steps is None else np.asarray(steps)
  if steps.shape != c.shape:
    raise ValueError(f"steps has shape {steps.shape}, curve {c.shape}")
  if np.isinf(c).any():
    raise ValueError(
      f"crossing: the curve has an infinite entry (first at index "
      f"{int(np.flatnonzero(np.isinf(c))[0])}); an erased fraction lies "
      "in [0, 1], or is NaN at a step without proposals"
    )
  idx = np.flatnonzero(~np.isnan(c))
  if not idx.size:
    raise ValueError(
      f"crossing: the curve has no value (all {c.size} entries are NaN "
      "or it is empty): NaN marks a step without proposals, so it cannot "
      "say whether anything froze. Pass the erased_fraction that "
      "lowprec.telemetry logs at every step of a run with nonzero "
      "proposals (a run whose updates all became non-finite has none: its "
      "proposals are counted as nonfinite); leave such runs out"
    )
  below = idx[c[idx] < theta]
  if below.size:
    after = idx[idx > below[-1]]
    if not after.size:
      return None, "never"
    first = after[0]
  else:
    first = idx[0]
  category = "at_init" if first == idx[0] else "post_init"
  return steps[first].item(), category


def rmse(a, b) -> float:
  """Root mean squared difference over steps where both curves have values."""
  a, b = _curve(a), _curve(b)
  if a.shape != b.shape:
    raise ValueError(f"curves differ in length: {a.size} vs {b.size}")
  ok = ~(np.isnan(a) | np.isnan(b))
  if not ok.any():
    return float("nan")
  return float(np.sqrt(np.mean((a[ok] - b[ok]) ** 2)))


@dataclasses.dataclass(frozen=True)
class CellComparison:
  """Predicted vs measured crossing of one cell.

  `error_steps` is `predicted_step - measured_step` when both cross;
  `relative_error` is `|error_steps| / measured_step` and `within_tol`
  whether it is at most the tolerance, both only when both crossings are
  `post_init` (None otherwise). `rmse` is between the two curves.
  """

  predicted_step: int | None
  predicted_category: str
  measured_step: int | None
  measured_category: str
  error_steps: int | None
  relative_error: float | None
  within_tol: bool | None
  category_agrees: bool
  rmse: float


def compare(
  predicted, measured, *, theta: float = 0.5, tol: float = 0.15, steps=None
) -> CellComparison:
  """Compares a predicted curve with a measured one (one cell).

  Args:
    predicted: predicted erased fractions `p_t` (from `reference_trace`).
    measured: measured erased fractions `e_t` of the low-precision run, on
      the same steps.
    theta: crossing threshold.
    tol: relative tolerance on the crossing step (default 15%).
    steps: optional step numbers of the entries.

  Returns:
    A `CellComparison`.

  Raises:
    ValueError: curves of different lengths, or a curve that `crossing`
      refuses (no value at any step, an infinite entry).

  Reference: the write-back freezing paper (see docs/freeze.md); crossing
  step and categories as defined there.

  Example:
    ```python
    c = compare([0.1, 0.2, 0.6, 0.9], [0.1, 0.3, 0.4, 0.8])
    c.predicted_step, c.measured_step, c.error_steps
    # (2, 3, -1)
    ```
  """
  p, m = _curve(predicted), _curve(measured)
  err = rmse(p, m)
  ps, pc = crossing(p, theta, steps=steps)
  ms, mc = crossing(m, theta, steps=steps)
  error = ps - ms if ps is not None and ms is not None else None
  rel = within = None
  if pc == mc == "post_init" and ms != 0:
    rel = abs(error) / abs(ms)
    within = bool(rel <= tol)
  return CellComparison(ps, pc, ms, mc, error, rel, within, pc == mc, err)


@dataclasses.dataclass(frozen=True)
class Summary:
  """Prediction-vs-measurement over many cells.

  Attributes:
    cells: the per-cell comparisons, by name.
    n_post_init: cells where both crossings are `post_init`.
    n_within_tol: of those, cells within the tolerance.
    confusion: 3x3 counts, rows the measured and columns the predicted
      category, in the order of `CATEGORIES`.
    n_category_disagree: cells whose categories differ.
    macro_rmse: mean of the per-cell curve RMSEs.
    baseline_rmse: the same for the naive baseline: each cell's measured
      curve predicted by the mean measured curve of the other cells.
    skill: `1 - macro_rmse / baseline_rmse` (None without a baseline).
  """

  cells: dict[str, CellComparison]
  n_post_init: int
  n_within_tol: int
  confusion: np.ndarray
  n_category_disagree: int
  macro_rmse: float
  baseline_rmse: float
  skill: float | None

  @property
  def within_tol(self) -> str:
    """E.g. `"52/55"`: post-init crossings within the tolerance."""
    return f"{self.n_within_tol}/{self.n_post_init}"

  @property
  def category_disagree(self) -> str:
    """E.g. `"4/72"`: cells whose categories differ."""
    return f"{self.n_category_disagree}/{len(self.cells)}"

  def to_markdown(self) -> str:
    """Per-cell table followed by the totals, as Markdown."""
    lines = [
      "| cell | predicted | measured | error (steps) | relative | RMSE |",
      "|---|---|---|---:|---:|---:|",
    ]
    for name, c in self.cells.items():
      rel = "" if c.relative_error is None else f"{c.relative_error:.1%}"
      err = "" if c.error_steps is None else str(c.error_steps)
      lines.append(
        f"| {name} | {_fmt(c.predicted_step, c.predicted_category)} | "
        f"{_fmt(c.measured_step, c.measured_category)} | {err} | {rel} | "
        f"{c.rmse:.5f} |"
      )
    skill = "n/a" if self.skill is None else f"{self.skill:.3f}"
    lines += [
      "",
      f"within tolerance: {self.within_tol}; category disagreements: "
      f"{self.category_disagree}; macro RMSE {self.macro_rmse:.5f} "
      f"(baseline {self.baseline_rmse:.5f}, skill {skill})",
    ]
    return "\n".join(lines)


def _fmt(step, category) -> str:
  return category if step is None else f"{step} ({category})"


def summarize(
  cells, *, theta: float = 0.5, tol: float = 0.15, steps=None
) -> Summary:
  """Summarizes prediction against measurement over many cells.

  Args:
    cells: `{name: (predicted, measured)}` curves (or a sequence of pairs,
      named by position). Cells may differ in length; the baseline averages
      the other cells' measured values available at each step.
    theta: crossing threshold.
    tol: relative tolerance on post-init crossing steps.
    steps: optional step numbers shared by all cells.

  Returns:
    A `Summary`: counts within tolerance (`summary.within_tol == "52/55"`),
      category confusion, macro RMSE and skill against the leave-one-out
      baseline `1 - RMSE_pred / RMSE_baseline`.

  Raises:
    ValueError: no cells, or a cell whose two curves differ in length.

  Reference: the write-back freezing paper (see docs/freeze.md) reports its
  grid this way (52/55 post-initialization crossings within 15%, 4/72
  categories differing; macro RMSE and skill for the E4M3 audit).

  Example:
    ```python
    s = summarize({"a": (p_a, e_a), "b": (p_b, e_b), "c": (p_c, e_c)})
    s.within_tol, s.macro_rmse, s.skill
    ```
  """
  if not isinstance(cells, Mapping):
    cells = {str(i): pair for i, pair in enumerate(cells)}
  if not cells:
    raise ValueError("summarize needs at least one cell")
  pairs = {k: (_curve(p), _curve(m)) for k, (p, m) in cells.items()}
  comps = {
    k: compare(p, m, theta=theta, tol=tol, steps=steps)
    for k, (p, m) in pairs.items()
  }
  confusion = np.zeros((3, 3), np.int64)
  for c in comps.values():
    confusion[
      CATEGORIES.index(c.measured_category),
      CATEGORIES.index(c.predicted_category),
    ] += 1
  post = [c for c in comps.values() if c.within_tol is not None]
  macro = float(np.nanmean([c.rmse for c in comps.values()]))
  base = _baseline_rmse([m for _, m in pairs.values()])
  skill = None
  if np.isfinite(base) and base > 0:
    skill = 1.0 - macro / base
  return Summary(
    cells=comps,
    n_post_init=len(post),
    n_within_tol=sum(c.within_tol for c in post),
    confusion=confusion,
    n_category_disagree=sum(not c.category_agrees for c in comps.values()),
    macro_rmse=macro,
    baseline_rmse=base,
    skill=skill,
  )


def _baseline_rmse(measured: Sequence[np.ndarray]) -> float:
  if len(measured) < 2:
    return float("nan")
  n = max(m.size for m in measured)
  stack = np.full((len(measured), n), np.nan)
  for i, m in enumerate(measured):
    stack[i, : m.size] = m
  have = ~np.isnan(stack)
  total = np.where(have, stack, 0.0).sum(0)
  count = have.sum(0)
  errs = []
  for i, m in enumerate(measured):
    k = count - have[i]
    with np.errstate(invalid="ignore", divide="ignore"):
      others = (total - np.where(have[i], stack[i], 0.0)) / k
    errs.append(rmse(np.where(k > 0, others, np.nan)[: m.size], m))
  return float(np.nanmean(errs))


def _seed_stack(curves, what: str) -> np.ndarray:
  """[seeds, steps] of equal-length curves."""
  stack = [_curve(c) for c in curves]
  if not stack:
    raise ValueError(f"no {what} curves")
  if len({c.size for c in stack}) != 1:
    raise ValueError(
      f"{what} curves differ in length: {[c.size for c in stack]}"
    )
  return np.stack(stack)


def common_time(measured) -> np.ndarray:
  """The common time course `c(t)`: the mean over seeds of the measured
  curves at each step (NaN where any curve lacks a value)."""
  return _seed_stack(measured, "measured").mean(0)


def common_time_share(measured) -> float:
  """The share of the measured curves' variation that is common time.

  With `e_k(t)` the curve of seed `k` (`n` seeds), `c(t)` their mean at
  step `t` and `m` the grand mean, over the steps where every curve has a
  value:

    share = n * sum_t (c(t) - m)^2 / sum_{k,t} (e_k(t) - m)^2.

  The rest, `sum_{k,t} (e_k(t) - c(t))^2`, is what differs between seeds.

  Returns:
    The share in [0, 1]; NaN when the curves are constant.

  Reference: the write-back freezing paper assigns 99.65% of the E4M3
  audit's variation to common time.

  Example:
    ```python
    common_time_share([[0.0, 2.0], [2.0, 4.0]])
    # 0.5
    ```
  """
  e = _seed_stack(measured, "measured")
  e = e[:, ~np.isnan(e).any(0)]
  if not e.size:
    return float("nan")
  m = e.mean()
  total = float(np.sum((e - m) ** 2))
  if total == 0:
    return float("nan")
  return float(e.shape[0] * np.sum((e.mean(0) - m) ** 2) / total)


@dataclasses.dataclass(frozen=True)
class Specificity:
  """Directional specificity of per-seed predictions.

  Attributes:
    correlations: `corr_t(p_k - c, e_k - c)` per seed, in the order given;
      NaN where a deviation has no variance.
    specific: whether every correlation is above zero.
  """

  correlations: tuple[float, ...]
  specific: bool


def directional_specificity(predicted, measured) -> Specificity:
  """Whether predictions point where each seed departs from common time.

  With `c(t)` the mean measured curve over the seeds (`common_time`), a
  predictor `p_k` of seed `k`'s curve `e_k` is directionally specific when

    corr_t(p_k(t) - c(t), e_k(t) - c(t)) > 0   for every seed k,

  i.e. it predicts, seed by seed, in which direction (and when) the seed's
  curve departs from the shared time course. Steps where any curve lacks a
  value are left out. A single curve reused for every seed cannot pass: the
  deviations `e_k - c` sum to zero over `k`, so their covariances with one
  fixed `p - c` sum to zero and cannot all be positive.

  Args:
    predicted: one predicted curve per seed, or a single curve (one
      trace reused for every seed).
    measured: the measured curves, one per seed (at least two), all of
      the same length.

  Returns:
    A `Specificity`.

  Raises:
    ValueError: fewer than two seeds, curves of different lengths, or a
      number of predicted curves that is neither one nor the seeds'.

  Reference: the write-back freezing paper's E4M3 audit "fails
  directional specificity"; this is the test as defined for this project.

  Example:
    ```python
    e = [[0.5, 0.7, 0.9], [0.5, 0.5, 0.7]]  # c = [0.5, 0.6, 0.8]
    s = directional_specificity([[0.5, 0.65, 0.85], [0.5, 0.55, 0.75]], e)
    s.specific, [round(r, 3) for r in s.correlations]
    # (True, [1.0, 1.0])
    directional_specificity([0.5, 0.65, 0.85], e).specific  # one trace
    # False
    ```
  """
  e = _seed_stack(measured, "measured")
  if e.shape[0] < 2:
    raise ValueError("directional specificity needs at least two seeds")
  p = np.asarray(predicted, np.float64)
  p = _seed_stack([p] if p.ndim == 1 else p, "predicted")
  if p.shape[0] == 1:
    p = np.repeat(p, e.shape[0], 0)
  if p.shape != e.shape:
    raise ValueError(
      f"{p.shape[0]} predicted curves of {p.shape[1]} steps for "
      f"{e.shape[0]} measured of {e.shape[1]}; give one per seed or one"
    )
  ok = ~(np.isnan(e).any(0) | np.isnan(p).any(0))
  e, p = e[:, ok], p[:, ok]
  c = e.mean(0)
  corrs = tuple(_corr(pk - c, ek - c) for pk, ek in zip(p, e, strict=True))
  return Specificity(corrs, all(r > 0 for r in corrs))


def _corr(a: np.ndarray, b: np.ndarray) -> float:
  a, b = a - a.mean(), b - b.mean()
  den = float(np.sqrt(np.sum(a * a) * np.sum(b * b)))
  return float(np.sum(a * b) / den) if den > 0 else float("nan")

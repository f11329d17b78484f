"""Parameters that never left their initial value, per group of tensors.

Users of bf16 training report norm gains that stay exactly 1.0 and other
parameters that never move. `stuck` checks a checkpoint for that: for a
pair of parameter pytrees (at init and now) it counts, per group of
tensors, the coordinates whose value is still the initial one.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from lowprec.engine import weights
from lowprec.grids.rounding import round_nearest


@dataclasses.dataclass(frozen=True)
class StuckShare:
  """Coordinates of a group still at their initial value.

  Attributes:
    coordinates: finite coordinates counted in the group.
    stuck: those equal to their initial value (after rounding both to the
      group's grid, where a format is given).
    nonfinite: coordinates whose current value is NaN or infinite (not
      counted above).
  """

  coordinates: int
  stuck: int
  nonfinite: int

  @property
  def share(self) -> float:
    """stuck / coordinates (NaN for an empty group)."""
    return self.stuck / self.coordinates if self.coordinates else float("nan")


def stuck(initial, current, groups=None, fmt=None) -> dict[str, StuckShare]:
  """The share of coordinates still at their initial value, per group.

  A coordinate is stuck when `current == initial` exactly; with `fmt`,
  when `Q(current) == Q(initial)` for `Q` nearest rounding onto its grid,
  which asks of a float32 checkpoint whether the coordinate moved by as
  much as the grid resolves. Weights that moved away and came back count
  as stuck: compare checkpoints at several steps to tell them apart.

  Args:
    initial: a pytree of arrays, the params at init.
    current: a pytree of the same structure, the params now.
    groups: ordered rules `[(regex, group name or None), ...]` matched with
      `re.fullmatch` against "/"-joined parameter paths (first match wins;
      None leaves a tensor out; a path matching no rule is an error), or
      None for one group per tensor.
    fmt: None (compare stored values), or a format specification as
      `lowprec.to_grid` takes it.

  Returns:
    `{group: StuckShare}` in order of first appearance, plus `"all"` over
      every counted tensor.

  Raises:
    ValueError: trees of different structure or shapes, a path no group
      rule matches, or a bad format specification.

  Example:
    ```python
    groups = [(r".*norm.*", "norm gains"), (r".*", "other")]
    report = lowprec.freeze.stuck(params0, params, groups)
    report["norm gains"].share  # 1.0: no gain ever left its init value
    ```
  """
  flat0, tree0 = jax.tree_util.tree_flatten_with_path(initial)
  flat1, tree1 = jax.tree_util.tree_flatten_with_path(current)
  if tree0 != tree1:
    raise ValueError(
      "initial and current params have different tree structures: "
      f"{tree0} vs {tree1}"
    )
  group_of = _grouping(groups)
  lookup = weights.format_lookup(fmt) if fmt is not None else None
  counts: dict[str, list[int]] = {}
  for (path, a), (_, b) in zip(flat0, flat1, strict=True):
    name = weights.path_name(path)
    group = group_of(name)
    if group is None:
      continue
    a32, b32 = _f32(a), _f32(b)
    if a32.shape != b32.shape:
      raise ValueError(
        f"parameter {name!r} has shape {a32.shape} at init and {b32.shape} now"
      )
    finite = np.isfinite(b32)
    f = lookup(path) if lookup is not None else None
    if f is not None:
      a32 = np.asarray(round_nearest(a32, f))
      b32 = np.asarray(round_nearest(b32, f))
    same = (a32 == b32) & finite
    n = counts.setdefault(group, [0, 0, 0])
    n[0] += int(finite.sum())
    n[1] += int(same.sum())
    n[2] += int((~finite).sum())
  out = {g: StuckShare(*n) for g, n in counts.items()}
  out["all"] = StuckShare(
    *(sum(n[i] for n in counts.values()) for i in range(3))
  )
  return out


def _f32(x) -> np.ndarray:
  return np.asarray(jax.device_get(x)).astype(np.float32)


def _grouping(groups):
  if groups is None:
    return lambda name: name
  return weights.rule_lookup(
    groups,
    lambda group: group,
    what="group rule",
    fix="e.g. a last catch-all (r'.*', 'other')",
  )

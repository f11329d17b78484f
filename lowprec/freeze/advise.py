"""Which recipe for each group of weights, from one float32 run.

A float32 run whose chain carries the traces (`reference_trace` for each
grid, nearest and stochastic; `compensated_trace` for the Kahan buffers;
`state_trace` for the moment stores) predicts, at every step, what each
recipe of `lowprec.recipes` would do to each parameter. `advise` adds
those predictions up per tensor group (`lowprec.groups`) over the second
half of the run, where the steps are smallest against the grids, and
picks per group the cheapest weight recipe and the cheapest state store
whose predicted risks stay under `Thresholds`:

* erased: the share of proposals nearest rounding onto the grid leaves
  where they were (the grid's property, shown for every recipe on it);
* lost: the share of proposals whose whole contribution a recipe drops:
  nearest write-back loses what it erases; a Kahan buffer loses a
  residual it rounds to zero (`compensated_trace`'s `lost`); stochastic
  rounding and the remainder lose nothing in expectation;
* move: the mean probability that a stochastic write-back moves a weight
  (`|u| / gap` below one gap): the noise of stochastic rounding is a jump
  of a whole gap where the optimizer asked for a `move` share of it;
* stalled: for a moment store, the expected share of the moment's
  updates the stored value does not take at that step.

Given the costs measured on the run's last weights (`forward_cost`, and
`lost_cost` of a `progress_trace`), each recipe also gets a predicted
cost in nats with its standard error, and the weights are chosen by it:
the fewest bytes whose summed prediction, plus two standard errors, stays
under a margin (0.01 nats); the shares above then only explain.

Recipes no trace of the run predicts (ECO and the split write-back, whose
errors live in the optimizer's moment or a correction code; a grid
without a trace) are listed as unpredicted and never recommended.

    advice = lowprec.freeze.advise(records, params)
    print(advice.table())
    advice.choice            # {"embeddings": "bf16_sr+q8", ...}
    print(advice.optax_code("optax.adamw(1e-3)"))

`records` are the float32 run's per-step `lowprec.telemetry` dicts, in
step order (the `metrics.jsonl` lines of `experiments.run`), checked as
`lowprec.freeze.records` says; the window must hold `MIN_WINDOW_STEPS`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lowprec.freeze import records as records_lib
from lowprec.freeze.remedies import remedy_name
from lowprec.optim import groups as groups_lib
from lowprec.optim import recipes

# The fewest steps the window must hold. The advice compares means over
# the window with thresholds whose time scale is 10 steps: `Thresholds.move`
# asks a stochastic write-back to move at least once per 10 steps, the
# first moment's time constant 1 / (1 - b1) at b1 = 0.9. Over fewer steps a
# share measures a few steps' fluctuation rather than the regime a recipe
# would train in, and a write-back moving at that rate may not move at all.
MIN_WINDOW_STEPS = 10
_SHOWN = 4  # tensors a note names before "and N more"


@dataclasses.dataclass(frozen=True)
class Thresholds:
  """The risks a recommended recipe must stay under (see docs/advise.md).

  Attributes:
    lost: largest predicted share of proposals a recipe may drop whole
      (0.01: nearest write-back on this project's GPTs costs loss from
      lost shares of 0.2 on; 1% is far below, and a buffer that drops 1%
      still keeps 99% of what nearest rounding drops).
    move: smallest mean probability that a stochastic write-back (or a
      stochastic moment store) moves a value at a step (0.1: its jumps are
      then at most ten times the step asked for, and happen at least once
      per 10 steps, the first moment's time constant at b1 = 0.9, inside
      which Adam's own updates already average).
    erased: largest share of proposals that nearest rounding may erase
      on the grid of a deterministic compensation (Kahan, split, ECO):
      where nearly every late proposal is below half a gap, the weight
      moves only when the compensation has piled up half a gap, and the
      model computes with a value that lags the float32 one by up to half
      a gap (0.99; added after the frontier study measured norm gains on
      e4m3 with a Kahan buffer at +0.027 nats, erased 1.000 predicted).
  """

  lost: float = 0.01
  move: float = 0.1
  erased: float = 0.99


def _grid_names(w: recipes.Weights) -> tuple[str, str]:
  """The reference trace's target names of `w`'s grid: nearest, stochastic."""
  return w.fmt, f"{w.fmt}_sr"


@dataclasses.dataclass(frozen=True)
class Row:
  """One group x weight recipe: predicted fractions (None: no trace)."""

  group: str
  recipe: str
  bytes: float
  erased: float | None
  move: float | None
  lost: float | None
  safe: bool
  why: str
  # Predicted loss cost in nats (None: not predicted), its standard
  # error, and its parts ("lost 0.135 + forward 0.002").
  nats: float | None = None
  nats_se: float | None = None
  parts: str = ""


@dataclasses.dataclass(frozen=True)
class StateRow:
  """One group x moment store: predicted stalled shares of mu and nu."""

  group: str
  state: str
  bytes: float
  mu: float | None
  nu: float | None
  safe: bool
  why: str


@dataclasses.dataclass
class Advice:
  """What `advise` predicts and recommends.

  Attributes:
    sizes: parameters per group.
    rows: every group x weight recipe (`Row`).
    state_rows: every group x moment store (`StateRow`).
    choice: per group, the recommended `"weights+state"` recipe name
      (`lowprec.recipes.get` reads it).
    groups: the group regexes used, `(name, regex)`.
    thresholds: the `Thresholds` applied.
    steps: the first and last step the predictions were added over.
    budget: the bytes-per-parameter budget asked for, or None.
    notes: what the advice could not do (unpredicted recipes, a budget
      that forces a risk).
  """

  sizes: dict[str, int]
  rows: list[Row]
  state_rows: list[StateRow]
  choice: dict[str, str]
  groups: tuple[tuple[str, str], ...]
  thresholds: Thresholds
  steps: tuple[int, int]
  budget: float | None = None
  notes: list[str] = dataclasses.field(default_factory=list)
  window_steps: int = 0  # records in the window
  # The nats margin the weights were chosen under (None: by the shares).
  margin: float | None = None

  @property
  def predicted_nats(self) -> tuple[float, float] | None:
    """The choice's predicted loss cost over all groups, in nats, and its
    standard error; None where the choice was made by the shares."""
    if self.margin is None:
      return None
    mean = var = 0.0
    for g, c in self.choice.items():
      w = c.partition("+")[0]
      row = next(r for r in self.rows if r.group == g and r.recipe == w)
      mean += row.nats or 0.0
      var += (row.nats_se or 0.0) ** 2
    return mean, math.sqrt(var)

  @property
  def bytes_per_param(self) -> float:
    """Weights, write-back state and moments of the choice, per parameter."""
    total = sum(self.sizes.values())
    return (
      sum(
        recipes.bytes_per_param(self.choice[g]) * n
        for g, n in self.sizes.items()
      )
      / total
    )

  def table(self) -> str:
    """Markdown: per group, each recipe's bytes and predicted fractions,
    the chosen one in bold; then the moment stores; then the choice."""
    th = self.thresholds
    lines = [
      f"Predicted from steps {self.steps[0]}-{self.steps[1]} of the float32 "
      f"run ({self.window_steps} steps; the advice needs at least "
      f"{MIN_WINDOW_STEPS}); thresholds: lost <= {th.lost}, move >= "
      f"{th.move}, erased <= {th.erased} under a deterministic compensation.",
      "",
      "| group | params | weights | bytes | erased (nearest) | move (SR) "
      "| lost | safe | nats (+- se) | from |",
      "|---|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in self.rows:
      chosen = self.choice[r.group].partition("+")[0] == r.recipe
      name = f"**{r.recipe}**" if chosen else r.recipe
      nats = "-" if r.nats is None else f"{r.nats:+.4f} +- {r.nats_se:.4f}"
      lines.append(
        f"| {r.group} | {self.sizes[r.group]} | {name} | {r.bytes:g} | "
        f"{_f(r.erased)} | {_f(r.move)} | {_f(r.lost)} | "
        f"{'yes' if r.safe else 'no: ' + r.why} | {nats} | {r.parts} |"
      )
    lines += [
      "",
      "| group | moments | bytes | mu stalled | nu stalled | safe |",
      "|---|---|---:|---:|---:|---|",
    ]
    for r in self.state_rows:
      chosen = self.choice[r.group].partition("+")[2] == r.state
      name = f"**{r.state}**" if chosen else r.state
      lines.append(
        f"| {r.group} | {name} | {r.bytes:g} | {_f(r.mu)} | {_f(r.nu)} | "
        f"{'yes' if r.safe else 'no: ' + r.why} |"
      )
    lines += ["", f"Recommended ({self.bytes_per_param:.3f} bytes/param):"]
    if self.margin is not None:
      mean, se = self.predicted_nats
      lines.append(
        f"- predicted cost {mean:+.4f} +- {se:.4f} nats (weights; the "
        f"cheapest choice whose prediction plus two standard errors stays "
        f"under the margin of {self.margin:g} nats)"
      )
    lines += [f"- {g}: {c}" for g, c in self.choice.items()]
    lines += [f"- note: {n}" for n in self.notes]
    return "\n".join(lines)

  def config(self) -> dict:
    """The choice as `experiments.run`'s `lowprec` keys: `groups`
    ("name=regex") and `group_recipes` ("name=weights+state")."""
    return {
      "groups": tuple(f"{g}={r}" for g, r in self.groups if g in self.sizes),
      "group_recipes": tuple(f"{g}={c}" for g, c in self.choice.items()),
    }

  def fragment(self) -> str:
    """A Python config fragment: `LOWPREC`, the `config()` dict, with the
    table as its docstring, for a study to import as an arm."""
    body = self.config()
    out = ['"""' + _docstring(self) + '"""', "", "LOWPREC = {"]
    for key, value in body.items():
      out.append(f"  {json.dumps(key)}: (")
      out += [f"    {json.dumps(v)}," for v in value]
      out.append("  ),")
    out.append("}")
    return "\n".join(out) + "\n"

  def optax_code(
    self, optimizer: str = "optax.adamw(1e-3)", key: str = "jax.random.key(0)"
  ) -> str:
    """The choice as Python a user can paste: one `optax.multi_transform`
    over the groups, each group's recipe (`lowprec.recipes.chain`) around
    `optimizer` (an expression), keyed by `lowprec.groups.labels`; group
    `i`'s randomness is `fold_in(key, i)`.

    Raises:
      ValueError: `optimizer` or `key` is not a Python expression (each is
        compiled, never run).
    """
    _check_expression("optimizer", optimizer, "optax.adamw(1e-3)")
    _check_expression("key", key, "jax.random.key(0)")
    lines = [
      "import jax",
      "import optax",
      "",
      "import lowprec",
      "",
      f"key = {key}  # write-back and state-store randomness",
      "GROUPS = (",
    ]
    lines += [f"  ({g!r}, {r!r})," for g, r in self.groups if g in self.sizes]
    lines += [")", "tx = optax.multi_transform(", "  {"]
    for i, (g, c) in enumerate(self.choice.items()):
      k = f"jax.random.fold_in(key, {i})"
      lines.append(f"    {g!r}: {recipes.code(c, optimizer, k)},")
    lines += ["  },", "  lowprec.groups.labels(GROUPS),", ")"]
    return "\n".join(lines) + "\n"


def _check_expression(what: str, text, example: str) -> None:
  """Compiles `text` as one Python expression (nothing is run)."""
  if not isinstance(text, str):
    raise ValueError(
      f"{what} must be a Python expression as a string, e.g. {example!r}; "
      f"got {type(text).__name__}"
    )
  try:
    compile(text, f"<{what}>", "eval")
  except (SyntaxError, ValueError) as e:
    why = getattr(e, "msg", None) or str(e)
    raise ValueError(
      f"{what} {text!r} is not a Python expression ({why}), so the code "
      f"written around it would not compile: give one, e.g. {example!r}"
    ) from None


def _docstring(a: Advice) -> str:
  return (
    "The recipe lowprec.freeze.advise recommends, per tensor group.\n\n"
    "Written by `python -m scripts.advise`; rerun it to update.\n\n"
    + a.table().replace("\\", "\\\\")
    + "\n"
  )


def _f(x) -> str:
  return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"


def _leaf_sizes(params) -> dict[str, int]:
  if isinstance(params, Mapping) and all(
    isinstance(v, (int, np.integer)) for v in params.values()
  ):
    return {str(k): int(v) for k, v in params.items()}
  return groups_lib.leaf_sizes(params)


class _Sums:
  """Per leaf, the window's sums of a trace's per-step counts, each
  summed once (recipes on one grid share its traces)."""

  def __init__(self, records: Sequence[dict[str, float]]):
    self.records = records  # checked: prediction values as floats
    self._totals: dict[tuple, float] = {}

  def has_any(self, key: str, leaves: Sequence[str]) -> bool:
    """Whether some record has `key/<leaf>` for one of `leaves`."""
    last = self.records[-1]
    return any(f"{key}/{x}" in last for x in leaves)

  def total(self, key: str, leaf: str, weight: str | None = None) -> float:
    """Sum over steps of `key/<leaf>` (times `weight/<leaf>`)."""
    memo = (key, leaf, weight)
    if memo not in self._totals:
      out = 0.0
      for r in self.records:
        v = r.get(f"{key}/{leaf}")
        if v is None or not math.isfinite(v):
          continue
        out += v * (r.get(f"{weight}/{leaf}", 0) if weight else 1)
      self._totals[memo] = out
    return self._totals[memo]

  def ratio(self, trace: str, field: str, leaves, weighted: bool) -> float:
    """Over `leaves`, `pred/<trace>/<field>` per proposal: a per-step
    fraction weighted by that step's proposals (`weighted`), or a count
    summed and divided by the proposals; None without proposals."""
    pre = f"pred/{trace}"
    props = f"{pre}/proposals"
    weight = props if weighted else None
    return _ratio(
      sum(self.total(f"{pre}/{field}", x, weight) for x in leaves),
      sum(self.total(props, x) for x in leaves),
    )


def _tail(records: Sequence[dict], window: float) -> list[dict]:
  """The records of the last `window` share of the run (at least one)."""
  return list(records)[len(records) - max(1, round(len(records) * window)) :]


def share(
  records: Sequence[dict], trace: str, field: str, leaves, window: float = 0.5
) -> float | None:
  """The proposal-weighted mean of a per-leaf predicted fraction over the
  last `window` share of a run: `pred/<trace>/<field>/<leaf>` weighted by
  `pred/<trace>/proposals/<leaf>`, over `leaves` (e.g. the erased share a
  Kahan buffer's trace predicts: `trace="bfloat16_kahan_bfloat16"`,
  `field="erased_fraction"`); None where there were no proposals. The
  records are checked as `advise` checks them."""
  checked = records_lib.check(records)
  return _Sums(_tail(checked, window)).ratio(trace, field, leaves, True)


def _ratio(num: float, den: float) -> float | None:
  return num / den if den > 0 else None


def _weights_row(sums, group, leaves, w: recipes.Weights, th) -> Row:
  if w.fmt is None or w.compensation == "remainder":
    return Row(group, w.name, w.bytes, 0.0, None, 0.0, True, "")
  near, sr = _grid_names(w)
  erased = move = None
  has_near = sums.has_any(f"pred/{near}/proposals", leaves)
  has_sr = sums.has_any(f"pred/{sr}/proposals", leaves)
  if has_near:
    erased = sums.ratio(near, "erased_fraction", leaves, weighted=True)
  if has_sr:
    move = sums.ratio(sr, "move_prob", leaves, weighted=True)
  lost, why = None, ""
  if w.compensation == "none" and w.rounding == "nearest":
    lost = erased
    if not has_near:
      why = f"no trace of {w.fmt} (add it to the float32 run's trace targets)"
  elif w.compensation == "none":
    lost = 0.0 if move is not None else None
    if not has_sr:
      why = (
        f"no stochastic trace of {w.fmt} (add '{w.fmt}:stochastic' to the "
        "float32 run's trace targets)"
      )
    elif move is not None and move < th.move:
      why = f"move {move:.3f} < {th.move}"
  elif w.compensation == "kahan":
    name = remedy_name(w.fmt, "kahan", w.buffer)
    if sums.has_any(f"pred/{name}/proposals", leaves):
      lost = sums.ratio(name, "lost", leaves, weighted=False)
    else:
      why = f"no compensated trace {name}"
  else:
    why = f"{w.compensation} is not predicted by a trace"
  if not why and lost is None:
    why = "no proposals in the window"
  if not why and lost > th.lost:
    why = f"lost {lost:.3f} > {th.lost}"
  if (
    not why
    and w.compensation != "none"
    and erased is not None
    and erased > th.erased
  ):
    why = f"erased {erased:.3f} > {th.erased}: the grid resolves no step"
  return Row(group, w.name, w.bytes, erased, move, lost, not why, why)


def _state_row(sums, group, leaves, s: recipes.State, th) -> StateRow:
  if not s.rules:
    return StateRow(group, s.name, s.bytes, 0.0, 0.0, True, "")
  pre = f"pred_state/{s.name}"
  stalled = {}
  for m in ("mu", "nu"):
    paths = [
      p for x in leaves for p in _state_paths(sums.records[-1], pre, m, x)
    ]
    # Stalls on the stored codes: a change the code (and, under amax
    # scales or a code map, its block scale) does not show. Records
    # written before the runner traced stalls hold only `erased`.
    word = "stalled" if sums.has_any(f"{pre}/stalled", paths) else "erased"
    stalled[m] = _ratio(
      sum(sums.total(f"{pre}/{word}", p) for p in paths),
      sum(sums.total(f"{pre}/changed", p) for p in paths),
    )
  why = ""
  if all(v is None for v in stalled.values()):
    why = f"no state trace named {s.name!r}"
  else:
    worst = max(v for v in stalled.values() if v is not None)
    if 1 - worst < th.move:
      why = f"stalled {worst:.3f} > {1 - th.move:g}"
  return StateRow(
    group, s.name, s.bytes, stalled["mu"], stalled["nu"], not why, why
  )


def _state_paths(record, pre, moment, leaf) -> list[str]:
  """The state-trace paths of `leaf`'s `moment` in a record ("0/mu/<leaf>",
  "inner/0/mu/<leaf>", ...)."""
  start, end = f"{pre}/changed/", f"{moment}/{leaf}"
  return [
    k[len(start) :]
    for k in record
    if k.startswith(start) and (k[len(start) :] == end or k.endswith("/" + end))
  ]


def advise(
  records: Sequence[dict[str, Any]],
  params,
  *,
  groups=None,
  thresholds: Thresholds | None = None,
  budget: float | None = None,
  window: float = 0.5,
  sources: Sequence[str] | None = None,
  min_steps: int = MIN_WINDOW_STEPS,
  costs: Mapping[str, Mapping[str, Any]] | None = None,
  lost: Mapping[str, Mapping[str, Any]] | None = None,
  margin: float = 0.01,
) -> Advice:
  """Per group, the cheapest recipe a float32 run predicts to be safe.

  Args:
    records: the float32 run's per-step telemetry (`lowprec.telemetry`
      of its state), in step order, each with its "step" where known;
      checked as `lowprec.freeze.records.check` says (non-finite values
      may be spelled "nan", "inf", "-inf", as metrics.jsonl spells them).
    params: the parameters (a pytree of arrays or abstract arrays), or
      `{path: number of elements}`: the tensors the run traced, each one.
    groups: `(name, regex)` pairs (`lowprec.groups`), default
      `lowprec.groups.DEFAULT_GROUPS`; each given group must take a
      parameter.
    thresholds: the risks a recipe must stay under (`Thresholds()`).
    budget: bytes per parameter (weights, write-back state and AdamW's
      moments) the recommendation must fit; None for no limit. Under a
      budget the safe choice does not fit: by nats (`costs`, `lost`), the
      weights with the least summed prediction that fit beside the
      chosen moment stores; by the shares (or where no such weights
      fit), groups are moved to cheaper predicted recipes, largest saving
      per unit of predicted risk first. A note says what it costs.
    window: the share of the run, at its end, the predictions add up.
    sources: where each record came from ("metrics.jsonl:12"), named by
      the errors.
    min_steps: the fewest records the window may hold
      (`MIN_WINDOW_STEPS`); a lower value is noted in the advice.
    costs: `lowprec.freeze.forward_cost` of the float32 run's final
      weights (`{group: {grid name: Cost}}`): stochastic write-back's
      predicted nats.
    lost: `lowprec.freeze.lost_cost` of the same weights and the run's
      `progress_trace`: nearest write-back's predicted nats.
    margin: with `costs` or `lost`, the weights are chosen by predicted
      nats: the fewest bytes whose summed prediction plus two standard
      errors, each group's at least 0, stays at or under `margin` (default
      0.01 nats); recipes neither measures are not chosen. Without them,
      by the shares and `thresholds`.

  Returns:
    An `Advice`.

  Raises:
    ValueError: no records, a damaged record, a window outside (0, 1] or
      shorter than `min_steps`, parameters and traced tensors that do not
      match, a group that takes no parameter, or a budget no predicted
      recipe fits.
  """
  if not records:
    raise ValueError("advise needs the float32 run's telemetry records")
  if not 0 < window <= 1:
    raise ValueError(f"window must be in (0, 1], got {window}")
  checked = records_lib.check(records, sources)
  th = thresholds or Thresholds()
  compiled = groups_lib.as_groups(groups)
  sizes = _leaf_sizes(params)
  if not sum(sizes.values()):
    raise ValueError(
      "advise: the params hold no elements (every tensor has a zero-size "
      "axis), so there are no bytes per parameter to advise on; pass the "
      "model's parameters (arrays or jax.eval_shape of them)"
    )
  _check_traced(checked[-1], sizes)
  members = groups_lib.members(list(sizes), compiled)
  if groups is not None:
    _check_groups(compiled, members, sizes)
  recs = _window(checked, window, min_steps)
  first = len(records) - len(recs)
  sums = _Sums(recs)
  steps = (recs[0].get("step", first + 1), recs[-1].get("step", len(records)))
  group_sizes = {g: sum(sizes[x] for x in xs) for g, xs in members.items()}
  rows, state_rows, choice = [], [], {}
  by_bytes = sorted(recipes.WEIGHTS.values(), key=lambda w: w.bytes)
  for g, leaves in members.items():
    wrows = [_weights_row(sums, g, leaves, w, th) for w in by_bytes]
    srows = [
      _state_row(sums, g, leaves, s, th)
      for s in sorted(recipes.STATES.values(), key=lambda s: s.bytes)
    ]
    rows += wrows
    state_rows += srows
    w = next(r for r in wrows if r.safe)  # float32 is always safe
    s = next(r for r in srows if r.safe)
    choice[g] = f"{w.recipe}+{s.state}"
  by_nats = bool(costs or lost)
  if by_nats:
    if margin < 0 or not math.isfinite(margin):
      raise ValueError(f"margin must be a finite number >= 0, got {margin}")
    rows = [_with_nats(r, costs, lost) for r in rows]
    for g, w in _choose_by_nats(rows, group_sizes, margin).items():
      choice[g] = f"{w}+{choice[g].partition('+')[2]}"
  notes = _notes(rows, recs, sizes)
  if by_nats:
    missing = [n for n, c in (("forward", costs), ("lost", lost)) if not c]
    if missing:
      notes.append(
        f"no {' or '.join(missing)} costs: "
        + ("stochastic" if "forward" in missing else "nearest")
        + " write-back's nats are not predicted, so it is not chosen"
      )
  advice = Advice(
    group_sizes,
    rows,
    state_rows,
    choice,
    tuple((n, r.pattern) for n, r in compiled),
    th,
    steps,
    budget,
    notes,
    len(recs),
    margin if by_nats else None,
  )
  if budget is not None and advice.bytes_per_param > budget:
    if not (by_nats and _fit_by_nats(advice, budget)):
      _fit(advice, budget)
  return advice


def _fit_by_nats(advice: Advice, budget: float) -> bool:
  """Under a budget the margin's choice does not fit: the weights (moment
  stores as chosen) with the least summed prediction, `max(nats + 2 se,
  0)` per group, whose bytes fit; a note gives its cost against the
  margin. False (the choice unchanged) where no such weights fit, so the
  stores must move too (`_fit`, by the shares)."""
  total = sum(advice.sizes.values())
  stores = {g: c.partition("+")[2] for g, c in advice.choice.items()}
  room = budget * total - sum(
    recipes.STATES[stores[g]].bytes * n for g, n in advice.sizes.items()
  )
  pick, cost = _search(
    _nats_fronts(advice.rows, advice.sizes),
    advice.sizes,
    fits=lambda used, cost: used <= room + 1e-9 * total,
    key=lambda used, cost: (cost, used),
  )
  if pick is None:
    return False
  for g, w in pick.items():
    advice.choice[g] = f"{w}+{stores[g]}"
  advice.notes.append(
    f"the budget of {budget} bytes/param: the weights with the least "
    f"predicted cost that fit, {cost:.4f} nats with two standard "
    f"errors, against the margin of {advice.margin:g}"
  )
  return True


def _with_nats(row: Row, costs, lost) -> Row:
  """`row` with its predicted nats: for nearest write-back the measured
  `lost_cost` of its grid (the erased proposals taken back, on the
  grid), for stochastic write-back the measured `forward_cost` of its
  stochastic rounding (mean and standard error), 0 for float32 and the
  remainder (float32 exactly); unchanged (None) for what neither
  measures (compensations, ECO, split)."""
  w = recipes.WEIGHTS[row.recipe]
  if w.fmt is None or w.compensation == "remainder":
    return dataclasses.replace(row, nats=0.0, nats_se=0.0, parts="exact")
  if w.compensation != "none":
    return row
  near, sr = _grid_names(w)
  if w.rounding == "nearest":
    c, what = (lost or {}).get(row.group, {}).get(near), "lost"
  else:
    c, what = (costs or {}).get(row.group, {}).get(sr), "forward SR"
  if c is None:
    return row
  parts = f"{what} ({c.draws} draw{'s' if c.draws > 1 else ''})"
  return dataclasses.replace(
    row, nats=float(c.mean), nats_se=float(c.se), parts=parts
  )


def _choose_by_nats(rows, sizes, margin: float) -> dict[str, str]:
  """Per group, the weight recipe of the choice with the fewest bytes
  whose summed `max(nats + 2 se, 0)` is at most `margin` (float32, 0,
  always fits); ties go to the smaller summed prediction, then to
  float32."""
  pick, _ = _search(
    _nats_fronts(rows, sizes),
    sizes,
    fits=lambda used, cost: cost <= margin,
    key=lambda used, cost: (used, cost),
  )
  return pick


def _nats_fronts(rows, sizes) -> dict[str, list[tuple[float, float, str]]]:
  """Per group, its predicted weight recipes that no other beats on both
  bytes and `max(nats + 2 se, 0)`: `(bytes, cost, recipe)` by bytes,
  float32 first among equals."""
  out = {}
  for g in sizes:
    opts = sorted(
      (
        r.bytes,
        max(r.nats + 2 * (r.nats_se or 0.0), 0.0),
        r.recipe != "float32",  # float32 first among equals
        r.recipe,
      )
      for r in rows
      if r.group == g and r.nats is not None and math.isfinite(r.nats_se or 0)
    )
    front, best = [], math.inf
    for b, c, _, name in opts:
      if c < best:
        front.append((b, c, name))
        best = c
    out[g] = front
  return out


def _search(fronts, sizes, fits, key):
  """Every assignment of one front entry per group (`_nats_fronts`):
  the one of least `key(bytes, cost)` whose partial sums `fits` (both
  only grow, so a partial sum that does not fit is pruned). Returns
  `(pick, cost)`, `(None, inf)` where none fits; bytes are summed over
  elements, cost over groups."""
  groups = list(fronts)
  found = {"key": None, "pick": None, "cost": math.inf}

  def go(i, used, cost, pick):
    if not fits(used, cost):
      return
    if i == len(groups):
      k = key(used, cost)
      if found["key"] is None or k < found["key"]:
        found.update(key=k, pick=dict(pick), cost=cost)
      return
    g = groups[i]
    for b, c, name in fronts[g]:
      pick[g] = name
      go(i + 1, used + b * sizes[g], cost + c, pick)
    pick.pop(g, None)

  go(0, 0.0, 0.0, {})
  return found["pick"], found["cost"]


def _window(checked, window: float, min_steps: int) -> list[dict]:
  """The window's records; refused below `min_steps`."""
  recs = _tail(checked, window)
  if len(recs) >= min_steps:
    return recs
  need = min_steps
  while max(1, round(need * window)) < min_steps:
    need += 1
  raise ValueError(
    f"the window (the last {window:g} of the run's {len(checked)} records) "
    f"holds {len(recs)} step(s); the advice needs at least {min_steps}: "
    "one time constant of Adam's first moment at b1 = 0.9, the time scale "
    f"of the move threshold. Train the float32 run longer (at least {need} "
    "steps)"
  )


def _check_traced(last: dict, sizes: dict[str, int]) -> None:
  """Parameters and the tensors the weight traces report must be the same
  names (where the run traced any)."""
  traced = records_lib.traced(last)
  if not traced:
    return
  untraced = [x for x in sizes if x not in set(traced)]
  unknown = [x for x in traced if x not in sizes]
  if untraced or unknown:
    what = []
    if untraced:
      what.append(
        f"{len(untraced)} parameter(s) match no traced tensor "
        f"({records_lib.quote(untraced)})"
      )
    if unknown:
      what.append(
        f"{len(unknown)} traced tensor(s) match no parameter "
        f"({records_lib.quote(unknown)})"
      )
    raise ValueError(
      f"{'; '.join(what)}. The traced tensors: "
      f"{records_lib.quote(traced, 8)}. Pass the parameters of the model "
      "the float32 run trained (their paths as the trace names them), or "
      "trace every parameter"
    )


def _check_groups(compiled, members, sizes) -> None:
  empty = [(n, r.pattern) for n, r in compiled if n not in members]
  if empty:
    listed = ", ".join(f"{n} ({r!r})" for n, r in empty)
    raise ValueError(
      f"group(s) that take no parameter: {listed} (the regex matches none "
      "of the parameters, or groups before it take every match; the first "
      "full match wins). The parameters: "
      f"{records_lib.quote(list(sizes), 8)}. Fix the regex, or drop the "
      "group"
    )


def _notes(rows, recs, sizes) -> list[str]:
  notes = []
  unpredicted = sorted({r.recipe for r in rows if r.lost is None})
  if unpredicted:
    notes.append(
      "not predicted by this run, never recommended: " + ", ".join(unpredicted)
    )
  idle = records_lib.no_proposals(recs, sizes)
  if idle:
    shown = [f"{x} at {n}" for x, n in list(idle.items())[:_SHOWN]]
    more = f", and {len(idle) - _SHOWN} more" if len(idle) > _SHOWN else ""
    notes.append(
      f"steps without proposals, left out of those tensors' shares (NaN, "
      f"not zero risk): {', '.join(shown)}{more} of the window's "
      f"{len(recs)} steps"
    )
  if len(recs) < MIN_WINDOW_STEPS:
    notes.append(
      f"the window holds {len(recs)} steps, fewer than the "
      f"{MIN_WINDOW_STEPS} the advice needs: a longer float32 run decides"
    )
  return notes


def _risk(row) -> float | None:
  """A predicted option's risk: the share it loses, and for stochastic
  rounding how far its move probability falls short of the threshold."""
  if isinstance(row, StateRow):
    worst = max((v for v in (row.mu, row.nu) if v is not None), default=None)
    return worst
  if row.lost is None:
    return None
  if row.why.startswith("erased"):
    return row.erased
  if row.move is not None and row.lost == 0.0 and row.why.startswith("move"):
    return 1 - row.move
  return row.lost


def _fit(advice: Advice, budget: float) -> None:
  """Moves groups to cheaper predicted recipes until the choice fits."""
  total = sum(advice.sizes.values())
  options = {}
  for g in advice.sizes:
    if not advice.sizes[g]:
      continue  # a group of zero-size tensors: no bytes to gain
    ws = [r for r in advice.rows if r.group == g and _risk(r) is not None]
    ss = [r for r in advice.state_rows if r.group == g and _risk(r) is not None]
    options[g] = [
      (w.bytes + s.bytes, _risk(w) + _risk(s), f"{w.recipe}+{s.state}")
      for w in ws
      for s in ss
    ]
  while advice.bytes_per_param > budget:
    best = None
    for g, opts in options.items():
      now = recipes.bytes_per_param(advice.choice[g])
      now_risk = next(o[1] for o in opts if o[2] == advice.choice[g])
      for b, risk, name in opts:
        if b >= now:
          continue
        cost = max(risk - now_risk, 0.0) * advice.sizes[g]
        gain = (now - b) * advice.sizes[g] / total
        key = (cost / gain, -gain)
        if best is None or key < best[0]:
          best = (key, g, name)
    if best is None:
      floor = (
        sum(
          min(o[0] for o in opts) * advice.sizes[g]
          for g, opts in options.items()
        )
        / total
      )
      raise ValueError(
        f"no predicted recipe fits {budget} bytes/param; the cheapest "
        f"predicted choice takes {floor:.3f}: raise --budget, or add traces "
        "of narrower formats to the float32 run"
      )
    _, g, name = best
    advice.choice[g] = name
  risky = [
    f"{g}: {c}"
    for g, c in advice.choice.items()
    if not all(
      r.safe
      for r in advice.rows + advice.state_rows
      if r.group == g
      and (getattr(r, "recipe", None), getattr(r, "state", None))
      in ((c.partition("+")[0], None), (None, c.partition("+")[2]))
    )
  ]
  if risky:
    advice.notes.append(
      f"the budget of {budget} bytes/param takes predicted risks in "
      + "; ".join(risky)
    )

"""A float32 run's telemetry records, checked as the advisor reads them.

`advise` adds up what the traces of a float32 run predicted at each step
(`lowprec.telemetry` of its state: `pred/<trace>/<field>/<tensor>`,
`pred_state/<store>/<field>/<path>` and `progress/<grid>/lost/<tensor>`
keys). A damaged or foreign record
would change the advice without a sign, so `check` refuses, naming the
record (or the file and line it came from) and the fix:

* a record that is not a mapping, a `step` that is not an integer, steps
  not increasing (given for every record or for none);
* a record whose prediction keys differ from the other records' (the
  traces report every key at every step);
* a prediction value that is not a number; non-finite values may also be
  the strings "nan", "inf" and "-inf", as `experiments.run` writes them
  to metrics.jsonl;
* a count the advisor reads (`proposals`, `lost`, a store's `changed`
  and `erased`) that is not finite or below zero; a share it reads
  (`erased_fraction`, `move_prob`) outside [0, 1], or NaN at a step where
  the tensor had proposals.

A share is NaN where its tensor had no proposals at that step (a frozen
or masked tensor; every tensor at a step with learning rate 0): it weighs
nothing in the advisor's proposal-weighted means, and `no_proposals`
lists those steps, for the advice to say which it left out.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

PREFIXES = ("pred/", "pred_state/", "progress/")
# Non-finite floats as experiments.results writes them (str(float)).
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
COUNTS = ("proposals", "lost")  # pred/<trace>/<field>/<tensor>
SHARES = ("erased_fraction", "move_prob")
STATE_COUNTS = ("changed", "erased")  # pred_state/<store>/<field>/<path>
_SHOWN = 4  # names quoted in a message before "..."


def is_prediction(key: str) -> bool:
  return key.startswith(PREFIXES)


def quote(names: Sequence[str], limit: int = _SHOWN) -> str:
  """`'a', 'b', ... (12 in all)`: the first `limit` names."""
  shown = ", ".join(repr(n) for n in list(names)[:limit])
  return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _where(i: int, record, sources) -> str:
  if sources is not None:
    return str(sources[i])
  step = record.get("step") if isinstance(record, Mapping) else None
  return f"record {i}" + (f" (step {step})" if step is not None else "")


def _number(value) -> float | None:
  """The float a prediction value stands for; None if it is none."""
  if isinstance(value, str):
    return NON_FINITE.get(value)
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  if getattr(value, "shape", None) == () and getattr(value, "dtype", None):
    if np.dtype(value.dtype).kind in "iuf":
      return float(value)
  return None


def _field(key: str) -> tuple[str, str, str, str] | None:
  """(prefix, trace, field, tensor path) of a per-tensor key, else None."""
  parts = key.split("/", 3)
  return tuple(parts) if len(parts) == 4 else None


def _check_steps(records, sources) -> None:
  has = ["step" in r for r in records]
  if any(has) and not all(has):
    i = has.index(False)
    raise ValueError(
      f"{_where(i, records[i], sources)} has no 'step' where other records "
      "have one: give every record its step, or none"
    )
  if not all(has):
    return
  last = None
  for i, r in enumerate(records):
    s = r["step"]
    if isinstance(s, (bool, np.bool_)) or not isinstance(s, numbers.Integral):
      raise ValueError(
        f"{_where(i, r, sources)}: step {s!r} is not an integer; records "
        "carry the step they were taken after (1, 2, ...)"
      )
    if last is not None and s <= last:
      raise ValueError(
        f"{_where(i, r, sources)}: step {s} after step {last}: records go "
        "in step order, one per step; drop the repeated or misplaced one"
      )
    last = s


def _check_keys(records, sources) -> frozenset[str]:
  """The prediction keys every record carries."""
  preds: dict[frozenset, frozenset] = {}  # a record's keys -> predictions
  keys = []
  for r in records:
    ks = frozenset(r)
    if ks not in preds:
      preds[ks] = frozenset(k for k in ks if is_prediction(k))
    keys.append(preds[ks])
  usual = Counter(keys).most_common(1)[0][0]
  for i, ks in enumerate(keys):
    if ks == usual:
      continue
    missing, extra = sorted(usual - ks), sorted(ks - usual)
    what = []
    if missing:
      what.append(
        f"lacks {len(missing)} prediction key(s) the other records carry "
        f"({quote(missing)})"
      )
    if extra:
      what.append(
        f"carries {len(extra)} prediction key(s) the other records lack "
        f"({quote(extra)})"
      )
    raise ValueError(
      f"{_where(i, records[i], sources)} {' and '.join(what)}: the traces "
      "report every key at every step, so this record was cut, edited or "
      "comes from another run. Repair it, or take the records again from "
      "the float32 run"
    )
  return usual


def _bad(where, key, raw, why) -> ValueError:
  return ValueError(
    f"{where}: {key} = {raw!r} {why}; the record was damaged or edited: "
    "repair it, or take the records again from the float32 run"
  )


def _plan(keys) -> tuple[list[str], list[str], list[tuple[str, str]]]:
  """The keys; the counts; and the shares with their proposals key, among
  `keys` (the same in every record, so parsed once)."""
  counts, shares = [], []
  for k in sorted(keys):
    f = _field(k)
    if f is None:
      continue
    pre, trace, field, leaf = f
    if field in (COUNTS if pre == "pred" else STATE_COUNTS):
      counts.append(k)
    elif pre == "pred" and field in SHARES:
      shares.append((k, f"pred/{trace}/proposals/{leaf}"))
  return sorted(keys), counts, shares


def _values(i, record, sources, plan) -> dict[str, float]:
  """The record's prediction values as floats, each checked."""
  keys, counts, shares = plan
  out = {}
  for k in keys:
    raw = record[k]
    if type(raw) in (float, int):  # the common case, read fast
      out[k] = float(raw)
      continue
    v = _number(raw)
    if v is None:
      raise ValueError(
        f"{_where(i, record, sources)}: {k} = {raw!r} is not a number (the "
        "traces report numbers; metrics.jsonl spells non-finite ones 'nan', "
        "'inf', '-inf'): repair the record, or take the records again from "
        "the float32 run"
      )
    out[k] = v
  for k in counts:
    v = out[k]
    if not (v >= 0 and v != math.inf):  # NaN fails v >= 0
      raise _bad(
        _where(i, record, sources),
        k,
        record[k],
        "is not a count (finite, >= 0)",
      )
  for k, props_key in shares:
    v = out[k]
    if 0 <= v <= 1:
      continue
    where = _where(i, record, sources)
    if not math.isnan(v):
      raise _bad(where, k, record[k], "is not a share in [0, 1]")
    props = out.get(props_key)
    if props != 0:
      raise _bad(
        where,
        k,
        record[k],
        (
          f"with {props:g} proposals"
          if props is not None
          else "without a proposals count"
        )
        + " (a share is NaN only where its tensor had no proposals)",
      )
  return out


def check(
  records: Sequence[Mapping], sources: Sequence[str] | None = None
) -> list[dict[str, float]]:
  """The records' prediction values as floats, after the module's checks.

  Args:
    records: per-step telemetry of the float32 run, in step order.
    sources: where each record came from ("metrics.jsonl:12"), for the
      messages; default "record <i> (step <s>)".

  Returns:
    Per record, `{key: float}` of its prediction keys (NaN where the
      runner wrote "nan"), and its "step" where it has one.

  Raises:
    ValueError: a record breaks one of the rules; the message names it
      and the fix.
  """
  if sources is not None and len(sources) != len(records):
    raise ValueError(
      f"sources names {len(sources)} records, but there are {len(records)}"
    )
  for i, r in enumerate(records):
    if not isinstance(r, Mapping):
      raise ValueError(
        f"{_where(i, r, sources)} is a {type(r).__name__}, not a mapping of "
        "telemetry keys to values (lowprec.telemetry(state))"
      )
  _check_steps(records, sources)
  plan = _plan(_check_keys(records, sources))
  out = []
  for i, r in enumerate(records):
    values = _values(i, r, sources, plan)
    if "step" in r:
      values["step"] = int(r["step"])
    out.append(values)
  return out


def no_proposals(records: Sequence[Mapping], leaves) -> dict[str, int]:
  """Per tensor of `leaves`, how many of the checked `records` have a trace
  that saw no proposal of it (where its shares are NaN and left out)."""
  leaves = set(leaves)
  out: Counter = Counter()
  for r in records:
    zero = set()
    for k, v in r.items():
      f = _field(k) if k.startswith("pred/") else None
      if f is not None and f[2] == "proposals" and f[3] in leaves and v == 0:
        zero.add(f[3])
    out.update(zero)
  return dict(out)


def traced(record: Mapping) -> list[str]:
  """The tensors some weight trace of `record` reports proposals of."""
  out = []
  for k in record:
    f = _field(k) if k.startswith("pred/") else None
    if f is not None and f[2] == "proposals" and f[3] not in out:
      out.append(f[3])
  return out

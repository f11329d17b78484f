"""Predictions from an operator's requirements table (`predict`)."""

from __future__ import annotations

import dataclasses

from lowprec.backward.audit.report import table, yes_no
from lowprec.backward.ops import requirements as req_lib
from lowprec.backward.ops.base import Op
from lowprec.backward.policy import Policy


@dataclasses.dataclass(frozen=True)
class UsePrediction:
  """The predicted effect of one use's read on the mean gradient."""

  use: str
  value: str  # what the policy reads
  must_read: str  # what the reference reads
  kind: str  # how the tensor's rounded value is produced
  verdict: str  # "exact", "unbiased" or "biased"
  admissible: tuple[str, ...]  # values that are exact or unbiased here
  reuse_differs: bool | None  # rounded vs an independent copy; None: no copy


@dataclasses.dataclass(frozen=True)
class Prediction:
  """`predict`'s answer: one `UsePrediction` per use of the operator."""

  op: str
  policy: str
  uses: tuple[UsePrediction, ...]

  @property
  def biased(self) -> tuple[str, ...]:
    """The uses whose read changes the mean gradient."""
    return tuple(u.use for u in self.uses if u.verdict == "biased")

  def __getitem__(self, use: str) -> UsePrediction:
    return next(u for u in self.uses if u.use == use)

  def __str__(self) -> str:
    rows = [
      (u.use, u.value, u.must_read, "/".join(u.admissible), u.verdict,
       yes_no(u.reuse_differs))
      for u in self.uses
    ]  # fmt: skip
    head = ("use", "reads", "must read", "admissible", "predicted",
            "reuse differs")  # fmt: skip
    return f"{self.op}: {self.policy}\n" + table(head, rows)


def classify(op: Op, req, value: str) -> str:
  """`requirements.classify` of reading `value` for `req.use` on `op`."""
  return req_lib.classify(
    req, op.produces(req, value), op.produces(req, req.must_read)
  )


def predict(op: Op, policy) -> Prediction:
  """Predicts, from the requirements table, which uses bias the mean gradient.

  Args:
    op: a configured operator (e.g. `ops.Attention(probs=..., out=...)`); its
      roundings decide which values coincide (no rounding: all of them;
      nearest: `rounded` and `nearest`).
    policy: a `Policy` or anything `Policy.parse` takes.

  Returns:
    A `Prediction`; `str()` of it is a table.

  Raises:
    ValueError: the policy does not cover the operator's uses.

  Example:
    ```python
    op = ops.NormDense(out="float8_e4m3fn:stochastic")
    predict(op, "norm.out@.*=original,dense.kernel@dx=rounded").biased
    # ('norm.out@dw',)
    ```
  """
  if not isinstance(op, Op):
    raise TypeError(f"expected an operator from lowprec.ops, got {op!r}")
  values = op.resolve(policy)
  out = []
  for req, value in zip(op.table, values, strict=True):
    verdicts = {v: classify(op, req, v) for v in op.values}
    copy = op.copy_value(req.tensor)
    differs = req_lib.reuse_differs(
      op.produces(req, "rounded"),
      None if copy is None else op.produces(req, copy),
    )
    admissible = tuple(v for v in op.values if verdicts[v] != "biased")
    out.append(
      UsePrediction(req.use, value, req.must_read, op.kind(req.tensor),
                    verdicts[value], admissible, differs)
    )  # fmt: skip
  return Prediction(op.name, str(Policy.parse(policy)), tuple(out))

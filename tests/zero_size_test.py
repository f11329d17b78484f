"""Zero-size parameters in the counts of bytes per parameter.

A model whose tensors all have a zero-size axis has no bytes per
parameter: refused with the fix, by `lowprec.bytes_per_param` and by
`lowprec.freeze.advise`. A zero-size tensor among others counts as no
elements: the others' bytes are the answer.
"""

import jax.numpy as jnp
import optax
import pytest

import lowprec
from lowprec import recipes
from lowprec.freeze import advise
from tests.advise_test import GROUPS, STEPS, _record


def test_bytes_per_param_counts_a_zero_size_tensor_as_no_elements():
  params = {"w": jnp.zeros((0, 4)), "b": jnp.zeros((3,))}
  got = lowprec.bytes_per_param(params, optax.adam(1e-3).init(params))
  assert got == (4.0, 8.0, 12.0, 4)  # b's float32 and its two moments
  with pytest.raises(ValueError, match="no array leaves with elements"):
    lowprec.bytes_per_param({"w": jnp.zeros((0, 4))}, None)


def _params(rows):
  return {
    "wte": jnp.zeros((0, 4)),
    "h": {"mlp": {"kernel": jnp.zeros((rows, 3))}},
  }


def test_advise_refuses_a_model_without_elements():
  recs = [_record(t) for t in STEPS]
  with pytest.raises(ValueError, match=r"no elements.*model's parameters"):
    advise(recs, _params(0), groups=GROUPS)


def test_advise_weighs_a_group_of_zero_size_tensors_by_nothing():
  # Risky records (low move probability, a lossy e5m2 buffer, a stalling
  # nu), so that a budget makes the advice trade; the embeddings group
  # holds a zero-size tensor only, and the answer is the other group's.
  recs = [_record(t, move=0.05, lost_e5m2=0.005, nu=0.95) for t in STEPS]
  free = advise(recs, _params(5), groups=GROUPS)
  assert free.sizes == {"embeddings": 0, "mlp": 15}
  want = recipes.bytes_per_param(free.choice["mlp"])
  assert free.bytes_per_param == pytest.approx(want)
  fit = advise(recs, _params(5), groups=GROUPS, budget=10.0)
  assert fit.bytes_per_param <= 10.0 < free.bytes_per_param
  want = recipes.bytes_per_param(fit.choice["mlp"])
  assert fit.bytes_per_param == pytest.approx(want)

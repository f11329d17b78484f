"""tests/golden_bits.json against the storage recipes computed here.

The file holds, for fixed float32 inputs, every storage recipe's stored
arrays and integer counts after a few steps (experiments/golden_bits.py).
Its values depend only on IEEE float32 arithmetic and the recipes' own
roundings, so they hold on every CPU, and a device must reproduce them.
"""

import json

import numpy as np
import pytest

from experiments import golden_bits, goldens

FILE = json.load(open(golden_bits.GOLDEN_BITS))
WANT = FILE["recipes"]
SAME_CPU = FILE["made_with"]["cpu_vector_isa"] == goldens.cpu_vector_isa()


def test_the_file_covers_every_recipe():
  assert sorted(WANT) == sorted(golden_bits._recipes())
  families = {n.split("/")[0] for n in WANT}
  assert families == {
    "adamw",
    "writeback",
    "kahan",
    "two_component",
    "remainder",
    "state",
    "split",
    "eco",
  }


@pytest.mark.parametrize("name", sorted(WANT))
def test_recipe_equals_its_golden_bits(name):
  if golden_bits.informational(name) and not SAME_CPU:
    pytest.skip("an AdamW record: its FMA contractions follow the CPU's ISA")
  got = golden_bits.compute([name])[name]
  assert golden_bits.first_difference(WANT[name], got) is None, (
    golden_bits.first_difference(WANT[name], got)
    + "; if the change is intended: python -m experiments.golden_bits --write"
  )


def test_records_hold_the_stored_arrays_in_their_dtypes():
  kahan = WANT["kahan/bfloat16/float8_e5m2/nearest"]["arrays"]
  dtypes = {golden_bits._decode(e).dtype.name for e in kahan.values()}
  assert {"bfloat16", "float8_e5m2"} <= dtypes
  state = WANT["state/fp8/stochastic/block32"]["arrays"]
  shapes = sorted(tuple(e["shape"]) for e in state.values())
  assert (4, 2) in shapes  # two block scales per row of 64
  assert WANT["remainder/bfloat16"]["counts"]["proposals"] > 0


def test_first_difference_names_the_element_and_both_values():
  rec = json.loads(json.dumps(WANT["writeback/bfloat16/nearest"]))
  name = sorted(rec["arrays"])[0]
  x = golden_bits._decode(rec["arrays"][name]).copy()
  x[1, 3] = x[1, 3] + x[1, 3]  # doubled: a different value
  rec["arrays"][name]["hex"] = x.tobytes().hex()
  msg = golden_bits.first_difference(WANT["writeback/bfloat16/nearest"], rec)
  assert msg.startswith(f"{name}[1, 3]: expected ")
  assert "1 of 256 elements differ" in msg
  rec2 = json.loads(json.dumps(WANT["writeback/bfloat16/nearest"]))
  rec2["counts"]["erased"] += 1
  msg = golden_bits.first_difference(WANT["writeback/bfloat16/nearest"], rec2)
  assert msg.startswith("count erased: expected ")


def test_fixed_inputs_cancel_and_span_magnitudes():
  u0, u1 = golden_bits._proposals(0), golden_bits._proposals(1)
  assert np.array_equal(u1[:, 5::16], -u0[:, 5::16])
  assert (u0[:, ::16] == 0).all()
  mag = np.abs(u0[u0 != 0])
  assert mag.min() < 2.0**-16 and mag.max() > 2.0**-4

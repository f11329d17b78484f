"""tests/golden_bits.json against the storage recipes computed here.

The file holds, for fixed float32 inputs, every storage recipe's stored
arrays and integer counts after a few steps (experiments/golden_bits.py).
Its values depend only on IEEE float32 arithmetic and the recipes' own
roundings, so they hold on every CPU, and a device must reproduce them;
the `adamw/` records, which run AdamW's arithmetic too, are compared only
on the code path the file was made on (its `made_with`, keyed as
experiments/goldens.py keys its sets).
"""

import json

import numpy as np
import pytest

from experiments import golden_bits, goldens

FILE = json.load(open(golden_bits.GOLDEN_BITS))
WANT = FILE["recipes"]
HERE = goldens.environment()


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
  reason = golden_bits.not_compared(name, FILE["made_with"], HERE)
  if reason:
    pytest.skip(reason)
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


def _machine(model: int, features: str) -> dict:
  """`goldens.environment()` on an Intel x86-64 machine (this jax)."""
  cpuinfo = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
    f"model\t\t: {model}\nflags\t\t: {features}\n"
  )
  return {
    "jax": HERE["jax"],
    "jaxlib": HERE["jaxlib"],
    **goldens.cpu(cpuinfo, "x86_64"),
  }


AVX512 = "sse4_2 avx fma f16c avx2 avx512f avx512bw avx512dq avx512vl"
AMX = AVX512 + " avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16"


def test_adamw_records_are_compared_only_on_their_code_path():
  """On an AMX machine, an AVX-512 one without AMX, or against a file that
  names only the widest vector ISA, the AdamW records skip with the
  difference and the command that remakes the file; the other records
  are compared on every machine."""
  made_with = _machine(143, AVX512)
  legacy = {"jax": HERE["jax"], "backend": "cpu", "cpu_vector_isa": "avx2"}
  for name in golden_bits.ADAMW:
    assert (
      golden_bits.not_compared("adamw/" + name, made_with, made_with) is None
    )
    why = golden_bits.not_compared(
      "adamw/" + name, made_with, _machine(143, AMX)
    )
    assert why.startswith("an AdamW record: ") and "amx_tile" in why, why
    assert "python -m experiments.golden_bits --write" in why
    why = golden_bits.not_compared(
      "adamw/" + name, made_with, _machine(85, AVX512)
    )
    assert "cpu_model GenuineIntel family 6 model 143 there" in why, why
    assert golden_bits.not_compared("adamw/" + name, legacy, made_with)
    assert golden_bits.not_compared(name, made_with, _machine(143, AMX)) is None
    assert golden_bits.not_compared(name, legacy, made_with) is None


def test_the_file_names_the_code_path_it_was_made_on():
  made_with = FILE["made_with"]
  assert set(goldens.KEY) <= set(made_with), made_with
  assert not goldens._unknown(made_with), made_with

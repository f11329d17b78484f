"""Bytes per parameter and the kind of a run, as the remedies and state
tables name and count them, against the documented byte counts."""

import pytest

from experiments.analysis.writeback_tables import (
  recipe_bytes,
  remedy_kind,
  state_bytes,
)

# spec -> bytes per element: the code, then its scales (docs/state.md)
STATE_BYTES = {
  "bfloat16:stochastic": 2,
  "float8_e5m2:nearest:block128": 1 + 4 / 128,
  "float8_e4m3fn:nearest:block256:amax": 1 + 4 / 256,
  "float8_e4m3fn:nearest:block256:amax:float16": 1 + 2 / 256,
  "dynamic8:block256": 1 + 4 / 256,
  "dynamic8u:block256": 1 + 4 / 256,
  "dynamic8:block2048": 1 + 4 / 2048,
  "companded8:block32": 1 + 2 / 32,  # float16 scales, the map's own
  "sqrt8:block32": 1 + 2 / 32,
  "dynamic4:block128": 0.5 + 4 / 128,  # two 4-bit codes to a byte
  "uint4nz:block128": 0.5 + 4 / 128,
  "int4:nearest:block128:amax": 0.5 + 4 / 128,
  "int8:stochastic:block128": 1 + 4 / 128,  # a grid held in float32
  "e3m2:stochastic": 6 / 8,
}


@pytest.mark.parametrize("spec, want", STATE_BYTES.items(), ids=STATE_BYTES)
def test_state_bytes_count_the_code_and_its_scales(spec, want):
  assert state_bytes(spec) == pytest.approx(want)


def _config(**lowprec):
  lp = {"writeback": "bfloat16", "rounding": "nearest", **lowprec}
  return {"lowprec": lp}


def test_recipe_bytes_add_weights_buffer_and_moments():
  assert recipe_bytes({"lowprec": {"writeback": ""}}) == 12.0
  assert recipe_bytes(_config()) == 2 + 8
  assert recipe_bytes(_config(compensation="eco")) == 2 + 8
  assert recipe_bytes(_config(compensation="split")) == 2 + 1 + 8
  split16 = _config(compensation="split", correction_bits=16)
  assert recipe_bytes(split16) == 2 + 2 + 8
  # torchao's AdamW8bit moments beside FlashOptim's split weights.
  adamw8 = ("mu=dynamic8:block256", "nu=dynamic8u:block256")
  got = recipe_bytes(_config(compensation="split", state=adamw8))
  assert got == pytest.approx(2 + 1 + 2 * (1 + 4 / 256))


def test_recipe_bytes_take_the_first_rule_that_matches_a_moment():
  # As lowprec.store_state matches: whole path components, the first
  # matching rule wins; a moment no rule matches stays float32.
  both = _config(state=("mu|nu=companded8:block32", "nu=bfloat16"))
  assert recipe_bytes(both) == pytest.approx(2 + 2 * (1 + 2 / 32))
  nu_only = _config(state=("nu=sqrt8:block32",))
  assert recipe_bytes(nu_only) == pytest.approx(2 + 4 + 1 + 2 / 32)
  # Under eco the moments sit at inner/0/mu/...: the same rules match.
  eco = _config(compensation="eco", state=("mu=bfloat16:stochastic",))
  assert recipe_bytes(eco) == 2 + 2 + 4


@pytest.mark.parametrize(
  "lowprec, kind",
  [
    ({"compensation": "eco"}, "eco"),
    ({"compensation": "eco", "rounding": "stochastic"}, "eco (stochastic)"),
    ({"compensation": "split"}, "split (int8 correction)"),
    (
      {"compensation": "split", "correction_bits": 16},
      "split (int16 correction)",
    ),
    ({"compensation": "kahan"}, "kahan (bfloat16 buffer)"),
    ({"rounding": "stochastic"}, "stochastic"),
  ],
  ids=["eco", "eco-sr", "split8", "split16", "kahan", "sr"],
)
def test_remedy_kind_names_the_compensation_and_its_setting(lowprec, kind):
  assert remedy_kind(_config(**lowprec)) == kind


@pytest.mark.parametrize(
  "name, want",
  [("mxfp8_e4m3", 1 + 1 / 32), ("mxfp4_e2m1", 0.5 + 1 / 32), ("bfloat16", 2.0)],
)
def test_recipe_bytes_of_mx_weights_count_elements_and_block_scales(name, want):
  got = recipe_bytes(_config(writeback=name, compensation="eco"))
  assert got == pytest.approx(8.0 + want)

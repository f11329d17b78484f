"""Each case of experiments/goldens.py against tests/goldens.json.

The values are exact (losses as float64 from float32, digests of bytes),
one set per jax/jaxlib version and CPU vector ISA they were made on (each
set's `made_on`). In an environment with no set of its own floating-point
results may differ, so the comparisons skip, with a message naming the
difference, rather than fail. A deliberate change, or a new machine:
`python -m scripts.refresh_goldens --why "..."`.
"""

import json
import subprocess
import sys

import pytest

from experiments import goldens

DATA = goldens.load()
HERE = goldens.environment()
MISMATCH = goldens.mismatch([e["made_on"] for e in DATA["environments"]], HERE)


@pytest.mark.parametrize("case", sorted(goldens.CASES))
def test_case_equals_its_golden_values(case):
  """Skips (does not fail) on a jax/jaxlib version or vector ISA that no
  set of the file was made on: XLA:CPU's floating-point results may differ
  there (e.g. AVX-512 code against AVX2 code)."""
  if MISMATCH:
    pytest.skip(MISMATCH)
  pinned = {
    k: v["value"]
    for k, v in goldens.pinned(DATA, HERE).items()
    if k.startswith(case + "/")
  }
  got = json.loads(json.dumps(goldens.CASES[case]()))
  assert sorted(got) == sorted(pinned), "entries changed; " + goldens.REFRESH
  bad = [
    f"{k}: golden {goldens.brief(pinned[k])}, now {goldens.brief(got[k])}"
    for k in sorted(got)
    if got[k] != pinned[k]
  ]
  assert not bad, "\n".join(
    [*bad, f"if the change is intended: {goldens.REFRESH}"]
  )


def test_goldens_file_names_where_it_was_made_and_every_case():
  envs = goldens.load()["environments"]
  assert envs
  made_on = [e["made_on"] for e in envs]
  assert len({json.dumps(m, sort_keys=True) for m in made_on}) == len(envs)
  for env in envs:
    assert set(env["made_on"]) == {"jax", "jaxlib", "cpu_vector_isa"}
    cases = {k.split("/")[0] for k in env["entries"]}
    assert cases == set(goldens.CASES), env["made_on"]
    for name, entry in env["entries"].items():
      history = entry["history"]
      assert history and history[-1]["new"] == entry["value"], name
      assert all(h["why"].strip() for h in history), name


def test_mismatch_names_the_difference():
  here = goldens.environment()
  assert goldens.mismatch(dict(here), here) is None
  isa = "sse4_2" if here["cpu_vector_isa"] != "sse4_2" else "avx2"
  other = {**here, "cpu_vector_isa": isa, "jaxlib": "0.0.1"}
  msg = goldens.mismatch(other, here)
  assert f"cpu_vector_isa {isa} there" in msg and "jaxlib 0.0.1" in msg
  assert "refresh_goldens --why" in msg
  # Several environments: none of them here names each; one here holds.
  msg = goldens.mismatch([other, {**here, "jax": "0.0.2"}], here)
  assert "jaxlib 0.0.1" in msg and "jax 0.0.2" in msg
  assert goldens.mismatch([other, dict(here)], here) is None


def test_cpu_vector_isa_reads_the_cpu_flags():
  isa = goldens.cpu_vector_isa()
  try:
    with open("/proc/cpuinfo") as f:
      flags = next(ln for ln in f if ln.startswith("flags")).split()
  except (OSError, StopIteration):
    pytest.skip("no /proc/cpuinfo flags here")
  assert isa in flags
  assert (isa == "avx512f") == ("avx512f" in flags)


def test_refresh_records_why_and_what_changed(tmp_path):
  path = str(tmp_path / "goldens.json")
  values = {"a/x": [1.0, 2.0], "a/y": "digest0"}
  cases = {"a": lambda: dict(values)}
  assert goldens.refresh("first values", path, cases) == [
    "a/x: null -> [1.0, 2.0]",
    'a/y: null -> "digest0"',
  ]
  values["a/y"] = "digest1"
  assert goldens.refresh("a new rounding", path, cases) == [
    'a/y: "digest0" -> "digest1"'
  ]
  data = goldens.load(path)
  assert [e["made_on"] for e in data["environments"]] == [HERE]
  entries = goldens.pinned(data, HERE)
  x, y = entries["a/x"], entries["a/y"]
  assert x["value"] == [1.0, 2.0] and len(x["history"]) == 1  # untouched
  assert y["value"] == "digest1"
  assert [(h["why"], h["old"], h["new"]) for h in y["history"]] == [
    ("first values", None, "digest0"),
    ("a new rounding", "digest0", "digest1"),
  ]
  del values["a/x"]
  assert goldens.refresh("x dropped", path, cases) == ["a/x: removed"]
  assert set(goldens.pinned(goldens.load(path), HERE)) == {"a/y"}


def test_refresh_keeps_the_values_of_other_environments(tmp_path):
  path = tmp_path / "goldens.json"
  elsewhere = {**HERE, "cpu_vector_isa": "elsewhere"}
  theirs = {"a/x": {"value": 1.5, "history": [{"why": "w", "new": 1.5}]}}
  old_format = {"about": "", "made_on": elsewhere, "entries": theirs}
  path.write_text(json.dumps(old_format))
  cases = {"a": lambda: {"a/x": 2.5}}
  assert goldens.refresh("here too", str(path), cases) == ["a/x: null -> 2.5"]
  data = goldens.load(str(path))
  assert goldens.pinned(data, elsewhere) == theirs
  assert goldens.pinned(data, HERE)["a/x"]["value"] == 2.5
  goldens.refresh("only here", str(path), cases, only_here=True)
  data = goldens.load(str(path))
  assert [e["made_on"] for e in data["environments"]] == [HERE]


@pytest.mark.parametrize(
  "why", [None, "", "   "], ids=["missing", "empty", "blank"]
)
def test_refresh_refuses_to_run_without_a_reason(why, tmp_path):
  path = tmp_path / "goldens.json"
  args = [] if why is None else ["--why", why]
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "scripts.refresh_goldens",
      *args,
      "--path",
      str(path),
    ],
    cwd=goldens.ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 2, out.stderr
  assert "--why" in out.stderr
  assert not path.exists()
  with pytest.raises(ValueError, match="say why"):
    goldens.refresh(why or "", str(path), {})

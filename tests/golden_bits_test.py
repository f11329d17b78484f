"""tests/golden_bits.json against the storage recipes computed here.

The file holds, for fixed float32 inputs, every storage recipe's stored
arrays and integer counts after a few steps (experiments/golden_bits.py).
Its values depend only on IEEE float32 arithmetic and the recipes' own
roundings, so they hold on every CPU, and a device must reproduce them;
the `adamw/` records, which run AdamW's arithmetic too, are compared only
on the code path they were made on (the file's `made_with`, or a machine
pinned beside it, keyed as experiments/goldens.py keys its sets).
"""

import json
import os
import subprocess
import sys

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
  reason = golden_bits.not_compared(name, golden_bits.environments(FILE), HERE)
  if reason:
    pytest.skip(reason)
  want = golden_bits.wanted(FILE, name, HERE)
  got = golden_bits.compute([name])[name]
  remedy = golden_bits.PIN if golden_bits.informational(name) else "--write"
  assert golden_bits.first_difference(want, got) is None, (
    golden_bits.first_difference(want, got)
    + f"; if the change is intended: python -m experiments.golden_bits {remedy}"
  )


# One recipe of each family: what the test above checks for every recipe
# with XLA's defaults, here with excess precision off.
NO_EXCESS = sorted(
  {
    n.split("/")[0]: n for n in WANT if not golden_bits.informational(n)
  }.values()
)


@pytest.mark.parametrize("name", NO_EXCESS)
def test_recipe_equals_its_golden_bits_without_excess_precision(name):
  got = golden_bits.compute([name], setting="no_excess_precision")[name]
  assert golden_bits.first_difference(WANT[name], got) is None


@pytest.mark.parametrize("name", NO_EXCESS)
def test_recipe_bits_do_not_depend_on_the_cpu_vector_width(name):
  # XLA:CPU's 512-bit vectors (where the CPU has AVX-512; elsewhere the
  # option changes nothing) vectorise the recipe's loops otherwise; an
  # elementwise recipe with integer counts must store the same bits.
  got = golden_bits.compute([name], setting="cpu_512_bit_vectors")[name]
  assert golden_bits.first_difference(WANT[name], got) is None


def test_the_vector_width_setting_reaches_the_code(tmp_path):
  # The test above means something only where the setting changes the
  # code: on a CPU with AVX-512, the optimized LLVM IR of an elementwise
  # program holds 16-wide float vectors with it and 8-wide without.
  import platform
  import secrets

  import jax
  import jax.numpy as jnp

  from experiments import goldens

  here = goldens.cpu(goldens.read_cpuinfo(), platform.machine())
  if "avx512f" not in (here["cpu_features"] or "").split():
    pytest.skip("no AVX-512 here: XLA:CPU keeps 256-bit vectors either way")
  x = jnp.ones((64, 1024), jnp.float32)
  # A constant of this run's own: a program found in the tests' persistent
  # compilation cache is not compiled, so nothing would be dumped.
  c = np.float32(1 + secrets.randbelow(1 << 16) * 2.0**-20)
  ir = {}
  for setting in ("default", "cpu_512_bit_vectors"):
    options = golden_bits.ALL_SETTINGS[setting]
    dump = tmp_path / setting
    jax.jit(
      lambda v: v * c + 2.0,
      compiler_options={**options, "xla_dump_to": str(dump)},
    ).lower(x).compile()
    ir[setting] = "".join(p.read_text() for p in dump.glob("*ir-with-opt.ll"))
  assert "<8 x float>" in ir["default"] and "<16 x float>" not in ir["default"]
  assert "<16 x float>" in ir["cpu_512_bit_vectors"]


PROBE = """
import jax, jax.numpy as jnp, numpy as np
x = jnp.full((4,), 1 + 2.0**-10, jnp.float32)
print(np.asarray(jax.jit({fn})(x)).tobytes().hex())
"""
# exp of a bfloat16 value, read back as float32: with excess precision XLA
# may compute it in float32 and drop the narrowing to bfloat16.
EXP_BF16 = "lambda v: jnp.exp(v.astype(jnp.bfloat16) * 1.5).astype(jnp.float32)"


def test_a_setting_compiles_as_the_process_wide_flag_does():
  """The no_excess_precision setting, given per program, computes what
  the whole process computes under `--xla_allow_excess_precision=false`
  (run in a process of its own), and the probe tells the two settings
  apart."""
  import jax
  import jax.numpy as jnp

  fn = eval(EXP_BF16, {"jnp": jnp})
  x = jnp.full((4,), 1 + 2.0**-10, jnp.float32)
  here = {
    s: np.asarray(golden_bits._jit(fn, golden_bits.SETTINGS[s])(x))
    for s in golden_bits.SETTINGS
  }
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
  )
  run = subprocess.run(
    [sys.executable, "-c", PROBE.format(fn=EXP_BF16)],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  flagged = np.frombuffer(bytes.fromhex(run.stdout.strip()), np.float32)
  assert here["no_excess_precision"].tobytes() == flagged.tobytes()
  assert here["default"].tobytes() != flagged.tobytes(), jax.devices()
  # Without excess precision the exponential is a bfloat16 value.
  assert flagged[0] == flagged[0].astype(jnp.bfloat16).astype(np.float32)


def test_main_compares_under_each_setting_and_fails_on_a_contract(
  tmp_path, monkeypatch, capsys
):
  diff = "params['w'][0, 1]: expected 1.0, got 1.0078125 (1 of 256 elements)"
  verdicts = {
    "default": {"writeback/x": "equal", "adamw/x": diff},
    "no_excess_precision": {"writeback/x": diff, "adamw/x": "equal"},
  }
  monkeypatch.setattr(
    golden_bits,
    "compare",
    lambda path, names=None, setting="default": verdicts[setting],
  )
  out = tmp_path / "gb.json"
  argv = ["--settings", "default,no_excess_precision", "--json", str(out)]
  assert golden_bits.main(argv) == 1  # a recipe differs without excess
  assert json.loads(out.read_text()) == verdicts
  table = capsys.readouterr().out
  assert f"adamw/x      {diff} (information) | equal" in table
  assert f"writeback/x  equal | {diff}" in table
  assert golden_bits.main(["--settings", "default", "--json", str(out)]) == 0
  assert list(json.loads(out.read_text())) == ["default"]
  with pytest.raises(SystemExit):
    golden_bits.main(["--settings", "default,fast"])
  assert "unknown setting(s) ['fast']" in capsys.readouterr().err


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
    assert "python -m experiments.golden_bits --pin-here" in why
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
  adamw = sorted(n for n in WANT if golden_bits.informational(n))
  for machine in FILE[golden_bits.MACHINES]:  # each pinned CPU: its own
    assert not goldens._unknown(machine["made_on"]), machine["made_on"]
    assert not goldens.same(machine["made_on"], made_with)
    assert sorted(machine["entries"]) == adamw


def _fake_file(tmp_path, made_with):
  """A golden-bits file made on `made_with`, with one record per recipe."""
  record = lambda v: {"arrays": {}, "counts": {"v": v}}  # noqa: E731
  names = ["writeback/bfloat16/nearest"] + [
    "adamw/" + n for n in golden_bits.ADAMW
  ]
  data = {
    "made_with": {"backend": "cpu", **made_with},
    "recipes": {n: record(0) for n in names},
    golden_bits.MACHINES: [],
  }
  path = tmp_path / "golden_bits.json"
  path.write_text(json.dumps(data))
  return path, record


def test_pin_here_adds_this_cpus_adamw_records_beside_the_files(
  tmp_path, monkeypatch
):
  # The file made on an AVX-512 machine; pinned on an AMX one, then on it
  # again (replaced, not repeated), and on the file's own (nothing). Each
  # machine is then given its own AdamW records, and every machine the
  # file's other records.
  avx512, amx = _machine(143, AVX512), _machine(143, AMX)
  path, record = _fake_file(tmp_path, avx512)
  calls = []

  def fake_compute(names=None, setting="default"):
    calls.append(sorted(names))
    return {n: record(len(calls)) for n in names}

  monkeypatch.setattr(golden_bits, "compute", fake_compute)
  monkeypatch.setattr(goldens, "environment", lambda: amx)
  assert "pinned 5 AdamW records" in golden_bits.pin_here(str(path))
  assert "pinned" in golden_bits.pin_here(str(path))
  data = json.loads(path.read_text())
  assert calls == [sorted("adamw/" + n for n in golden_bits.ADAMW)] * 2
  assert [m["made_on"]["cpu_features"] for m in data[golden_bits.MACHINES]] == [
    amx["cpu_features"]
  ]
  name = "adamw/" + golden_bits.ADAMW[0]
  assert golden_bits.wanted(data, name, amx) == record(2)
  assert golden_bits.wanted(data, name, avx512) == record(0)
  assert golden_bits.wanted(data, name, _machine(85, AVX512)) is None
  assert (
    golden_bits.not_compared(name, golden_bits.environments(data), amx) is None
  )
  assert golden_bits.not_compared(
    name, golden_bits.environments(data), _machine(85, AVX512)
  )
  plain = "writeback/bfloat16/nearest"
  assert golden_bits.wanted(data, plain, amx) == record(0)
  monkeypatch.setattr(goldens, "environment", lambda: avx512)
  assert "nothing to pin" in golden_bits.pin_here(str(path))
  assert json.loads(path.read_text()) == data


def test_write_keeps_the_other_cpus_adamw_records(tmp_path, monkeypatch):
  # Remade on a pinned machine, the file becomes that machine's: its own
  # pinned set goes (now the file's), the others stay.
  avx512, amx = _machine(143, AVX512), _machine(143, AMX)
  other = _machine(85, AVX512)
  path, record = _fake_file(tmp_path, avx512)
  data = json.loads(path.read_text())
  data[golden_bits.MACHINES] = [
    {"made_on": m, "entries": {}} for m in (amx, other)
  ]
  path.write_text(json.dumps(data))
  monkeypatch.setattr(golden_bits, "compute", lambda *a, **k: {"r": record(7)})
  monkeypatch.setattr(goldens, "environment", lambda: amx)
  golden_bits.write(str(path))
  data = json.loads(path.read_text())
  assert goldens.same(data["made_with"], amx) and data["recipes"] == {
    "r": record(7)
  }
  assert [m["made_on"] for m in data[golden_bits.MACHINES]] == [other]


def test_pin_here_refuses_an_unreadable_cpu_naming_why(tmp_path, monkeypatch):
  path, _ = _fake_file(tmp_path, _machine(143, AVX512))
  monkeypatch.setattr(goldens, "environment", lambda: {"jax": HERE["jax"]})
  with pytest.raises(ValueError, match="model and features can be read"):
    golden_bits.pin_here(str(path))


def test_the_pin_command_pins_this_cpu_and_compare_then_holds(tmp_path):
  # The command on a copy of the real file, made elsewhere: this CPU's five
  # AdamW records are pinned (once however often it runs), and comparing
  # the copy here finds them equal. On an unreadable CPU the command exits
  # 2 with the reason and leaves the file as it was (tested above).
  copy = tmp_path / "golden_bits.json"
  data = dict(FILE)
  data[golden_bits.MACHINES] = []
  if goldens.same(FILE["made_with"], HERE):  # made here: pretend elsewhere
    data["made_with"] = {**FILE["made_with"], "cpu_model": "elsewhere"}
  copy.write_text(json.dumps(data))
  for _ in range(2):
    run = subprocess.run(
      [sys.executable, "-m", "experiments.golden_bits", "--pin-here"]
      + ["--path", str(copy)],
      capture_output=True,
      text=True,
      cwd=golden_bits.ROOT,
      timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "pinned 5 AdamW records for this machine" in run.stdout
  pinned = json.loads(copy.read_text())
  assert len(pinned[golden_bits.MACHINES]) == 1
  names = ["adamw/" + golden_bits.ADAMW[0]]
  assert golden_bits.compare(str(copy), names) == {names[0]: "equal"}

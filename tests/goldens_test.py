"""Each case of experiments/goldens.py against tests/goldens.json.

The values are exact (losses as float64 from float32, digests of bytes),
one set per environment they were made on (each set's `made_on`: jax and
jaxlib versions, the CPU's architecture, model and the features that change
XLA:CPU's code). On a machine with no set of its own, XLA:CPU runs other
code and floating-point results may differ, so the comparisons skip, with a
message naming the difference, rather than fail. A deliberate change, or a
new machine: `python -m scripts.refresh_goldens --why "..."`.
"""

import json
import os
import subprocess
import sys

import pytest

from experiments import goldens

DATA = goldens.load()
HERE = goldens.environment()
# A machine for the tests of the file's bookkeeping (this one may be unknown).
KNOWN = {
  "jax": HERE["jax"],
  "jaxlib": HERE["jaxlib"],
  "cpu_arch": "x86_64",
  "cpu_model": "GenuineIntel family 6 model 143",
  "cpu_features": "sse4_2 avx fma avx2 avx512f amx_tile",
}


def _check(case, data, here, compute=goldens.compute):
  """The golden test: skips where `data` has no set made on `here`'s code
  path; else computes `case` and compares it with that set."""
  reason = goldens.mismatch([e["made_on"] for e in data["environments"]], here)
  if reason:
    pytest.skip(reason)
  pinned = {
    k: v["value"]
    for k, v in goldens.pinned(data, here).items()
    if k.startswith(case + "/")
  }
  got = json.loads(json.dumps(compute(case)))
  assert sorted(got) == sorted(pinned), "entries changed; " + goldens.REFRESH
  bad = [
    f"{k}: golden {goldens.brief(pinned[k])}, now {goldens.brief(got[k])}"
    for k in sorted(got)
    if got[k] != pinned[k]
  ]
  assert not bad, "\n".join(
    [*bad, f"if the change is intended: {goldens.REFRESH}"]
  )


@pytest.mark.parametrize("case", sorted(goldens.CASES))
def test_case_equals_its_golden_values(case):
  """Skips (does not fail) on a machine or jax/jaxlib version that no set
  of the file was made on: XLA:CPU's floating-point results may differ
  there (e.g. AMX or AVX-512 kernels against AVX2 code)."""
  _check(case, DATA, HERE)


# ---- fake machines -----------------------------------------------------------


def _cpuinfo(head: dict, features: str, processors: int = 2) -> str:
  """/proc/cpuinfo text: `processors` blocks of `head` and the features
  (`flags` on x86, `Features` on arm64)."""
  field = "flags" if "vendor_id" in head else "Features"
  block = [f"{k}\t: {v}" for k, v in head.items()] + [f"{field}\t: {features}"]
  return "\n\n".join(
    "\n".join([f"processor\t: {i}", *block]) for i in range(processors)
  )


def _intel(model: int, features: str) -> str:
  head = {"vendor_id": "GenuineIntel", "cpu family": 6, "model": model}
  return _cpuinfo(head, features)


def _arm(part: str, features: str) -> str:
  head = {"CPU implementer": "0x41", "CPU architecture": 8, "CPU part": part}
  return _cpuinfo(head, features)


X86_BASE = (
  "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat "
  "clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm "
  "constant_tsc rep_good nopl xtopology nonstop_tsc cpuid pni pclmulqdq "
  "ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx "
  "f16c rdrand hypervisor lahf_lm abm 3dnowprefetch fsgsbase bmi1 avx2 "
  "smep bmi2 erms invpcid rdseed adx smap clflushopt xsaveopt xsavec arat"
)
SKYLAKE_AVX512 = X86_BASE + " avx512f avx512dq avx512cd avx512bw avx512vl"
CASCADE_LAKE = SKYLAKE_AVX512 + " avx512_vnni"
COOPER_LAKE = CASCADE_LAKE + " avx512_bf16"
SAPPHIRE_NO_AMX = (
  COOPER_LAKE + " avx512ifma avx512vbmi avx512_vbmi2 gfni avx512_bitalg "
  "avx512_vpopcntdq avx_vnni avx512_fp16"
)
SAPPHIRE_RAPIDS = SAPPHIRE_NO_AMX + " amx_bf16 amx_tile amx_int8"
NEOVERSE_N1 = (
  "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
  "asimdrdm lrcpc dcpop asimddp ssbs"
)
NEOVERSE_V1 = NEOVERSE_N1 + " sve asimdfhm svei8mm svebf16 i8mm bf16"
# The AVX2 machine (a virtual AMD EPYC) that made tests/goldens.json's set.
AVX2_EPYC = _cpuinfo(
  {
    "vendor_id": "AuthenticAMD",
    "cpu family": 23,
    "model": 1,
    "model name": "AMD EPYC",
    "stepping": 2,
  },
  "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 "
  "clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp "
  "lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid "
  "tsc_known_freq pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe "
  "popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm "
  "cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext "
  "ssbd ibpb vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 rdseed adx "
  "smap clflushopt sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr "
  "virt_ssbd arat",
)

# name -> (/proc/cpuinfo text or None for none, architecture)
MACHINES = {
  "amx": (_intel(143, SAPPHIRE_RAPIDS), "x86_64"),
  "avx512_without_amx": (_intel(85, CASCADE_LAKE), "x86_64"),
  "arm64": (_arm("0xd40", NEOVERSE_V1), "aarch64"),
  "no_cpuinfo": (None, "x86_64"),
  "macos_arm64": (None, "arm64"),
  "riscv64": ("processor\t: 0\nisa\t: rv64imafdc\n", "riscv64"),
}


def _here(tmp_path, cpuinfo, arch, versions=HERE):
  """`goldens.environment()` as a machine with this /proc/cpuinfo (None:
  none) and architecture would compute it, with jax/jaxlib `versions`."""
  path = tmp_path / "cpuinfo"
  if cpuinfo is not None:
    path.write_text(cpuinfo)
  env = goldens.environment(str(path), arch)
  return {**env, "jax": versions["jax"], "jaxlib": versions["jaxlib"]}


def _not_computed(case):
  raise AssertionError(f"{case} computed where it must skip")


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_other_machines_skip_and_say_why(machine, tmp_path):
  """The golden test on machines with no set skips, naming what differs
  and how to pin values there, before computing anything."""
  here = _here(tmp_path, *MACHINES[machine])
  expected = {
    "amx": ["CPU features", "amx_tile", "avx512_vnni", "here only"],
    "avx512_without_amx": ["GenuineIntel family 6 model 85 here", "avx512f"],
    "arm64": ["cpu_arch x86_64 there, arm64 here", "sve", "sse4_2 there only"],
    "no_cpuinfo": ["cpu_model, cpu_features cannot be read"],
    "macos_arm64": ["cpu_model, cpu_features cannot be read"],
    "riscv64": ["cpu_model, cpu_features cannot be read"],
  }[machine]
  for case in sorted(goldens.CASES):
    with pytest.raises(pytest.skip.Exception) as skipped:
      _check(case, DATA, here, compute=_not_computed)
    msg = str(skipped.value)
    assert all(word in msg for word in expected), msg
    known = not goldens._unknown(here)
    assert ("refresh_goldens --why" in msg) == known, msg


@pytest.mark.parametrize(
  "cpuinfo",
  [
    _intel(85, SKYLAKE_AVX512),
    _intel(85, CASCADE_LAKE),
    _intel(143, SAPPHIRE_RAPIDS),
  ],
  ids=["skylake", "cascade_lake", "sapphire_rapids"],
)
def test_a_set_keyed_by_the_widest_isa_alone_is_compared_nowhere(
  cpuinfo, tmp_path
):
  """The sets made before the key named the CPU's model and features
  (`cpu_vector_isa` "avx2" / "avx512f") match no machine: every AVX-512
  machine, whatever else it has, skips."""
  legacy = {
    "environments": [
      {
        "made_on": {
          "jax": HERE["jax"],
          "jaxlib": HERE["jaxlib"],
          "cpu_vector_isa": isa,
        },
        "entries": DATA["environments"][0]["entries"],
      }
      for isa in ("avx2", "avx512f")
    ]
  }
  here = _here(tmp_path, cpuinfo, "x86_64")
  with pytest.raises(pytest.skip.Exception) as skipped:
    _check("ops", legacy, here, compute=_not_computed)
  assert "made before the CPU's model and features were recorded" in str(
    skipped.value
  )
  assert goldens.pinned(legacy, here) is None


# (first machine, second machine, what the message names): each pair differs
# in one thing the code XLA:CPU runs depends on.
DIFFERENT = {
  "amx": (
    _intel(143, SAPPHIRE_NO_AMX),
    _intel(143, SAPPHIRE_RAPIDS),
    "amx_bf16 amx_int8 amx_tile here only",
  ),
  "avx512_vnni_same_widest_isa": (
    _intel(85, SKYLAKE_AVX512),
    _intel(85, CASCADE_LAKE),
    "avx512_vnni here only",
  ),
  "avx512_bf16": (
    _intel(85, COOPER_LAKE),
    _intel(85, CASCADE_LAKE),
    "avx512_bf16 there only",
  ),
  "avx512_fp16": (
    _intel(143, SAPPHIRE_NO_AMX.replace(" avx512_fp16", "")),
    _intel(143, SAPPHIRE_NO_AMX),
    "avx512_fp16 here only",
  ),
  "avx_vnni": (
    _intel(151, X86_BASE),
    _intel(151, X86_BASE + " avx_vnni"),
    "avx_vnni here only",
  ),
  "cpu_model": (
    _intel(143, SAPPHIRE_RAPIDS),
    _intel(207, SAPPHIRE_RAPIDS),
    "cpu_model GenuineIntel family 6 model 143 there",
  ),
  "sve": (
    _arm("0xd40", NEOVERSE_V1),
    _arm("0xd40", NEOVERSE_V1.replace(" sve ", " ")),
    "sve there only",
  ),
}


@pytest.mark.parametrize("pair", sorted(DIFFERENT))
def test_the_key_tells_code_paths_apart(pair, tmp_path):
  """Values made on one machine of each pair are not compared on the
  other: dropping a feature from the key, keying by the widest ISA alone,
  or leaving the CPU model out breaks one of these."""
  made, here, words = DIFFERENT[pair]
  arch = "aarch64" if "0x41" in made else "x86_64"
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  made_on = _here(tmp_path / "a", made, arch)
  here = _here(tmp_path / "b", here, arch)
  assert not goldens.same(made_on, here)
  assert words in goldens.mismatch(made_on, here)
  data = {"environments": [{"made_on": made_on, "entries": {}}]}
  assert goldens.pinned(data, here) is None


def test_the_key_ignores_what_does_not_change_the_code(tmp_path):
  """One machine reads as the same key with flags XLA does not use
  (mitigations, hypervisor), another order, spelling or processor count;
  and a set's own key, read back from JSON, selects it."""
  base = _intel(143, SAPPHIRE_RAPIDS)
  other = _cpuinfo(
    {"vendor_id": "GenuineIntel", "cpu family": 6, "model": 143},
    " ".join(reversed(SAPPHIRE_RAPIDS.split())).replace(
      "avx512_vnni", "avx512vnni"
    )
    + " md_clear flush_l1d ibpb arch_capabilities",
    processors=8,
  )
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  made_on = json.loads(json.dumps(_here(tmp_path / "a", base, "x86_64")))
  here = _here(tmp_path / "b", other, "AMD64")
  assert goldens.same(made_on, here)
  assert goldens.mismatch([made_on], here) is None
  assert "amx_tile" in here["cpu_features"]
  assert "hypervisor" not in here["cpu_features"]


def test_the_avx2_epyc_that_made_the_set_compares_it(tmp_path):
  """The machine the file's AVX2 set was made on finds that set (so the
  golden test compares there instead of skipping): read from its
  /proc/cpuinfo, with the set's own jax/jaxlib versions."""
  sets = [e for e in DATA["environments"] if e["made_on"].get("cpu_model")]
  made_on = [e["made_on"] for e in sets]
  here = _here(tmp_path, AVX2_EPYC, "x86_64", versions=made_on[-1])
  assert here["cpu_features"] == "sse4_1 sse4_2 avx f16c fma avx2"
  assert goldens.mismatch(made_on, here) is None
  entries = goldens.pinned(DATA, here)
  assert sorted({k.split("/")[0] for k in entries}) == sorted(goldens.CASES)
  # The golden test takes its comparison branch there (and fails on a
  # changed value, showing it compared).
  wrong = {k: "changed" for k in entries if k.startswith("trace/")}
  with pytest.raises(AssertionError, match="trace/bfloat16: golden"):
    _check("trace", DATA, here, compute=lambda case: wrong)


def test_every_set_is_compared_on_its_own_machine():
  for env in DATA["environments"]:
    here = json.loads(json.dumps(env["made_on"]))
    made_on = [e["made_on"] for e in DATA["environments"]]
    assert goldens.mismatch(made_on, here) is None
    assert goldens.pinned(DATA, here) is env["entries"]


def test_a_fresh_process_reads_the_same_key():
  """`scripts.refresh_goldens` runs in a plain process, the tests under
  pytest with 8 devices and other flags: both must read this machine as
  the same environment, or a machine would never compare its own set."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
  env["JAX_ENABLE_X64"] = "1"
  out = subprocess.run(
    [
      sys.executable,
      "-c",
      "import json; from experiments import goldens; "
      "print(json.dumps(goldens.environment()))",
    ],
    cwd=goldens.ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert json.loads(out.stdout) == HERE


def test_a_case_runs_on_one_cpu_without_the_callers_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX")
  monkeypatch.setenv("JAX_ENABLE_X64", "1")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/cache/")
  env = goldens.pinned_env()
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
  assert "JAX_ENABLE_X64" not in env and env["JAX_PLATFORMS"] == "cpu"
  # Its own cache, the same one for the runs a case starts in turn.
  assert env["JAX_COMPILATION_CACHE_DIR"] == "/tmp/cache-goldens"
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/cache-goldens")
  assert goldens.pinned_env()["JAX_COMPILATION_CACHE_DIR"] == (
    "/tmp/cache-goldens"
  )
  env.pop("JAX_COMPILATION_CACHE_DIR")
  if not hasattr(os, "sched_getaffinity"):
    pytest.skip("no CPU affinity on this system")
  out = subprocess.run(
    [
      sys.executable,
      "-c",
      "import os; from experiments import goldens; goldens._one_cpu(); "
      "import jax; print(len(os.sched_getaffinity(0)), jax.device_count())",
    ],
    cwd=goldens.ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert out.stdout.split() == ["1", "1"]


# ---- the file ----------------------------------------------------------------


def test_goldens_file_names_where_it_was_made_and_every_case():
  envs = goldens.load()["environments"]
  assert envs
  made_on = [e["made_on"] for e in envs]
  assert len({json.dumps(m, sort_keys=True) for m in made_on}) == len(envs)
  for env in envs:
    assert set(env["made_on"]) == set(goldens.KEY)
    assert not goldens._unknown(env["made_on"]), env["made_on"]
    cases = {k.split("/")[0] for k in env["entries"]}
    assert cases == set(goldens.CASES), env["made_on"]
    for name, entry in env["entries"].items():
      history = entry["history"]
      assert history and history[-1]["new"] == entry["value"], name
      assert all(h["why"].strip() for h in history), name


def test_mismatch_names_the_difference():
  here = {
    "jax": "0.10.2",
    "jaxlib": "0.10.2",
    "cpu_arch": "x86_64",
    "cpu_model": "GenuineIntel family 6 model 85",
    "cpu_features": "sse4_2 avx avx2 avx512f avx512_vnni",
  }
  assert goldens.mismatch(dict(here), here) is None
  other = {**here, "cpu_features": "sse4_2 avx avx2", "jaxlib": "0.0.1"}
  msg = goldens.mismatch(other, here)
  assert "jaxlib 0.0.1 there, 0.10.2 here" in msg
  assert "CPU features avx512_vnni avx512f here only" in msg
  assert "refresh_goldens --why" in msg
  # Several environments: none of them here names each; one here holds.
  msg = goldens.mismatch([other, {**here, "jax": "0.0.2"}], here)
  assert "jaxlib 0.0.1" in msg and "jax 0.0.2" in msg
  assert goldens.mismatch([other, dict(here)], here) is None
  # Unknown fields match nothing, not even each other.
  unknown = {**here, "cpu_model": None}
  assert "cpu_model cannot be read" in goldens.mismatch(unknown, unknown)


def test_refresh_records_why_and_what_changed(tmp_path):
  path = str(tmp_path / "goldens.json")
  values = {"a/x": [1.0, 2.0], "a/y": "digest0"}
  cases = {"a": lambda: dict(values)}
  assert goldens.refresh("first values", path, cases, here=KNOWN) == [
    "a/x: null -> [1.0, 2.0]",
    'a/y: null -> "digest0"',
  ]
  values["a/y"] = "digest1"
  assert goldens.refresh("a new rounding", path, cases, here=KNOWN) == [
    'a/y: "digest0" -> "digest1"'
  ]
  data = goldens.load(path)
  assert [e["made_on"] for e in data["environments"]] == [KNOWN]
  entries = goldens.pinned(data, KNOWN)
  x, y = entries["a/x"], entries["a/y"]
  assert x["value"] == [1.0, 2.0] and len(x["history"]) == 1  # untouched
  assert y["value"] == "digest1"
  assert [(h["why"], h["old"], h["new"]) for h in y["history"]] == [
    ("first values", None, "digest0"),
    ("a new rounding", "digest0", "digest1"),
  ]
  del values["a/x"]
  assert goldens.refresh("x dropped", path, cases, here=KNOWN) == [
    "a/x: removed"
  ]
  assert set(goldens.pinned(goldens.load(path), KNOWN)) == {"a/y"}


def test_refresh_keeps_the_values_of_other_environments(tmp_path):
  path = tmp_path / "goldens.json"
  elsewhere = {**KNOWN, "cpu_model": "elsewhere"}
  theirs = {"a/x": {"value": 1.5, "history": [{"why": "w", "new": 1.5}]}}
  old_format = {"about": "", "made_on": elsewhere, "entries": theirs}
  path.write_text(json.dumps(old_format))
  cases = {"a": lambda: {"a/x": 2.5}}
  assert goldens.refresh("here too", str(path), cases, here=KNOWN) == [
    "a/x: null -> 2.5"
  ]
  data = goldens.load(str(path))
  assert goldens.pinned(data, elsewhere) == theirs
  assert goldens.pinned(data, KNOWN)["a/x"]["value"] == 2.5
  goldens.refresh("only here", str(path), cases, True, KNOWN)
  data = goldens.load(str(path))
  assert [e["made_on"] for e in data["environments"]] == [KNOWN]


def test_refresh_refuses_a_machine_it_cannot_identify(tmp_path):
  """Values pinned where the CPU cannot be read could not be told apart
  from another machine's: refused, and nothing is written."""
  path = tmp_path / "goldens.json"
  here = _here(tmp_path, None, "arm64")
  with pytest.raises(ValueError, match="cpu_model, cpu_features cannot be"):
    goldens.refresh("why", str(path), {"a": lambda: {"a/x": 1}}, here=here)
  assert not path.exists()


def test_refresh_command_on_an_unidentified_machine_says_so_in_one_line(
  monkeypatch, tmp_path, capsys
):
  """`python -m scripts.refresh_goldens` where /proc/cpuinfo is missing:
  one line naming what cannot be read, exit status 2, nothing written."""
  from scripts import refresh_goldens

  monkeypatch.setattr(goldens, "read_cpuinfo", lambda path: None)
  path = tmp_path / "goldens.json"
  with pytest.raises(SystemExit) as stopped:
    refresh_goldens.main(["--why", "a new machine", "--path", str(path)])
  assert stopped.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "cannot be read" in err, err
  assert not path.exists()


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

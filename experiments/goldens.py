"""Golden values: results pinned on CPU, so that any change to them shows.

Other tests compare a run with another run, and both move together when the
numerics change. These cases are compared with fixed values in
`tests/goldens.json` (by `tests/goldens_test.py`):

  smoke      `configs/smoke.py` through the real entry point on one CPU
             device: per arm, the loss of each of its 8 steps and the
             parameter digest (`summary.json`'s `param_digest`).
  writeback  5 steps of AdamW (learning rate 3e-2) and
             `lowprec.writeback("float8_e4m3fn", ...)`,
             nearest and stochastic, on a fixed least-squares problem
             (weights: float32 holding float8 values): the sha256 of the
             weights' bytes.
  trace      `lowprec.freeze.reference_trace` for bfloat16 and
             float8_e4m3fn on the same problem in float32 (AdamW, learning
             rate 1e-3): the predicted erased fraction at each of 5 steps.
  ops        `ops.Attention` and `ops.NormDense` with float8 roundings
             (stochastic) under a fixed key: the sha256 of the bytes of
             every input's gradient.

Floating-point results depend on the code XLA:CPU runs, and that code is
chosen by the machine: LLVM compiles for the host CPU (its model and every
feature it has: AVX-512 subsets, AVX-VNNI, AMX, SVE...), and the kernel
libraries pick their kernels from the same features at run time. So the
file holds one set of values per environment it was made on (`made_on`:
jax and jaxlib versions, `cpu_arch`, `cpu_model` and `cpu_features`, see
`environment`), and the tests compare the set made on exactly this kind of
machine, or skip, naming what differs. Each case runs in a fresh process
pinned to one CPU, with one CPU device and fixed XLA flags (`compute`), so
the number of cores, the caller's `XLA_FLAGS` and JAX settings do not
enter. To change the values on purpose, or to pin them on a new kind of
machine:

  python -m scripts.refresh_goldens --why "what changed and why"

which recomputes every case here, rewrites this environment's set (the
others are kept as they are) and adds, to each entry whose value changed,
the reason and the old and new value. A change of the numerics moves the
values of every environment: refresh on each kind of machine, or drop the
sets that can no longer be made (`--only-here`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable

from experiments import xla_flags  # noqa: F401  (before jax starts)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDENS = os.path.join(ROOT, "tests", "goldens.json")
REFRESH = 'python -m scripts.refresh_goldens --why "..."'
CPUINFO = "/proc/cpuinfo"


# ---- where the values were made ----------------------------------------------

# What a set of values is keyed by: they are compared only where every
# field is equal (and known).
KEY = ("jax", "jaxlib", "cpu_arch", "cpu_model", "cpu_features")

# CPU features that change the code XLA:CPU generates (LLVM is handed every
# feature of the host CPU) or the kernels its libraries (XNNPACK/YNNPACK,
# oneDNN) pick at run time, in /proc/cpuinfo's spelling. Features outside
# these lists that a new CPU brings come with a new `cpu_model`.
X86_FEATURES = tuple(
  """sse4_1 sse4_2 avx f16c fma fma4 avx2 avx512f avx512cd avx512bw avx512dq
  avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg
  avx512_vpopcntdq avx512_bf16 avx512_fp16 avx512_vp2intersect avx_vnni
  avx_vnni_int8 avx_ne_convert avx_ifma gfni amx_tile amx_bf16 amx_int8
  amx_fp16 amx_complex""".split()
)
ARM64_FEATURES = tuple(
  """asimd fphp asimdhp asimdrdm asimddp asimdfhm bf16 i8mm sve sve2 svebf16
  svei8mm svef32mm svef64mm sme sme2""".split()
)
_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64"}


def _spelling(feature: str) -> str:
  """One spelling for `avx512_vnni`, `avx512vnni`, `amx-tile`, ..."""
  return feature.lower().replace("_", "").replace("-", "")


def _processors(cpuinfo: str) -> list[dict[str, str]]:
  """/proc/cpuinfo as one `{field: value}` per block (processor)."""
  blocks, block = [], {}
  for line in [*cpuinfo.splitlines(), ""]:
    field, sep, value = line.partition(":")
    if sep:
      block[field.strip().lower()] = value.strip()
    elif not line.strip() and block:
      blocks.append(block)
      block = {}
  return blocks


def read_cpuinfo(path: str = CPUINFO) -> str | None:
  """The text of `path` (/proc/cpuinfo), or None where there is none."""
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return None


# arch -> (field of the features, fields naming the CPU, their form, features)
_LAYOUT = {
  "x86_64": (
    "flags",
    ("vendor_id", "cpu family", "model"),
    "{} family {} model {}",
    X86_FEATURES,
  ),
  "arm64": (
    "features",
    ("cpu implementer", "cpu part"),
    "implementer {} part {}",
    ARM64_FEATURES,
  ),
}


def cpu(cpuinfo: str | None, arch: str) -> dict[str, str | None]:
  """The CPU part of an environment: what XLA:CPU's code depends on.

  Args:
    cpuinfo: the text of /proc/cpuinfo, or None.
    arch: the machine's architecture (`platform.machine()`).

  Returns:
    `cpu_arch` (`x86_64`, `arm64`, ...); `cpu_model`, what LLVM names the
    CPU it tunes for from (x86: vendor, family and model; arm64:
    implementer and part; each distinct one of the processors);
    `cpu_features`, those of `X86_FEATURES` / `ARM64_FEATURES` the CPU
    has, space-separated. A field that cannot be read (no /proc/cpuinfo,
    another architecture) is None, and an environment with a None field
    matches none.
  """
  arch = _ARCH.get(arch.lower(), arch.lower()) or "unknown"
  if arch not in _LAYOUT:
    return {"cpu_arch": arch, "cpu_model": None, "cpu_features": None}
  field, names, form, wanted = _LAYOUT[arch]
  blocks = _processors(cpuinfo or "")
  models = {
    form.format(*(b[k] for k in names))
    for b in blocks
    if all(b.get(k) for k in names)
  }
  features = None
  if any(field in b for b in blocks):
    have = {_spelling(f) for b in blocks for f in b.get(field, "").split()}
    features = " ".join(f for f in wanted if _spelling(f) in have)
  return {
    "cpu_arch": arch,
    "cpu_model": " + ".join(sorted(models)) or None,
    "cpu_features": features,
  }


def environment(
  cpuinfo_path: str = CPUINFO, arch: str | None = None
) -> dict[str, str | None]:
  """What floating-point results here depend on (`KEY`): jax and jaxlib
  versions and the CPU (`cpu`, read from `cpuinfo_path`)."""
  import jax
  import jaxlib

  here = cpu(read_cpuinfo(cpuinfo_path), arch or platform.machine())
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, **here}


def _unknown(env: dict) -> list[str]:
  return [k for k in KEY if env.get(k) is None]


def same(made_on: dict, here: dict) -> bool:
  """Whether values made on `made_on` were made on the code path `here`
  takes: every field of `KEY` known and equal (features as sets)."""
  if _unknown(made_on) or _unknown(here):
    return False
  features = [set(e["cpu_features"].split()) for e in (made_on, here)]
  return features[0] == features[1] and all(
    made_on[k] == here[k] for k in KEY if k != "cpu_features"
  )


def _difference(made_on: dict, here: dict) -> str:
  """What differs between `made_on` and `here`, in words."""
  if _unknown(made_on):
    return (
      f"made before the CPU's model and features were recorded "
      f"({json.dumps(made_on, sort_keys=True)})"
    )
  out = []
  for k in KEY:
    if k == "cpu_features":
      there, mine = (set(e[k].split()) for e in (made_on, here))
      if mine - there:
        out.append(f"CPU features {' '.join(sorted(mine - there))} here only")
      if there - mine:
        out.append(f"CPU features {' '.join(sorted(there - mine))} there only")
    elif made_on[k] != here[k]:
      out.append(f"{k} {made_on[k]} there, {here[k]} here")
  return "; ".join(out)


def mismatch(made_on, here: dict, remedy: str = REFRESH) -> str | None:
  """Why values made on `made_on` (one environment, or a list of them)
  may not hold `here` (None: one of them is this environment's code path).
  `remedy` is the command that pins values here."""
  if _unknown(here):
    return (
      f"this machine's {', '.join(_unknown(here))} cannot be read (from "
      f"{CPUINFO}, on x86-64 and arm64), so no pinned value can be shown to "
      "be made on its code path: the goldens are not compared here, and "
      "cannot be pinned here"
    )
  envs = [made_on] if isinstance(made_on, dict) else list(made_on)
  if any(same(e, here) for e in envs):
    return None
  diff = " | ".join(_difference(e, here) for e in envs)
  return (
    f"the goldens were made on other machines ({diff or 'none made'}): "
    "XLA:CPU runs other code there, so they are not compared. "
    f"To pin values for this machine: {remedy}"
  )


# ---- the cases ---------------------------------------------------------------


def _sha256(*arrays) -> str:
  import numpy as np

  h = hashlib.sha256()
  for a in arrays:
    a = np.asarray(a)
    h.update(f"{a.dtype.name}{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def smoke() -> dict:
  """`configs/smoke.py` through `experiments.run`, one CPU device."""
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run(
      [
        sys.executable,
        "-m",
        "experiments.run",
        "--config=configs/smoke.py",
        f"--config.log.results_dir={tmp}",
      ],
      cwd=ROOT,
      env=pinned_env(),
      check=True,
      capture_output=True,
      timeout=1800,
    )
    study = os.path.join(tmp, "smoke")
    for arm in sorted(os.listdir(study)):
      d = os.path.join(study, arm, "seed0")
      with open(os.path.join(d, "summary.json")) as f:
        digest = json.load(f)["param_digest"]
      with open(os.path.join(d, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
      losses = [r["loss"] for r in lines if "loss" in r]
      out[f"smoke/{arm}"] = {"losses": losses, "param_digest": digest}
  return out


def _least_squares():
  """A fixed problem: 64 rows, 16 weights, float32."""
  import jax
  import jax.numpy as jnp

  x = jax.random.normal(jax.random.key(0), (64, 16))
  y = x @ jax.random.normal(jax.random.key(1), (16,))
  w0 = 0.5 * jax.random.normal(jax.random.key(3), (16,))
  return w0, jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))


def writeback() -> dict:
  import jax
  import optax

  import lowprec

  w0, grad = _least_squares()
  out = {}
  for rounding in ("nearest", "stochastic"):
    wb = lowprec.writeback("float8_e4m3fn", rounding, key=jax.random.key(2))
    opt = optax.chain(optax.adamw(3e-2), wb)
    w = lowprec.to_grid(w0, "float8_e4m3fn")  # float32 holding the grid
    state = opt.init(w)
    step = jax.jit(lambda w, s, opt=opt: opt.update(grad(w), s, w))
    for _ in range(5):
      updates, state = step(w, state)
      w = optax.apply_updates(w, updates)
    out[f"writeback/{rounding}"] = _sha256(w)
  return out


def trace() -> dict:
  import jax
  import optax

  import lowprec
  from lowprec import freeze

  w, grad = _least_squares()
  targets = ("bfloat16", "float8_e4m3fn")
  opt = optax.chain(optax.adamw(1e-3), freeze.reference_trace(list(targets)))
  state = opt.init(w)
  step = jax.jit(lambda w, s: opt.update(grad(w), s, w))
  curves = {t: [] for t in targets}
  for _ in range(5):
    updates, state = step(w, state)
    w = optax.apply_updates(w, updates)
    tel = lowprec.telemetry(state)
    for t in targets:
      curves[t].append(tel[f"pred/{t}/erased_fraction"])
  return {f"trace/{t}": curves[t] for t in targets}


def operators() -> dict:
  import jax
  import numpy as np

  from lowprec import ops

  def normal(seed, shape, scale=1.0, shift=0.0):
    r = np.random.default_rng(seed)
    return (shift + scale * r.standard_normal(shape)).astype(np.float32)

  fp8 = ops.Rounding("float8_e4m3fn", "stochastic")
  cases = {
    "ops/attention": (
      ops.Attention(probs=fp8, out=fp8, grad="float8_e5m2:stochastic"),
      "attn.probs@dv=rounded,attn.probs@dscores=fresh,attn.out@delta=fresh",
      tuple(normal(i, (1, 8, 2, 8)) for i in range(3)),
    ),
    "ops/norm_dense": (
      ops.NormDense(out=fp8, kernel="float8_e4m3fn"),
      "norm.out@dw=rounded,norm.out@.*=original,dense.kernel@dx=rounded",
      (
        normal(0, (8, 16)),
        normal(1, (16,), 0.1, 1.0),
        normal(2, (16,), 0.1),
        normal(3, (16, 8), 0.25),
        np.zeros(8, np.float32),
      ),
    ),
  }
  out = {}
  for name, (op, policy, inputs) in cases.items():
    key = jax.random.key(0)

    def loss(args, op=op, policy=policy, key=key):
      y = op(*args, policy=policy, key=key)
      return (y * y).sum()

    grads = jax.jit(jax.grad(loss))(inputs)
    out[name] = _sha256(*grads)
  return out


# case name -> function returning {entry name: JSON value}
CASES: dict[str, Callable[[], dict]] = {
  "smoke": smoke,
  "writeback": writeback,
  "trace": trace,
  "ops": operators,
}

# ---- one case in a fresh process ---------------------------------------------

# Environment variables a case process keeps of its caller's JAX_* / XLA_*:
# the persistent compilation cache (whose programs are the compiled ones).
_CACHE_VARIABLES = ("JAX_PERSISTENT_CACHE_", "JAX_ENABLE_COMPILATION_CACHE")


def pinned_env() -> dict[str, str]:
  """The environment a case runs in: the CPU backend, one device, the
  XLA flags of `experiments.xla_flags` only, no other JAX setting.

  XLA:CPU splits some work across its devices' threads, and the split
  changes last bits, so the device count is fixed; the caller's flags and
  settings (`--xla_cpu_max_isa`, `JAX_ENABLE_X64`...) could change the
  code too. A compilation cache is kept, in a directory of its own: it only
  ever holds programs compiled under these settings on one CPU.
  """
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_", "XLA_")) or k.startswith(_CACHE_VARIABLES)
  }
  env.pop("LOWPREC_FAULT", None)
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "").rstrip("/")
  if cache:  # the same directory in a case's process and what it starts
    env["JAX_COMPILATION_CACHE_DIR"] = cache.removesuffix("-goldens") + (
      "-goldens"
    )
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  return env


def compute(case: str) -> dict:
  """Case `case` of `CASES` computed in a fresh process (`pinned_env`)
  that runs on one CPU, so that XLA:CPU's threads split nothing
  differently on a machine with more or fewer cores.

  Raises:
    RuntimeError: the case failed (with the end of its error output).
  """
  out = subprocess.run(
    [sys.executable, "-m", "experiments.goldens", case],
    cwd=ROOT,
    env=pinned_env(),
    capture_output=True,
    text=True,
    timeout=3600,
  )
  if out.returncode != 0:
    raise RuntimeError(f"golden case {case} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.splitlines()[-1])


def _one_cpu() -> None:
  """Keeps this process (and what it starts) on one CPU: XLA:CPU sizes its
  thread pool from the CPUs a process may use."""
  if "jax" in sys.modules:
    raise RuntimeError("pin the CPU before jax starts")
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def main(argv=None) -> int:
  """`python -m experiments.goldens CASE`: prints the case's entries as one
  line of JSON (what `compute` runs)."""
  args = sys.argv[1:] if argv is None else argv
  if len(args) != 1 or args[0] not in CASES:
    print(f"usage: python -m experiments.goldens {{{','.join(CASES)}}}")
    return 2
  _one_cpu()
  print(json.dumps(CASES[args[0]]()))
  return 0


# ---- the file ----------------------------------------------------------------


def load(path: str = GOLDENS) -> dict:
  """The goldens file as `{"about", "environments": [{"made_on",
  "entries"}, ...]}` (a file of one environment, `{"made_on", "entries"}`,
  is read as a list of one)."""
  with open(path) as f:
    data = json.load(f)
  if "environments" not in data:
    data = {
      "about": data.get("about", ""),
      "environments": [
        {"made_on": data["made_on"], "entries": data["entries"]}
      ],
    }
  return data


def pinned(data: dict, here: dict) -> dict | None:
  """The entries `data` holds for environment `here` (`same`), or None."""
  for env in data["environments"]:
    if same(env["made_on"], here):
      return env["entries"]
  return None


def refresh(
  why: str,
  path: str = GOLDENS,
  cases=None,
  only_here: bool = False,
  here: dict | None = None,
) -> list[str]:
  """Recomputes every case here and rewrites this environment's values.

  Each entry keeps its value and its history when the value is unchanged;
  a changed or new entry gets the new value and a history record
  `{"why": why, "old": ..., "new": ...}` (`old` None when new). The values
  of other environments are kept, unless `only_here`.

  Args:
    why: the reason, recorded with each change.
    path: the goldens file.
    cases: `{case: function returning its entries}`; default every case of
      `CASES`, each computed by `compute`.
    only_here: drop the sets of other environments.
    here: this environment (default `environment()`).

  Returns:
    One line per change (`name: old -> new`), or none.

  Raises:
    ValueError: `why` is empty, or this machine's CPU cannot be read (its
      values could not be told apart from another machine's).
  """
  if not why or not why.strip():
    raise ValueError(
      f"say why the goldens change: {REFRESH} (the reason is recorded)"
    )
  here = environment() if here is None else here
  if _unknown(here):
    raise ValueError(mismatch([], here))
  if cases is None:
    cases = {c: functools.partial(compute, c) for c in CASES}
  old = load(path) if os.path.exists(path) else {"environments": []}
  before_here = pinned(old, here) or {}
  entries = {}
  changes = []
  for case in cases.values():
    for name, value in case().items():
      value = json.loads(json.dumps(value))  # as the file will hold it
      before = before_here.get(name)
      if before is not None and before["value"] == value:
        entries[name] = before
        continue
      prev = None if before is None else before["value"]
      history = [] if before is None else before["history"]
      record = {"why": why.strip(), "made_on": here, "old": prev, "new": value}
      entries[name] = {"value": value, "history": [*history, record]}
      changes.append(f"{name}: {brief(prev)} -> {brief(value)}")
  for name in sorted(set(before_here) - set(entries)):
    changes.append(f"{name}: removed")
  others = [] if only_here else [
    e for e in old["environments"] if not same(e["made_on"], here)
  ]  # fmt: skip
  mine = {"made_on": here, "entries": dict(sorted(entries.items()))}
  data = {
    "about": "Pinned results, one set per environment; see "
    "experiments/goldens.py. Refresh: " + REFRESH,
    "environments": [*others, mine],
  }
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    json.dump(data, f, indent=2)
    f.write("\n")
  os.replace(tmp, path)
  return changes


def brief(value) -> str:
  """`value` as JSON, cut to 80 characters."""
  text = json.dumps(value)
  return text if len(text) <= 80 else text[:77] + "..."


if __name__ == "__main__":
  sys.exit(main())

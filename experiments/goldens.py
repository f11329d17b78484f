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

Floating-point results can differ between jax/jaxlib versions and between
CPUs (XLA:CPU and its kernels run other code with AVX-512 than with AVX2),
so the file holds one set of values per environment it was made on
(`environments`, each with its `made_on`), and the tests compare the set
made here, or skip where there is none. To change the values on purpose,
or to pin them on a new kind of machine:

  python -m scripts.refresh_goldens --why "what changed and why"

which recomputes every case here, rewrites this environment's set (the
others are kept as they are) and adds, to each entry whose value changed,
the reason and the old and new value. A change of the numerics moves the
values of every environment: refresh on each kind of machine, or drop the
sets that can no longer be made (`--only-here`).
"""

from __future__ import annotations

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


# ---- where the values were made ----------------------------------------------


def cpu_vector_isa() -> str:
  """The widest x86 vector extension the CPU has (`avx512f`, `avx2`, ...),
  from /proc/cpuinfo; else the machine name (e.g. `arm64`)."""
  flags = set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          flags = set(line.split(":", 1)[1].split())
          break
  except OSError:
    pass
  for isa in ("avx512f", "avx2", "avx", "sse4_2"):
    if isa in flags:
      return isa
  return platform.machine() or "unknown"


def environment() -> dict[str, str]:
  """What floating-point results here depend on: versions and vector ISA."""
  import jax
  import jaxlib

  return {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "cpu_vector_isa": cpu_vector_isa(),
  }


def _difference(made_on: dict, here: dict) -> list[str]:
  return [
    f"{k} {made_on.get(k)} there, {here.get(k)} here"
    for k in sorted(set(made_on) | set(here))
    if made_on.get(k) != here.get(k)
  ]


def mismatch(made_on, here: dict) -> str | None:
  """Why values made on `made_on` (one environment, or a list of them)
  may not hold `here` (None: one of them is this environment)."""
  envs = [made_on] if isinstance(made_on, dict) else list(made_on)
  if any(not _difference(e, here) for e in envs):
    return None
  diff = " | ".join("; ".join(_difference(e, here)) for e in envs)
  return (
    f"the goldens were made elsewhere ({diff or 'none made'}): "
    "floating-point results may differ, so they are not compared. "
    f"To pin this environment too: {REFRESH}"
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
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("LOWPREC_FAULT", None)
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
      env=env,
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
  """The entries `data` holds for environment `here`, or None."""
  for env in data["environments"]:
    if env["made_on"] == here:
      return env["entries"]
  return None


def refresh(
  why: str, path: str = GOLDENS, cases=None, only_here: bool = False
) -> list[str]:
  """Recomputes every case here and rewrites this environment's values.

  Each entry keeps its value and its history when the value is unchanged;
  a changed or new entry gets the new value and a history record
  `{"why": why, "old": ..., "new": ...}` (`old` None when new). The values
  of other environments are kept, unless `only_here`.

  Returns:
    One line per change (`name: old -> new`), or none.

  Raises:
    ValueError: `why` is empty.
  """
  if not why or not why.strip():
    raise ValueError(
      f"say why the goldens change: {REFRESH} (the reason is recorded)"
    )
  cases = CASES if cases is None else cases
  old = load(path) if os.path.exists(path) else {"environments": []}
  here = environment()
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
    e for e in old["environments"] if e["made_on"] != here
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

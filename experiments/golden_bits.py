"""Golden bits: every storage recipe's stored outputs on fixed proposals.

Each recipe (a write-back, a compensated write-back, a stored optimizer
state) runs a few steps on fixed float32 inputs: the proposals `u` of a
write-back, or the new float32 state of a stored moment, are constants
here, not an optimizer's arithmetic, so the only floating-point work is
the recipe's own (an add, a rounding on bit patterns, a scale). Its
results are therefore the same on every backend that computes IEEE
float32 correctly and keeps every rounding the recipe asks for: the file
`tests/golden_bits.json`, made on CPU, is what a GPU or TPU must give bit
for bit. `tests/golden_bits_test.py` checks it on CPU; the device check
(`scripts/device_check.sh`) checks it there, in one process under each of
`SETTINGS` (XLA's default options, and excess precision off, given to
each recipe's compiled update), and reports per recipe and setting
`equal` or the first element that differs with both values.

Recorded per recipe, after the last step: every stored array (weights,
buffers, remainders, stored moments and their scales) as the bytes of its
dtype, and every integer count of its telemetry. Float sums of the
telemetry (`carried`, `lost_mass`) are left out: their reduction order is
the backend's choice. The `adamw/` records run AdamW's own arithmetic
before the recipe, so they are information: the CPU test compares them only
on the code path they were made on (a `made_with`: jax, jaxlib and the
CPU's architecture, model and features, as experiments/goldens.py keys its
sets), and skips them, naming the difference, elsewhere. Beside the file's
own, it holds the AdamW records of other CPUs (`adamw_on_other_machines`,
added with `--pin-here`), so that they are compared there too.

  python -m experiments.golden_bits --write     # remake the file (CPU)
  python -m experiments.golden_bits --pin-here  # this CPU's AdamW records
  python -m experiments.golden_bits             # compare here, print a table
  python -m experiments.golden_bits --settings default,no_excess_precision \
      --json OUT.json                         # both settings, one process
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import numpy as np

from experiments import goldens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_BITS = os.path.join(ROOT, "tests", "golden_bits.json")
WRITE = "python -m experiments.golden_bits --write"
PIN = "python -m experiments.golden_bits --pin-here"
# The file's key for the AdamW records of machines other than its own:
# a set per machine, `{"made_on", "entries"}` as experiments/goldens.py
# keeps its sets.
MACHINES = "adamw_on_other_machines"
STEPS = 4
SHAPE = (4, 64)  # the last axis holds two MX blocks of 32
# The compile options a comparison runs under (`--settings`), given to
# each recipe's jitted update, where its arithmetic runs (its init and
# `optax.apply_updates` run op by op): XLA's defaults, and excess
# precision off, under which XLA keeps every narrowing conversion it would
# otherwise drop or compute wider (docs/compiler.md). One process compares
# under both; the update is compiled once per setting.
SETTINGS = {
  "default": {},
  "no_excess_precision": {"xla_allow_excess_precision": False},
}
# Options of XLA:CPU's code generation alone (a GPU or TPU ignores them),
# compared on the CPU only: vectors of 512 bits where the CPU has AVX-512
# (XLA:CPU prefers 256 by default). Every recipe is elementwise with
# integer counts, so its stored bits must not depend on the vector width;
# a step so compiled runs the rounding 1.2-1.4x faster on such a CPU
# (docs/benchmarks.md).
CPU_SETTINGS = {"cpu_512_bit_vectors": {"xla_cpu_prefer_vector_width": 512}}
ALL_SETTINGS = {**SETTINGS, **CPU_SETTINGS}


# ---- fixed inputs ------------------------------------------------------------


def _rng(seed: int):
  return np.random.default_rng(seed)


def _weights(seed: int = 0) -> np.ndarray:
  """float32 weights, one decade per row (0.01 to 10)."""
  r = _rng(seed)
  rows = 10.0 ** np.arange(-2, 2, dtype=np.float64)[:, None]
  return (r.standard_normal(SHAPE) * rows).astype(np.float32)


def _proposals(step: int, seed: int = 100) -> np.ndarray:
  """float32 proposals spanning 2^-18 to 2^-2 in magnitude, both signs,
  with exact zeros and a few exact cancellations of the previous step."""
  r = _rng(seed + step)
  mag = 2.0 ** r.uniform(-18, -2, SHAPE)
  u = (np.sign(r.standard_normal(SHAPE)) * mag).astype(np.float32)
  u[:, ::16] = 0.0
  if step:
    prev = _proposals(step - 1, seed)
    u[:, 5::16] = -prev[:, 5::16]
  return u


def _moment_steps(seed: int) -> list[np.ndarray]:
  """The float32 values a first and second moment take at each step."""
  r = _rng(seed)
  mu = [r.standard_normal(SHAPE).astype(np.float32) * 1e-3]
  nu = [(r.standard_normal(SHAPE) ** 2).astype(np.float32) * 1e-6]
  for _ in range(STEPS):
    # Small relative changes, so that stores erase some of them.
    mu.append((mu[-1] * (1 + r.uniform(-0.02, 0.02, SHAPE))).astype(np.float32))
    nu.append(
      (nu[-1] * (1 + r.uniform(-0.004, 0.004, SHAPE))).astype(np.float32)
    )
  return [np.stack([m, n]) for m, n in zip(mu, nu, strict=True)]


# ---- the recipes -------------------------------------------------------------


def _key():
  import jax

  return jax.random.key(7)


def _jit(fn, options: dict):
  """`jax.jit(fn)` compiled with the XLA options `options` (DebugOptions
  fields, as `--xla_...` flags set them for a whole process)."""
  import jax

  return jax.jit(fn, compiler_options=options or None)


def _run_writeback(tx, params, options: dict) -> dict:
  """`STEPS` updates of `tx` with the fixed proposals; the final params and
  state arrays."""
  import optax

  state = tx.init(params)
  step = _jit(tx.update, options)
  for t in range(STEPS):
    u = {"w": _proposals(t)}
    updates, state = step(u, state, params)
    params = optax.apply_updates(params, updates)
  return _record(params, state)


def _run_adamw(tx, params, options: dict) -> dict:
  """`STEPS` updates of `in_float32(adamw)` then `tx`, on fixed gradients:
  the optimizer's own arithmetic enters (its FMA contractions are the
  backend's), so these records are information, not a contract."""
  import optax

  import lowprec

  chain = optax.chain(lowprec.in_float32(optax.adamw(1e-3)), tx)
  state = chain.init(params)
  step = _jit(chain.update, options)
  for t in range(STEPS):
    g = {"w": _proposals(t, seed=200) * 1e3}
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return _record(params, state)


def _fixed_moments(seed: int):
  """An optax transform whose state `{"mu", "nu"}` takes fixed values:
  the store sees the same float32 proposals on every backend."""
  import jax
  import jax.numpy as jnp
  import optax

  table = jnp.asarray(np.stack(_moment_steps(seed)))  # [steps+1, 2, ...]

  def init(params):
    del params
    return {"mu": {"w": table[0, 0]}, "nu": {"w": table[0, 1]}, "t": 0}

  def update(updates, state, params=None):
    del params
    t = state["t"] + 1
    row = jax.lax.dynamic_index_in_dim(table, t, keepdims=False)
    return updates, {"mu": {"w": row[0]}, "nu": {"w": row[1]}, "t": t}

  return optax.GradientTransformation(init, update)


def _run_state(tx, params, options: dict) -> dict:
  state = tx.init(params)
  step = _jit(tx.update, options)
  for _ in range(STEPS):
    _, state = step(params, state, params)
  return _record(None, state)


def _stored(rules, seed: int = 3):
  """`store_state` of `rules` around the fixed moments, and its params."""
  import jax.numpy as jnp

  import lowprec

  tx = lowprec.store_state(_fixed_moments(seed), rules, key=_key())
  return tx, {"w": jnp.zeros(SHAPE, jnp.float32)}


def _bf16_params():
  import jax.numpy as jnp

  import lowprec

  return lowprec.to_grid(
    {"w": jnp.asarray(_weights())}, "bfloat16", storage="native"
  )


def _on_grid(fmt):
  import jax.numpy as jnp

  import lowprec

  return lowprec.to_grid({"w": jnp.asarray(_weights())}, fmt)


def transforms() -> dict[str, Callable[[], tuple]]:
  """`{recipe: make}`, `make() -> (kind, transform, params)`, kind
  "weights" (fed the fixed proposals) or "state" (a store around the
  fixed moments)."""
  import optax

  import lowprec

  wb = lowprec.writeback
  out = {}
  for rounding in ("nearest", "stochastic", "deadzone"):
    out[f"writeback/bfloat16/{rounding}"] = lambda r=rounding: _as_weights(
      wb("bfloat16", r, key=_key()), _bf16_params()
    )
    out[f"writeback/float8_e4m3fn/{rounding}"] = lambda r=rounding: _as_weights(
      wb("float8_e4m3fn", r, key=_key()), _on_grid("float8_e4m3fn")
    )
  for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
    for rounding in ("nearest", "stochastic"):
      out[f"writeback/{fmt}/{rounding}"] = lambda f=fmt, r=rounding: (
        _as_weights(wb(f, r, key=_key()), _on_grid(f))
      )
  out["writeback/mxfp8_e4m3/keep_scales"] = lambda: _as_weights(
    wb("mxfp8_e4m3", "nearest", scales="keep"), _on_grid("mxfp8_e4m3")
  )
  for rounding in ("nearest", "stochastic"):
    for buf in ("bfloat16", "float8_e5m2"):
      out[f"kahan/bfloat16/{buf}/{rounding}"] = lambda r=rounding, b=buf: (
        _as_weights(
          lowprec.kahan_writeback("bfloat16", r, buffer=b, key=_key()),
          _bf16_params(),
        )
      )
    out[f"two_component/bfloat16/{rounding}"] = lambda r=rounding: _as_weights(
      lowprec.two_component_writeback("bfloat16", r, key=_key()),
      _bf16_params(),
    )
  out["remainder/bfloat16"] = lambda: _as_weights(
    lowprec.remainder_writeback(), _bf16_params()
  )
  for bits in (8, 16):
    out[f"split/bfloat16/{bits}"] = lambda b=bits: _as_weights(
      lowprec.split_writeback(correction_bits=b), _bf16_params()
    )
  for rounding in ("nearest", "stochastic"):
    # Momentum 1/2 and a step of 2^-10: the inner optimizer's products and
    # the fold's factor are powers of two, exact on every backend.
    out[f"eco/bfloat16/{rounding}"] = lambda r=rounding: _as_weights(
      lowprec.eco(optax.sgd(2.0**-10, 0.5), "bfloat16", r, key=_key()),
      _bf16_params(),
    )
  states = {
    "bfloat16/nearest": {"mu": "bfloat16", "nu": "bfloat16"},
    "bfloat16/stochastic": {
      "mu": "bfloat16:stochastic",
      "nu": "bfloat16:stochastic",
    },
    "bfloat16/deadzone": {"mu": "bfloat16:deadzone", "nu": "bfloat16:deadzone"},
    "fp8/stochastic/block32": {
      "mu": "float8_e4m3fn:stochastic:block32",
      "nu": "float8_e5m2:stochastic:block32",
    },
    "fp8/nearest/tensor": {
      "mu": "float8_e4m3fn:nearest:tensor",
      "nu": "float8_e5m2:nearest:tensor",
    },
    "int8/stochastic/block64": {"mu": "int8:stochastic:block64"},
    "fp8/nearest/block32_amax": {
      "mu": "float8_e4m3fn:nearest:block32:amax",
      "nu": "float8_e4m3fn:nearest:block32:amax:float16",
    },
    "dynamic8/nearest/block32": {
      "mu": "dynamic8:block32",
      "nu": "dynamic8u:block32",
    },
    "dynamic8/stochastic/block32": {
      "mu": "dynamic8:stochastic:block32",
      "nu": "dynamic8u:stochastic:block32",
    },
    "companded8_sqrt8/block32": {
      "mu": "companded8:block32",
      "nu": "sqrt8:block32",
    },
    "4bit/block32": {
      "mu": "dynamic4:block32",
      "nu": "uint4nz:block32",
    },
  }
  for name, rules in states.items():
    out[f"state/{name}"] = lambda r=rules: ("state", *_stored(r))
  # Full AdamW steps before the recipe: information (see `_run_adamw`).
  for name in ADAMW:
    out[f"adamw/{name}"] = lambda n=name: ("adamw", *out[n]()[1:])
  return out


# The recipes also run after a full AdamW step (`adamw/<recipe>`).
ADAMW = (
  "writeback/bfloat16/nearest",
  "writeback/bfloat16/stochastic",
  "kahan/bfloat16/bfloat16/nearest",
  "two_component/bfloat16/nearest",
  "remainder/bfloat16",
)


def informational(name: str) -> bool:
  """Whether a recipe's record depends on the optimizer's arithmetic (an
  FMA contraction is the backend's choice), so a difference is reported
  as information rather than a failure."""
  return name.startswith("adamw/")


def not_compared(name: str, made_with, here: dict) -> str | None:
  """Why the CPU test does not compare recipe `name` here, or None.

  The records of `informational` recipes are compared only on the code
  path they were made on (`goldens.same`: jax, jaxlib and the CPU's
  architecture, model and features, from the file's `made_with`, or any
  of a list of them: `environments`); every other record holds on every
  CPU and is always compared.
  """
  if not informational(name):
    return None
  why = goldens.mismatch(made_with, here, remedy=PIN)
  return None if why is None else f"an AdamW record: {why}"


def environments(data: dict) -> list[dict]:
  """The machines a golden-bits file holds AdamW records for: the one it
  was made on, then those pinned beside it (`--pin-here`)."""
  return [data["made_with"], *(m["made_on"] for m in data.get(MACHINES, []))]


def wanted(data: dict, name: str, here: dict) -> dict | None:
  """The record of `name` to compare on machine `here`: the file's own, or
  for an `informational` recipe the one made on `here`'s code path (None
  where no machine of the file is `here`'s)."""
  if not informational(name) or goldens.same(data["made_with"], here):
    return data["recipes"].get(name)
  mine = goldens.pinned({"environments": data.get(MACHINES, [])}, here)
  return None if mine is None else mine.get(name)


def _others(data: dict, here: dict) -> list[dict]:
  """The file's pinned sets but `here`'s."""
  return [
    m for m in data.get(MACHINES, []) if not goldens.same(m["made_on"], here)
  ]


def _as_weights(tx, params):
  return ("weights", tx, params)


def _run(make, options: dict) -> dict:
  kind, tx, params = make()
  runs = {"weights": _run_writeback, "state": _run_state, "adamw": _run_adamw}
  return runs[kind](tx, params, options)


def _recipes(setting: str = "default") -> dict[str, Callable[[], dict]]:
  options = ALL_SETTINGS[setting]
  return {
    name: (lambda m=make: _run(m, options))
    for name, make in transforms().items()
  }


# ---- recording and comparing -------------------------------------------------


def _array_entry(x) -> dict:
  a = np.asarray(x)
  return {
    "dtype": a.dtype.name,
    "shape": list(a.shape),
    "hex": a.tobytes().hex(),
  }


def _record(params, state) -> dict:
  """`{"arrays": {path: entry}, "counts": {key: int}}` of a final step."""
  import jax

  import lowprec
  from lowprec.optim.stored_state import unpacked

  arrays = {}
  # 4-bit codes as codes, one to an element, however they are packed.
  trees = {"params": params, "state": unpacked(state)}
  for top, tree in trees.items():
    if tree is None:
      continue
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      a = np.asarray(jax.device_get(x))
      if a.dtype.kind not in "fiub" and a.dtype.name not in _NARROW:
        continue
      if a.ndim == 0 or (a.dtype.kind == "u" and a.shape == (2,)):
        continue  # counts (read below) and a PRNG key's words
      arrays[top + jax.tree_util.keystr(path)] = _array_entry(a)
  counts = {
    k: v
    for k, v in lowprec.telemetry(state).items()
    if isinstance(v, int) and not isinstance(v, bool)
  }
  return {"arrays": arrays, "counts": counts}


_NARROW = (
  "bfloat16",
  "float16",
  "float8_e4m3fn",
  "float8_e5m2",
  "float8_e4m3fnuz",
  "float8_e5m2fnuz",
  "float8_e3m4",
)


def compute(names=None, setting: str = "default") -> dict[str, dict]:
  """Every recipe's record (or those in `names`), computed here with the
  compile options of `SETTINGS[setting]` (or `CPU_SETTINGS[setting]`)."""
  recipes = _recipes(setting)
  return {
    n: recipes[n]() for n in sorted(recipes) if names is None or n in names
  }


def _decode(entry: dict) -> np.ndarray:
  import ml_dtypes  # noqa: F401  (registers the narrow dtypes with numpy)

  dtype = np.dtype(getattr(ml_dtypes, entry["dtype"], entry["dtype"]))
  raw = bytes.fromhex(entry["hex"])
  return np.frombuffer(raw, dtype).reshape(entry["shape"])


def first_difference(want: dict, got: dict) -> str | None:
  """None where `got` equals `want` bit for bit; else the first
  difference in words: the array or count, the element and both values."""
  for name in sorted(set(want["arrays"]) | set(got["arrays"])):
    if name not in got["arrays"] or name not in want["arrays"]:
      return f"{name}: present in only one of the two records"
    a, b = want["arrays"][name], got["arrays"][name]
    if a == b:
      continue
    if (a["dtype"], a["shape"]) != (b["dtype"], b["shape"]):
      return (
        f"{name}: {a['dtype']}{a['shape']} expected, "
        f"{b['dtype']}{b['shape']} here"
      )
    x, y = _decode(a), _decode(b)
    bx = x.view(np.uint8).reshape(x.size, -1)
    by = y.view(np.uint8).reshape(y.size, -1)
    i = int(np.flatnonzero((bx != by).any(axis=1))[0])
    idx = np.unravel_index(i, x.shape) if x.ndim else ()
    n = int((bx != by).any(axis=1).sum())
    return (
      f"{name}[{', '.join(map(str, idx))}]: expected {x.flat[i]!r}, "
      f"got {y.flat[i]!r} ({n} of {x.size} elements differ)"
    )
  for k in sorted(set(want["counts"]) | set(got["counts"])):
    if want["counts"].get(k) != got["counts"].get(k):
      return (
        f"count {k}: expected {want['counts'].get(k)}, "
        f"got {got['counts'].get(k)}"
      )
  return None


def compare(
  path: str = GOLDEN_BITS, names=None, setting: str = "default"
) -> dict[str, str]:
  """`{recipe: "equal" or the first difference}` against the file, each
  recipe's programs compiled with the options of `SETTINGS[setting]`."""
  import jax

  with open(path) as f:
    data = json.load(f)
  want = dict(data["recipes"])
  if jax.default_backend() == "cpu":  # the AdamW records pinned for this CPU
    here = goldens.environment()
    for name in want:
      want[name] = wanted(data, name, here) or want[name]
  got = compute(names if names is not None else list(want), setting)
  out = {}
  for name in sorted(want if names is None else names):
    if name not in got:
      out[name] = "missing here"
      continue
    diff = first_difference(want[name], got[name])
    out[name] = "equal" if diff is None else diff
  return out


def write(path: str = GOLDEN_BITS) -> None:
  """Remakes the file from this machine's results (atomically). The AdamW
  records pinned for other machines stay (those of this machine's code
  path are now the file's own)."""
  import jax

  here = goldens.environment()
  others = []
  if os.path.exists(path):
    with open(path) as f:
      others = _others(json.load(f), here)
  data = {
    "about": "Stored outputs and integer counts of every storage recipe on "
    f"fixed float32 inputs; see experiments/golden_bits.py. Remake (on "
    f"CPU): {WRITE}; the AdamW records of another CPU: {PIN}",
    "made_with": {"backend": jax.default_backend(), **here},
    "steps": STEPS,
    "recipes": compute(),
    MACHINES: others,
  }
  _dump(data, path)


def pin_here(path: str = GOLDEN_BITS) -> str:
  """Adds (or remakes) this machine's AdamW records beside the file's, so
  that the CPU test compares them here too; every other record holds on
  every CPU and is not repeated. Returns what was done, in words.

  Raises:
    ValueError: this machine's CPU cannot be read, or the backend is not
      the CPU.
  """
  import jax

  here = goldens.environment()
  if jax.default_backend() != "cpu" or goldens._unknown(here):
    raise ValueError(
      "AdamW records are pinned per CPU: run on a CPU whose model and "
      f"features can be read ({goldens.CPUINFO}), with JAX_PLATFORMS=cpu"
    )
  with open(path) as f:
    data = json.load(f)
  if goldens.same(data["made_with"], here):
    return f"{path} was made on this machine's code path: nothing to pin"
  names = [f"adamw/{n}" for n in ADAMW]
  mine = {"made_on": {"backend": "cpu", **here}, "entries": compute(names)}
  data[MACHINES] = [*_others(data, here), mine]
  _dump(data, path)
  return f"pinned {len(names)} AdamW records for this machine in {path}"


def _dump(data: dict, path: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true", help="remake the file")
  parser.add_argument(
    "--pin-here",
    action="store_true",
    help="add this CPU's AdamW records beside the file's (they are "
    "compared only on the CPU they were made on)",
  )
  parser.add_argument("--path", default=GOLDEN_BITS)
  parser.add_argument(
    "--json", default=None, help="write {setting: {recipe: verdict}} here"
  )
  parser.add_argument(
    "--settings",
    default="default",
    help=f"comma-separated compile settings to compare under, of "
    f"{', '.join(SETTINGS)} (and on a CPU {', '.join(CPU_SETTINGS)})",
  )
  args = parser.parse_args(argv)
  if args.write:
    write(args.path)
    print(f"wrote {args.path}")
    return 0
  if args.pin_here:
    try:
      print(pin_here(args.path))
    except ValueError as e:
      parser.exit(2, f"golden_bits: {e}\n")
    return 0
  settings = args.settings.split(",")
  unknown = [s for s in settings if s not in ALL_SETTINGS]
  if unknown:
    parser.error(
      f"unknown setting(s) {unknown}; valid: {', '.join(ALL_SETTINGS)}"
    )
  results = {}
  for setting in settings:
    results[setting] = compare(args.path, setting=setting)
    if args.json:  # a killed run keeps the settings that finished
      with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
  print(_table(results), flush=True)
  failed = [
    n
    for result in results.values()
    for n, v in result.items()
    if v != "equal" and not informational(n)
  ]
  return 1 if failed else 0


def _table(results: dict[str, dict[str, str]]) -> str:
  """One line per recipe: its verdict under each setting."""
  names = sorted({n for r in results.values() for n in r})
  width = max(map(len, names))
  lines = [f"{'recipe':<{width}}  " + " | ".join(results)]
  for name in names:
    verdicts = []
    for result in results.values():
      v = result.get(name, "not run")
      note = " (information)" if informational(name) and v != "equal" else ""
      verdicts.append(v + note)
    lines.append(f"{name:<{width}}  " + " | ".join(verdicts))
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())

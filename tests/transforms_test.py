"""Every transform lowprec exports, through the same property harness.

In the manner of optax's own transform tests: `init` and `update` under
`jit`, one compilation for several updates, state structure, shapes and
dtypes that do not change across steps, for float32, bfloat16 and float16
params; and on 8 devices, shardings preserved and the bits of 1 device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lowprec

KEY = jax.random.key(11)

# param dtype -> (grid format, storage of the params)
DTYPES = {
  "float32": ("float8_e4m3fn", "float32"),
  "bfloat16": ("bfloat16", "native"),
  "float16": ("float16", "native"),
}


def _transforms(fmt):
  """name -> (transform, whether it takes raw gradients of the params)."""
  wb = {
    f"writeback-{r}": (lowprec.writeback(fmt, r, key=KEY), False)
    for r in ("nearest", "stochastic", "deadzone")
  }
  # Counting every third update: a branch in the step (lax.cond).
  wb["writeback-every3"] = (
    lowprec.writeback(fmt, "stochastic", key=KEY, telemetry=3),
    False,
  )
  # The same, the chain in two branches around it (counted_in_branches).
  wb["writeback-every3-branches"] = (
    lowprec.counted_in_branches(
      lowprec.writeback(fmt, "stochastic", key=KEY, telemetry=3)
    ),
    False,
  )
  # The counting one of its two programs (counted_and_uncounted), run on
  # every update: off its schedule it keeps the last counts. (The other
  # runs only off the schedule, which one compiled step cannot follow:
  # tests/telemetry_test.py runs the two.)
  wb["writeback-every3-counted"] = (
    lowprec.counted_and_uncounted(
      lowprec.writeback(fmt, "stochastic", key=KEY, telemetry=3)
    ).counted,
    False,
  )
  return wb | {
    "reference_trace": (
      lowprec.freeze.reference_trace(
        {"nn": fmt, "sr": lowprec.freeze.Target(fmt, "stochastic")},
        sample=16,
        key=KEY,
      ),
      False,
    ),
    "compensated_trace": (
      lowprec.freeze.compensated_trace(
        {"kahan": (fmt, "kahan", "float8_e5m2"), "two": (fmt, "two_component")}
      ),
      False,
    ),
    "kahan": (
      lowprec.kahan_writeback(fmt, "stochastic", key=KEY, buffer="bfloat16"),
      False,
    ),
    "two_component": (lowprec.two_component_writeback(fmt), False),
    "remainder": (lowprec.remainder_writeback(), False),
    "split": (lowprec.split_writeback(), False),
    "eco": (
      lowprec.eco(optax.adamw(1e-2), fmt, "stochastic", key=KEY),
      True,
    ),
    "in_float32+writeback": (
      optax.chain(
        lowprec.in_float32(optax.adamw(1e-2)),
        lowprec.writeback(fmt, "stochastic", key=KEY),
      ),
      True,
    ),
  }


NAMES = list(_transforms("bfloat16"))
# The remainder splits a float32 master into bfloat16 and 16 bits: its
# params are bfloat16 values (e4m3fn's grid is part of bfloat16's), never
# float16.
# So does the split weight with its correction.
GRID = {"remainder": "bfloat16", "split": "bfloat16"}
# Counting every k-th update changes no rounding: one storage suffices.
ONLY = {"writeback-every3": "bfloat16"}
CASES = [
  pytest.param(name, dtype, id=f"{name}-{dtype}")
  for name in NAMES
  for dtype in DTYPES
  if not (name in GRID and dtype == "float16")
  and ONLY.get(name, dtype) == dtype
]


def _params(dtype):
  fmt, storage = DTYPES[dtype]
  k1, k2 = jax.random.split(jax.random.key(0))
  p = {
    "dense": {
      "kernel": 0.5 * jax.random.normal(k1, (16, 8)),
      "bias": 0.5 * jax.random.normal(k2, (8,)),
    }
  }
  return lowprec.to_grid(p, fmt, storage=storage)


def _inputs(params, raw, t):
  """Gradients in the params' dtype, or float32 proposals."""
  rng = np.random.default_rng(t)

  def one(p):
    u = (0.05 * rng.standard_normal(p.shape)).astype(np.float32)
    return jnp.asarray(u).astype(p.dtype if raw else jnp.float32)

  return jax.tree.map(one, params)


def _signature(tree):
  return jax.tree.structure(tree), [
    (x.shape, x.dtype) for x in jax.tree.leaves(tree)
  ]


# The compensated write-backs take one storage each in the default run;
# the rest of their product is marked slow (run it with `pytest -m slow`).
DEFAULT = {
  "compensated_trace": "float32",
  "kahan": "float32",
  "two_component": "bfloat16",
  "remainder": "bfloat16",
  "split": "bfloat16",
  "eco": "bfloat16",
}


def _default_run(case, keep):
  name, dtype = case.values
  if keep(name, dtype):
    return case
  return pytest.param(*case.values, marks=pytest.mark.slow, id=case.id)


@pytest.mark.parametrize(
  "name, dtype",
  [_default_run(c, lambda n, d: DEFAULT.get(n, d) == d) for c in CASES],
)
def test_jit_once_and_a_stable_state(name, dtype):
  tx, raw = _transforms(DTYPES[dtype][0])[name]
  params = _params(dtype)
  eager = tx.init(params)
  jitted = jax.jit(tx.init)(params)
  assert _signature(eager) == _signature(jitted)
  traces = []

  @jax.jit
  def step(params, state, g):
    traces.append(None)
    updates, state = tx.update(g, state, params)
    return lowprec.apply_updates(params, updates), updates, state

  state, sig = jitted, _signature(jitted)
  for t in range(3):
    params, updates, state = step(params, state, _inputs(params, raw, t))
    assert _signature(state) == sig
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    for p in jax.tree.leaves(params):
      assert p.dtype == np.dtype(dtype)
  assert len(traces) == 1
  tel = lowprec.telemetry(state)
  # Every count is finite (eco's `fold` is a name: "closed" or "jvp").
  assert tel and all(
    np.all(np.isfinite(v))
    for k, v in tel.items()
    if "fraction" not in k and k != "fold"
  )
  if name == "reference_trace":
    assert tel["pred/nn/proposals"] == 16 * 8 + 8
  elif name == "compensated_trace":
    assert tel["pred/kahan/proposals"] == 16 * 8 + 8
    assert tel["pred/two/moved"] > 0
  else:
    lowprec.check_on_grid(params, GRID.get(name, DTYPES[dtype][0]))
    assert tel["steps"] == 3 and tel["moved"] > 0


@pytest.mark.parametrize(
  "name, dtype",
  [
    _default_run(c, lambda n, d: d == "float32" and n != "two_component")
    for c in CASES
  ],
)
def test_eight_devices_keep_shardings_and_give_the_bits_of_one(name, dtype):
  tx, raw = _transforms(DTYPES[dtype][0])[name]

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return lowprec.apply_updates(params, updates), updates, state

  params = _params(dtype)
  g = _inputs(params, raw, 0)
  one = (params, tx.init(params))
  for _ in range(2):
    p, _, s = step(*one, g)
    one = (p, s)
  assert len(jax.devices()) == 8
  rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
  params8, g8 = jax.device_put((params, g), rows)
  state8 = jax.jit(tx.init)(params8)
  shardings = None
  for _ in range(2):
    params8, updates8, state8 = step(params8, state8, g8)
    now = [x.sharding for x in jax.tree.leaves(state8)]
    assert shardings is None or now == shardings
    shardings = now
    for p, u in zip(
      jax.tree.leaves(params8), jax.tree.leaves(updates8), strict=True
    ):
      assert p.sharding.is_equivalent_to(rows, p.ndim)
      assert u.sharding.is_equivalent_to(rows, u.ndim)
  for a, b in zip(
    jax.tree.leaves(params8), jax.tree.leaves(one[0]), strict=True
  ):
    np.testing.assert_array_equal(
      np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32),
      np.asarray(b).view(np.uint16 if b.dtype.itemsize == 2 else np.uint32),
    )
  tel8, tel1 = lowprec.telemetry(state8), lowprec.telemetry(one[1])
  assert tel8.keys() == tel1.keys()
  for k, v in tel1.items():
    if any(w in k for w in ("move_prob", "carried", "lost_mass", "drift")):
      # Float32 sums (of probabilities, of buffer values): their last
      # bits follow the reduction order, which sharding changes. Counts
      # are exact.
      np.testing.assert_allclose(tel8[k], v, rtol=2e-6)
    else:
      assert tel8[k] == v or (np.isnan(v) and np.isnan(tel8[k])), k

"""The 8- and 4-bit state formats of PyTorch optimizers, against numpy.

amax scales (torchao's AdamWFp8), bitsandbytes' dynamic map (torchao's
AdamW8bit), FlashOptim's companded and square-root maps, and the 4-bit
maps of Li, Chen, Zhu (2023). Every expected code, scale and value below
is the documented arithmetic written again in numpy and ml_dtypes (float32
where the definition is float32, exact in float64 where it is exact);
nothing uses lowprec's rounding to compute one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec
from lowprec.engine import codec as codec_lib
from lowprec.engine.codec import decode
from lowprec.optim.stored_state import parse_state_format, unpacked
from tests.state_storage_test import KEY, _bits, _stored, holder, one_and_eight
from tests.telemetry_test import assert_telemetry_equal

F32 = np.float32

# ---- the oracle ------------------------------------------------------------


def _dynamic_table(bits, signed=True):
  """bitsandbytes' dynamic map, in float64 then float32: 0, 1 and, for
  i = 0..bits-2, the midpoints of linspace(0.1, 1, 2^i + 1) times
  10^(i - (bits - 2)), both signs (unsigned: 2^(i + 1) + 1 points, one
  sign)."""
  top, vals = bits - 2, [0.0, 1.0]
  for i in range(top + 1):
    b = np.linspace(0.1, 1.0, (2**i if signed else 2 ** (i + 1)) + 1)
    for v in 10.0 ** (i - top) * (b[:-1] + b[1:]) / 2:
      vals += [v, -v] if signed else [v]
  return np.sort(np.array(vals)).astype(F32)


TABLES = {
  "dynamic8": _dynamic_table(8),
  "dynamic8u": _dynamic_table(8, signed=False),
  "dynamic4": _dynamic_table(4),
  "uint4nz": (np.arange(1, 17) / 16).astype(F32),
}
HALF16 = {"companded8", "sqrt8"}  # float16 scales
UNSIGNED = {"sqrt8", "uint4nz", "dynamic8u"}


def _block_max(a, block):
  """Largest entry of `a` per block of the last axis (None: the tensor),
  zero-padded; and a function spreading per-block values back."""
  n = a.shape[-1]
  if block is None:
    return np.max(a), lambda s: np.broadcast_to(s, a.shape)
  nb = -(-n // block)
  pad = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, nb * block - n)])
  amax = pad.reshape(*a.shape[:-1], nb, block).max(-1)
  return amax, lambda s: np.repeat(s, block, -1)[..., :n]


def _ceil16(s):
  """float32 `s > 0` rounded up to a float16, in [2^-24, 65504]."""
  s = np.maximum(np.asarray(s, F32), F32(2.0**-24))
  h = s.astype(np.float16)
  h = np.where(h.astype(F32) < s, np.nextafter(h, np.float16(np.inf)), h)
  return np.minimum(h.astype(F32), F32(65504))


def _values(name):
  """What each code reads back as under scale 1, ascending."""
  if name in TABLES:
    return TABLES[name]
  if name == "companded8":
    z = np.arange(-127, 128).astype(F32) / F32(127)
    return z / (F32(2) - np.abs(z))
  r = np.arange(256).astype(F32) / F32(255)
  return r * r


def _nearest(y, table):
  """Index of the entry nearest to y (exact, float64), ties to the
  larger entry."""
  d = np.abs(y.astype(np.float64).reshape(-1, 1) - table.astype(np.float64))
  idx = len(table) - 1 - np.argmin(d[:, ::-1], axis=1)
  return idx.reshape(y.shape)


def oracle(spec, x):
  """`(code, scales, value, saturated)` of storing float32 `x` under a
  nearest spec, in numpy."""
  sf = parse_state_format(spec)
  name, block = sf.fmt.name, sf.scale
  block = None if block == "tensor" else block
  x = np.asarray(x, F32)
  if sf.mapped:
    u = np.maximum(x, 0) if name in UNSIGNED else x
    u = np.sqrt(u) if name == "sqrt8" else u
    amax, spread = _block_max(np.abs(u), block)
    s = _ceil16(amax) if name in HALF16 else amax.astype(F32)
    s = np.where(amax > 0, s, F32(0)).astype(F32)
    per = spread(s)
    with np.errstate(invalid="ignore", divide="ignore"):
      y = np.where(per > 0, u / per, F32(0)).astype(F32)
    if name == "companded8":
      phi = (F32(2) * y) / (F32(1) + np.abs(y))
      code = np.floor(phi * F32(127) + F32(0.5)).astype(np.int8)
      z = code.astype(F32) / F32(127)
      value = z / (F32(2) - np.abs(z)) * per
    elif name == "sqrt8":
      code = np.floor(y * F32(255) + F32(0.5)).astype(np.uint8)
      r = code.astype(F32) / F32(255) * per
      value = r * r
    else:
      code = _nearest(y, TABLES[name]).astype(np.uint8)
      value = TABLES[name][code] * per
    dtype = np.float16 if name in HALF16 else F32
    with np.errstate(invalid="ignore", divide="ignore"):
      over = np.where(per > 0, np.abs(u / per), 0) > 1
    over |= (x < 0) & (name in UNSIGNED)
    return code, s.astype(dtype), value.astype(F32), over
  # A grid under amax scales: amax / max_E.
  top = F32(sf.fmt.max_finite)
  amax, spread = _block_max(np.abs(x), block)
  s = amax.astype(F32) / top
  if sf.scale_dtype == "float16":
    s = _ceil16(s)
  else:
    s = np.maximum(s, F32(2.0**-126))
  s = np.where(amax > 0, s, F32(1)).astype(F32)
  y = x / spread(s)
  if sf.fmt.is_float:  # past the top: the cast gives inf or NaN
    with np.errstate(over="ignore", invalid="ignore"):
      cast = y.astype(np.dtype(sf.fmt.native_dtype)).astype(F32)
    over = ~np.isfinite(cast)
    code = np.clip(y, -top, top).astype(np.dtype(sf.fmt.native_dtype))
  else:
    over = np.abs(np.rint(y)) > top
    code = np.rint(np.clip(y, -top, top)).astype(np.int8)
  value = code.astype(F32) * spread(s)
  return code, s.astype(sf.scale_dtype), value, over


# ---- inputs ----------------------------------------------------------------


def _inputs(seed, unsigned, huge=False):
  """(6, 300) float32: rows of magnitudes 10^U(-8, 3), both signs (or
  nonnegative), a block of zeros at the start of row 0, and blocks of 32,
  128, 256 and 2048 cut 300 columns unevenly."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((6, 300)) * 10.0 ** rng.uniform(-8, 3, (6, 1))
  if huge:  # past what a float16 scale holds
    x[5] *= 1e10
  x = np.abs(x) if unsigned else x
  x[0, :256] = 0.0
  return x.astype(F32)


MAP_SPECS = [
  "dynamic8:block256",
  "dynamic8:block2048",
  "dynamic8u:block256",
  "dynamic4:block128",
  "companded8:block32",
  "sqrt8:block32",
  "uint4nz:block128",
  "dynamic8:tensor",
]
GRID_SPECS = [
  "float8_e4m3fn:nearest:block256:amax",
  "float8_e4m3fn:nearest:tensor:amax",
  "float8_e5m2:nearest:block32:amax:float16",
  "int4:nearest:block128:amax",
]


def _codes(state):
  """The stored leaf's codes, one to an element (4-bit ones are packed)."""
  return unpacked(state).inner.s["w"]


def _unsigned(spec):
  return parse_state_format(spec).fmt.name in UNSIGNED


@pytest.mark.parametrize("spec", MAP_SPECS + GRID_SPECS)
def test_stored_codes_scales_and_values_equal_the_numpy_oracle(spec):
  """One store of (6, 300) values over eleven decades (seed 1): the codes,
  their dtype, the scales (dtype too) and what `decode` reads back are the
  oracle's bit for bit; nothing saturates or flushes a nonzero block to
  zero as a whole."""
  huge = spec.endswith("float16")
  x = _inputs(1, _unsigned(spec), huge=huge)
  code, scales, value, over = oracle(spec, x)
  state = _stored(spec, x)
  got = _codes(state)
  assert got.dtype == code.dtype
  np.testing.assert_array_equal(_bits(got), _bits(code))
  got_s = state.scales["s/w"]
  assert got_s.dtype == scales.dtype
  np.testing.assert_array_equal(_bits(got_s), _bits(scales))
  codec = parse_state_format(spec).codec()
  read = np.asarray(jax.jit(lambda c, s: decode(codec, c, s))(got, got_s))
  np.testing.assert_array_equal(_bits(read), _bits(value))
  tel = lowprec.telemetry(state)
  assert tel["state/saturated"] == int(over.sum())
  assert (over.sum() > 10) == huge
  assert tel["state/changed"] == int((x != 0).sum())


@pytest.mark.parametrize("overflow", ["saturate", "ieee"])
@pytest.mark.parametrize(
  "spec",
  [
    "float8_e4m3fn:nearest:block64:amax",
    "dynamic8:block64",
    "sqrt8:block64",
    "dynamic8u:block128",
    "companded8:block32",
    "sqrt8:block32",
  ],
)
@pytest.mark.parametrize("size", ["small", "large"])
def test_scales_beside_nonfinite_and_negative_entries_equal_the_oracle(
  spec, overflow, size, monkeypatch
):
  """The block scales of `_inputs(4)` (blocks of 32, 64 or 128 cut 300
  columns, the last one ragged) stored as they are (every entry finite;
  a row negative throughout, a block of -0.0), then with a NaN, an inf,
  a -inf or (for an unsigned map) a negative value in one of four
  blocks, and with all of them. The oracle: the scales of the input
  with those entries replaced by 0, and NaN for a block where a map
  holds NaN, or under
  "ieee" inf or a negative value of an unsigned map. On CPU, a tensor
  of `_RAW_MIN_SIZE` entries or more (`large` sets that size to 0) takes
  its scales from the maximum and minimum of its entries where those
  say they are all finite, and from a select otherwise (blocks of 32
  always from the select, their scales written out once a block): every
  branch is checked here; a `small` tensor keeps the select."""
  if size == "large":
    monkeypatch.setattr(codec_lib, "_RAW_MIN_SIZE", 0)
  sf = parse_state_format(spec)
  unsigned = _unsigned(spec)
  x = _inputs(4, unsigned)
  x[1] = -np.abs(x[1]) if not unsigned else x[1]
  x[2, 32:64] = -0.0
  where = {"nan": (1, 40), "inf": (2, 99), "-inf": (4, 0), "neg": (5, 299)}
  put = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "neg": -1.0}
  kinds = [k for k in where if k != "neg" or unsigned]
  for spoilt in [(), *[(k,) for k in kinds], tuple(kinds)]:
    values = x.copy()
    for name in spoilt:
      values[where[name]] = put[name]
    got = _stored(spec, values, overflow=overflow).scales["s/w"]
    clean = np.where(np.isfinite(values), values, F32(0))
    clean = np.maximum(clean, 0) if unsigned else clean
    want = oracle(spec, clean)[1].copy()
    if sf.mapped:
      bad = {"nan"} | ({"inf", "-inf"} if overflow == "ieee" else set())
      bad |= {"neg"} if overflow == "ieee" and unsigned else set()
      for name in bad & set(spoilt):
        r, c = where[name]
        want[r, c // sf.scale] = np.nan
    np.testing.assert_array_equal(_bits(got), _bits(want), str(spoilt))


def _grid_inputs(name):
  """One block (scale 1: its largest magnitude is 1) holding every entry
  of the map, and just below and at each boundary between two codes."""
  if name in TABLES:
    t = TABLES[name].astype(np.float64)
    mid = ((t[:-1] + t[1:]) / 2).astype(F32)  # may round either way
    edges = [mid, np.nextafter(mid, F32(-2)), np.nextafter(mid, F32(2))]
    x = np.concatenate([TABLES[name], *edges, [F32(1)]])
  elif name == "companded8":
    k = np.arange(-127, 128).astype(F32)
    z = k / F32(127)
    zh = np.clip((k + F32(0.5)) / F32(127), -1, 1)
    x = np.concatenate([z / (2 - np.abs(z)), zh / (2 - np.abs(zh)), [1]])
  else:  # sqrt8: squares of code / 255 and of the halves between
    r = np.arange(0, 256 * 2).astype(F32) / F32(510)
    x = np.concatenate([r * r, [1]])
  x = x.astype(F32)
  if name in UNSIGNED:
    x = np.abs(x)
  return x.reshape(1, -1)


@pytest.mark.parametrize("name", ["dynamic8", "dynamic4", "companded8"])
def test_every_code_and_every_boundary_of_the_map(name):
  """A block whose largest magnitude is 1 (scale 1): every entry of the
  map reads back as itself (every code round-trips), and the values at
  and around each boundary between two codes are stored as the oracle
  stores them (nearest, ties as documented)."""
  x = _grid_inputs(name)
  spec = f"{name}:tensor"
  code, _, value, _ = oracle(spec, x)
  state = _stored(spec, x)
  np.testing.assert_array_equal(_bits(_codes(state)), _bits(code))
  assert float(state.scales["s/w"]) == 1.0
  codec = parse_state_format(spec).codec()
  read = np.asarray(decode(codec, _codes(state), state.scales["s/w"]))
  np.testing.assert_array_equal(_bits(read), _bits(value))
  table = TABLES.get(name)
  if table is not None:  # the entries come back as themselves
    n = len(table)
    np.testing.assert_array_equal(read[0, :n], table)
    np.testing.assert_array_equal(code[0, :n], np.arange(n))
  else:
    assert set(np.asarray(_codes(state)).ravel()) == set(range(-127, 128))


@pytest.mark.parametrize("name", ["sqrt8", "uint4nz", "dynamic8u"])
def test_every_code_and_every_boundary_of_an_unsigned_map(name):
  """As above for the maps of nonnegative values: every one of the 256
  (16) codes is used, and each value is the oracle's."""
  x = _grid_inputs(name)
  spec = f"{name}:tensor"
  code, _, value, _ = oracle(spec, x)
  state = _stored(spec, x)
  np.testing.assert_array_equal(_bits(_codes(state)), _bits(code))
  codec = parse_state_format(spec).codec()
  read = np.asarray(decode(codec, _codes(state), state.scales["s/w"]))
  np.testing.assert_array_equal(_bits(read), _bits(value))
  n = 16 if name == "uint4nz" else 256
  assert len(set(code.ravel())) == n


@pytest.mark.parametrize(
  "name", ["dynamic8", "dynamic8u", "dynamic4", "uint4nz"]
)
def test_the_bucketed_first_guess_equals_the_binary_search(name):
  """The table maps find a code from a bucket of the value's bits and at
  most one comparison; the binary search over the thresholds that it
  replaced is the reference. Inputs: every threshold and every bucket
  edge, 2 ulps either side, both signs, 0, -0, +-1, NaN, and 200,000
  log-uniform values in (-1, 1) (seed 0): all indices equal."""
  m = lowprec.grids.codemaps.get_map(name)
  g = lowprec.grids.codemaps._buckets(name)
  assert g.extra <= 1
  up = lowprec.grids.codemaps._thresholds(name)[1:]
  k = np.arange(g.top + 2, dtype=np.int64)
  one = int(F32(1).view(np.int32))
  edges = np.minimum(g.floor + (k << g.shift), one).astype(np.int32)
  v = np.concatenate([up, edges.view(F32)])
  v = np.concatenate([v, -v])
  for _ in range(2):
    v = np.concatenate([v, np.nextafter(v, F32(2)), np.nextafter(v, F32(-2))])
  rng = np.random.default_rng(0)
  mag = 10.0 ** rng.uniform(-9, 0, 200_000)
  r = (rng.choice([-1.0, 1.0], 200_000) * mag).astype(F32)
  special = np.array([0.0, -0.0, 1.0, -1.0, np.nan], F32)
  y = np.clip(np.concatenate([v, r, special]), -1 if m.signed else 0, 1)
  y = jnp.asarray(y.astype(F32))
  got = jax.jit(m.nearest_index)(y)
  want = jax.jit(m.search_index)(y)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dynamic_map_table_and_its_ends():
  """The maps themselves: 256 entries (16 for dynamic4), strictly
  increasing, 0 and 1 in them, the smallest nonzero magnitude 5.5e-7
  (dynamic4 0.0055, unsigned 3.25e-7), the lowest value -0.99296875
  (-0.8875, unsigned 0): bitsandbytes' maps."""
  ends = {"dynamic8": (5.5e-7, -0.99296875), "dynamic4": (0.0055, -0.8875)}
  ends["dynamic8u"] = (3.25e-7, 0.0)
  for name, (small, low) in ends.items():
    t = lowprec.grids.codemaps.get_map(name).table()
    np.testing.assert_array_equal(t, TABLES[name])
    assert len(t) == (16 if name == "dynamic4" else 256)
    assert np.all(np.diff(t) > 0)
    assert 0.0 in t and t[-1] == 1.0 and t[0] == F32(low)
    assert np.min(np.abs(t[t != 0])) == F32(small)


# ---- telemetry -------------------------------------------------------------


@pytest.mark.parametrize(
  "spec", ["dynamic8:block256", "companded8:block32", "sqrt8:block32"]
)
def test_telemetry_equals_a_numpy_recount(spec):
  """Two stores: s_old, then s_new with a third of the values nudged by
  a little, a third by a lot, a third unchanged, one NaN and, for the
  unsigned map, a negative value (seed 3). changed, erased, flushed,
  saturated and nonfinite are those of the oracle's values; the NaN's
  block reads back NaN (a map has no NaN code), the negative value as 0,
  counted saturated."""
  rng = np.random.default_rng(3)
  unsigned = _unsigned(spec)
  s_old = _inputs(3, unsigned)
  pick = rng.integers(0, 3, s_old.shape)
  nudge = np.where(pick == 1, 1e-4, np.where(pick == 2, 0.5, 0.0))
  s_new = (s_old * (1 + nudge * rng.choice([-1, 1], s_old.shape))).astype(F32)
  s_new[2, 5] = np.nan
  s_new[3, 7] = -abs(s_new[3, 7]) if unsigned else s_new[3, 7]
  tx = lowprec.store_state(holder(), {"s": spec})
  params = {"w": jnp.zeros(s_old.shape)}
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.asarray(s_old)}, tx.init(params))
  _, state = update({"w": jnp.asarray(s_new)}, state)
  v_old = oracle(spec, s_old)[2]
  clean = np.nan_to_num(s_new, nan=0.0)
  v_new = oracle(spec, clean)[2]
  block = parse_state_format(spec).scale
  v_new[2, (5 // block) * block : (5 // block + 1) * block] = np.nan
  finite = np.isfinite(s_new)
  changed = finite & (s_new != v_old)
  want = {
    "changed": int(changed.sum()),
    "erased": int((changed & (v_new == v_old)).sum()),
    "flushed": int((finite & (s_new != 0) & (v_new == 0)).sum()),
    "saturated": int(unsigned),
    "nonfinite": 1,
  }
  tel = lowprec.telemetry(state)
  assert {k: tel[f"state/{k}"] for k in want} == want
  assert 0 < want["erased"] < want["changed"]
  codec = parse_state_format(spec).codec()
  read = np.asarray(decode(codec, _codes(state), state.scales["s/w"]))
  np.testing.assert_array_equal(_bits(read), _bits(v_new))
  if unsigned:
    assert read[3, 7] == 0.0


# ---- stochastic rounding ---------------------------------------------------


@pytest.mark.parametrize(
  "spec",
  ["dynamic8:stochastic:block256", "companded8:stochastic:block32"]
  + ["sqrt8:stochastic:block32", "uint4nz:stochastic:block128"],
)
def test_stochastic_map_rounding_is_unbiased_in_the_value(spec):
  """Blocks whose largest value is 1 (scale 1), every other value at a
  fraction f in {0.1, 0.5, 0.8} of the way between two neighbouring map
  values (chosen at random, seed 4), N = 16,384 values per f: each is
  stored as one of its two neighbours, the far one with frequency f
  within 5 sd (sd = sqrt(f (1 - f) / N) <= 0.004), and the mean stored
  value is the mean input within 5 sd of the draws."""
  name = parse_state_format(spec).fmt.name
  block = parse_state_format(spec).scale
  codec = parse_state_format(spec).codec()
  table = _values(name)
  rng = np.random.default_rng(4)
  rows = 16384 // (block - 1)
  for f in (0.1, 0.5, 0.8):
    k = rng.integers(0, len(table) - 1, (rows, block - 1))
    lo, hi = table[k], table[k + 1]
    x = (lo + F32(f) * (hi - lo)).astype(F32)
    x = np.concatenate([np.ones((rows, 1), F32), x], axis=1)
    lo = np.concatenate([np.ones((rows, 1), F32), lo], axis=1)
    hi = np.concatenate([np.ones((rows, 1), F32), hi], axis=1)
    state = _stored(spec, x, key=jax.random.key(int(f * 10)))
    got = np.asarray(decode(codec, _codes(state), state.scales["s/w"]))
    inner = (slice(None), slice(1, None))
    assert np.all((got == lo) | (got == hi)), name
    p = x[inner] - lo[inner]
    p = p / (hi[inner] - lo[inner])
    freq = np.mean(got[inner] == hi[inner])
    n = got[inner].size
    assert abs(freq - np.mean(p)) < 5 * np.sqrt(f * (1 - f) / n), (name, f)
    gap = (hi - lo)[inner]
    sd = np.sqrt(np.sum(p * (1 - p) * gap**2)) / n
    assert abs(np.mean(got[inner]) - np.mean(x[inner])) < 5 * sd + 1e-12


# ---- bytes -----------------------------------------------------------------

BYTES = {  # per parameter of a (1024, 1024) matrix: code + scale / block
  "float8_e4m3fn:nearest:block256:amax": 1 + 4 / 256,
  "float8_e4m3fn:nearest:tensor:amax": 1 + 4 / 2**20,
  "dynamic8:block256": 1 + 4 / 256,
  "dynamic8:block2048": 1 + 4 / 1024,  # one partial block per row of 1024
  "dynamic8u:block256": 1 + 4 / 256,
  "companded8:block32": 1 + 2 / 32,
  "sqrt8:block32": 1 + 2 / 32,
  "dynamic4:block128": 0.5 + 4 / 128,  # 4-bit codes, two to a byte
  "uint4nz:block128": 0.5 + 4 / 128,
  "int4:nearest:block128:amax": 0.5 + 4 / 128,
}


@pytest.mark.parametrize("spec", BYTES)
def test_bytes_per_param_count_codes_and_scales(spec):
  """`bytes_per_param` of Adam's `nu` stored so, `mu` float32: 4 bytes of
  weights, 4 of `mu`, and the code (a byte, half a byte for 4-bit codes) plus
  its block's scale (float16 scales 2 bytes) per parameter, exactly; the
  codec's `nbytes` is the stored arrays' size."""
  params = {"w": jnp.zeros((1024, 1024))}
  tx = lowprec.store_state(optax.adam(1e-3), {"nu": spec})
  state = jax.eval_shape(tx.init, params)
  size = lowprec.bytes_per_param(params, state)
  assert size.params == 4.0
  assert size.state == 4.0 + BYTES[spec], size.state
  codec = parse_state_format(spec).codec()
  leaf, scales = state.inner[0].nu["w"], state.scales["0/nu/w"]
  stored = leaf.size * leaf.dtype.itemsize + scales.size * scales.dtype.itemsize
  assert codec.nbytes((1024, 1024)) == stored


def _nibbles_numpy(codes: np.ndarray) -> np.ndarray:
  """The oracle: each row's codes as bytes, element 2k in the low nibble,
  2k + 1 in the high one, a zero nibble after an odd last element."""
  c = np.atleast_1d(codes).astype(np.int64) & 0xF
  rows = c.reshape(-1, c.shape[-1])
  out = np.zeros((rows.shape[0], -(-c.shape[-1] // 2)), np.uint8)
  for r, row in enumerate(rows):
    for k, v in enumerate(row):
      out[r, k // 2] |= np.uint8(v << (4 * (k % 2)))
  return out.reshape(*c.shape[:-1], out.shape[-1])


@pytest.mark.parametrize(
  "spec",
  ["dynamic4:block128", "uint4nz:block128", "int4:nearest:block128:amax"],
)
@pytest.mark.parametrize("shape", [(6,), (3, 5), (), (2, 1)])
def test_four_bit_codes_are_packed_two_to_a_byte(spec, shape):
  # Seed 0, every code of the map at random: the bytes are the numpy
  # oracle's, and unpacking gives the codes back with their dtype.
  from lowprec.engine.codec import pack, packed_shape, unpack

  codec = parse_state_format(spec).codec()
  assert codec.packed
  lo, hi = (-8, 8) if codec.dtype() == np.int8 else (0, 16)
  codes = np.random.default_rng(0).integers(lo, hi, shape).astype(codec.dtype())
  stored = np.asarray(pack(codec, jnp.asarray(codes)))
  assert stored.dtype == np.uint8 and stored.shape == packed_shape(shape)
  np.testing.assert_array_equal(stored, _nibbles_numpy(codes))
  back = np.asarray(unpack(codec, jnp.asarray(stored), shape))
  assert back.dtype == codec.dtype()
  np.testing.assert_array_equal(back, codes)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_four_bit_moments_packed_step_as_one_code_a_byte(rounding, monkeypatch):
  # Adam, four steps, both moments 4-bit on an odd and an even last axis:
  # the state holds ceil(n / 2) bytes a row, and the updates, unpacked
  # codes, scales and counts are bit for bit those of the same store
  # keeping one code a byte (the layout packing replaced). Then the
  # arrays restored into a template made by init continue the same.
  from lowprec.engine.codec import Codec

  params = {
    "w": jax.random.normal(jax.random.key(0), (4, 257)),
    "b": jax.random.normal(jax.random.key(1), (6,)),
  }
  rules = {
    "mu": f"dynamic4:{rounding}:block128",
    "nu": f"uint4nz:{rounding}:block128",
  }

  def run(steps=4):
    tx = lowprec.store_state(optax.adam(1e-2), rules, key=KEY)
    state, step, out = tx.init(params), jax.jit(tx.update), []
    for i in range(steps):
      grads = jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 1)), params)
      updates, state = step(grads, state, params)
      out.append(updates)
    return tx, state, out

  tx, packed, updates = run()
  mu = packed.inner[0].mu
  assert mu["w"].dtype == jnp.uint8 and mu["w"].shape == (4, 129)
  assert mu["b"].shape == (3,)
  with monkeypatch.context() as m:
    m.setattr(Codec, "packed", property(lambda self: False))
    jax.clear_caches()  # programs traced with packing
    _, plain, plain_updates = run()
  jax.clear_caches()
  assert plain.inner[0].mu["w"].shape == (4, 257)
  got = [updates, unpacked(packed), lowprec.telemetry(packed)]
  want = [plain_updates, plain, lowprec.telemetry(plain)]
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  template = tx.init(params)
  restored = jax.tree.unflatten(
    jax.tree.structure(template),
    [np.asarray(x) for x in jax.tree.leaves(packed)],
  )
  grads = jax.tree.map(jnp.sin, params)
  a = jax.jit(tx.update)(grads, packed, params)
  b = jax.jit(tx.update)(grads, restored, params)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- devices ---------------------------------------------------------------

DEVICE_SPECS = {
  "dynamic8_2048_sr": "dynamic8:stochastic:block2048",
  "amax256": "float8_e4m3fn:nearest:block256:amax",
  "companded32": "companded8:block32",
  "sqrt32_sr": "sqrt8:stochastic:block32",
  "dynamic4_128_sr": "dynamic4:stochastic:block128",  # packed codes
}


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("spec", DEVICE_SPECS.values(), ids=DEVICE_SPECS)
def test_eight_devices_split_along_the_blocks_store_the_bits_of_one(
  spec, size, monkeypatch
):
  """Adam, three scanned steps, `mu` (or, for sqrt8, `nu`) stored, the
  columns of two matrices and a vector split over 8 devices, so that a
  block (2048 columns, 256, 32) spans several devices or one holds
  parts of several: params, codes, scales and counts are the single
  device's bit for bit. `large` takes the block maxima from the
  entries' maximum and minimum (`_RAW_MIN_SIZE` set to 0: blocks of
  more than 32) as a large tensor does on CPU."""
  if size == "large":
    monkeypatch.setattr(codec_lib, "_RAW_MIN_SIZE", 0)
  ks = jax.random.split(jax.random.key(3), 3)
  params = {
    "w": jax.random.normal(ks[0], (4, 4096)),
    "v": jax.random.normal(ks[1], (8, 256)),
    "b": jax.random.normal(ks[2], (512,)),
  }
  moment = "nu" if _unsigned(spec) else "mu"
  tx = lowprec.store_state(optax.adam(1e-3), {moment: spec}, key=KEY)

  one, eight = one_and_eight(tx, params)
  stored = getattr(eight[1].inner[0], moment)["w"]
  assert len(stored.sharding.device_set) == 8
  leaves = jax.tree_util.tree_leaves_with_path(one)
  for (path, a), b in zip(leaves, jax.tree.leaves(eight), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(
      _bits(b), _bits(a), err_msg=jax.tree_util.keystr(path)
    )
  assert_telemetry_equal(lowprec.telemetry(eight[1]), lowprec.telemetry(one[1]))


# ---- bad input -------------------------------------------------------------


def test_bad_specs_are_errors_naming_the_fix():
  adam = optax.adam(1e-3)
  with pytest.raises(ValueError, match=r"Did you mean 'dynamic8'"):
    lowprec.store_state(adam, {"mu": "dynamik8:block256"})
  with pytest.raises(ValueError, match=r"Did you mean 'amax'"):
    lowprec.store_state(adam, {"mu": "float8_e4m3fn:block256:amx"})
  with pytest.raises(ValueError, match=r"give a scale, e.g. 'sqrt8:block256'"):
    lowprec.store_state(adam, {"nu": "sqrt8"})
  with pytest.raises(ValueError, match=r"amax scales only.*'dynamic8:block32'"):
    lowprec.store_state(adam, {"nu": "dynamic8:block32:pow2"})
  with pytest.raises(ValueError, match=r"amax scale rule needs a scale"):
    lowprec.StateFormat("float8_e4m3fn", scale_rule="amax")
  with pytest.raises(ValueError, match=r"float16 scales .* add ':amax'"):
    lowprec.store_state(adam, {"nu": "float8_e5m2:block32:float16"})
  # A map of nonnegative values on a first moment: at init, with the fix.
  params = {"w": jnp.zeros(3)}
  for spec in ("sqrt8:block32", "uint4nz:block128"):
    with pytest.raises(
      ValueError,
      match=r"'0/mu/w' is a first moment \('mu'\).*'companded8:block32'",
    ):
      lowprec.store_state(adam, {"mu": spec}).init(params)
    with pytest.raises(ValueError, match=r"first moment"):
      s = adam.init(params)
      lowprec.freeze.state_erasure(s, s, {"mu": spec})
  with pytest.raises(ValueError, match=r"'0/trace/w' is a first moment"):
    tx = lowprec.store_state(optax.sgd(1e-2, 0.9), {"trace": "sqrt8:block32"})
    tx.init(params)
  # The fix the message names works, and nu takes either map.
  rules = {"mu": "companded8:block32", "nu": "sqrt8:block32"}
  state = lowprec.store_state(adam, rules).init(params)
  assert state.inner[0].mu["w"].dtype == jnp.int8
  assert str(parse_state_format("companded8:block32")) == (
    "companded8:nearest:block32"
  )
  assert str(parse_state_format("float8_e4m3fn:block256:amax")) == (
    "float8_e4m3fn:nearest:block256:amax"
  )
  assert str(parse_state_format("dynamic8:block32:float16")) == (
    "dynamic8:nearest:block32:float16"
  )


# ---- predictions -----------------------------------------------------------


@pytest.mark.parametrize(
  "spec",
  [
    "dynamic8:block256",
    "companded8:block32",
    "float8_e4m3fn:nearest:block256:amax",
    "sqrt8:block32",
  ],
)
def test_nearest_prediction_of_one_step_is_the_measured_count(spec):
  """The store holds q = Q(s); the float32 run's update d = s' - s is
  added to it. Fed q + d (float32) as its next state, the store erases
  exactly the updates `state_erasure(s, s')` predicts erased, and stalls
  those it predicts stalled: the same counts, not probabilities (seed 5,
  6 x 300 values, updates of 1e-5 to 0.1 of the value, none on the
  largest of each block, so that most blocks keep their scale)."""
  rng = np.random.default_rng(5)
  s0 = _inputs(5, _unsigned(spec))
  rel = 10.0 ** rng.uniform(-5, -1, s0.shape) * rng.choice([-1, 1], s0.shape)
  d = np.where(s0 == 0, 1e-3, s0 * rel)
  block = parse_state_format(spec).scale
  for b in range(0, 300, block):
    top = b + np.argmax(np.abs(s0[:, b : b + block]), axis=1)
    d[np.arange(6), top] = 0.0
  d = d.astype(F32)
  s1 = (s0 + d).astype(F32)
  pred = lowprec.freeze.state_erasure({"s": s0}, {"s": s1}, {"s": spec})["s"]
  q = oracle(spec, s0)[2]
  x = (q + (s1 - s0)).astype(F32)
  tx = lowprec.store_state(holder(), {"s": spec})
  params = {"w": jnp.zeros(s0.shape)}
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.asarray(s0)}, tx.init(params))
  _, state = update({"w": jnp.asarray(x)}, state)
  tel = lowprec.telemetry(state)
  assert (x != q).sum() == (s1 != s0).sum()  # the same updates change
  assert tel["state/changed"] == int(pred["changed"])
  assert tel["state/erased"] == float(pred["erased"])
  assert 0 < tel["state/erased"] < tel["state/changed"]
  # Stalls (the stored code stays) too: at least the erasures.
  stalled = int(state.counts.stalled["s/w"])
  assert stalled == float(pred["stalled"]) >= tel["state/erased"]


def test_stochastic_prediction_is_the_probability_of_staying():
  """dynamic8 at a block of scale 1: a value q on the map, an update of a
  quarter of the gap to the next entry up is erased with probability 3/4,
  one of 0.6 of the gap down with probability 0.4."""
  t = TABLES["dynamic8"]
  k = 200
  q = np.array([[1.0, t[k], t[k]]], F32)
  up = F32(t[k] + (t[k + 1] - t[k]) / 4)
  down = F32(t[k] - F32(0.6) * (t[k] - t[k - 1]))
  s1 = np.array([[1.0, up, down]], F32)
  rules = {"s": "dynamic8:stochastic:block256"}
  got = lowprec.freeze.state_erasure({"s": q}, {"s": s1}, rules)["s"]
  assert int(got["changed"]) == 2
  np.testing.assert_allclose(float(got["erased"]), 0.75 + 0.4, atol=1e-6)


def test_state_trace_follows_the_measured_curves_of_flashoptim_maps():
  """Adam (b2 = 0.999), 300 steps of 2048 gradients over three decades
  (seed 0), `mu` in companded8 and `nu` in sqrt8, blocks of 32. One
  float32 run under `state_trace` predicts both stores: the first step
  exactly (both runs start at 0), and every step within an RMSE of 0.03
  of the measured erased fraction (0.020 for mu, 0.012 for nu measured)."""
  from tests.freeze_state_test import INNER, PARAMS, _grads

  gs = _grads()
  rules = {"mu": "companded8:block32", "nu": "sqrt8:block32"}
  trace = lowprec.freeze.state_trace(INNER, {"c8": rules})
  store = lowprec.store_state(INNER, rules)

  def curves(tx, keys):
    def body(state, g):
      state = tx.update({"w": g}, state, PARAMS)[1]
      tel = lowprec.telemetry_arrays(state)
      return state, [tel[k] for k in keys]

    return jax.jit(lambda gs: jax.lax.scan(body, tx.init(PARAMS), gs)[1])(gs)

  for moment in ("mu", "nu"):
    pre = "pred_state/c8/"
    pred = curves(
      trace, [f"{pre}erased/{moment}/w", f"{pre}erased_fraction/{moment}/w"]
    )
    got = curves(
      store, [f"state/erased/{moment}/w", f"state/erased_fraction/{moment}/w"]
    )
    assert float(pred[0][0]) == int(got[0][0]) > 0
    want, meas = np.asarray(pred[1], np.float64), np.asarray(got[1], np.float64)
    assert 0.05 < meas[150:].mean() < 0.5
    assert np.sqrt(np.mean((want - meas) ** 2)) < 0.03, moment

"""Counter-based random bits keyed by (key, global element index).

`jax.random` threefry bits cost about 30x a native fp8 cast on CPU. A keyed
integer hash of the element's global (row-major) index costs about as much as
the cast, gives the same bits eager or jitted, and the same bits whether the
array is sharded or not: under jit on a `jax.sharding` mesh XLA partitions the
iota, so every device hashes the global indices of its own shard.

The hash is two rounds of the `lowbias32` integer finaliser (xor-shift /
multiply; a bijection of uint32 with full avalanche), keyed by two words
derived from the JAX key. It is for stochastic rounding, not cryptography.
Indices wrap modulo `2**32`, so arrays above `2**32` elements repeat bits.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

_RNGS = ("hash", "threefry")


def _mix(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def key_words(key) -> jax.Array:
  """The raw uint32 words of a typed (`jax.random.key`) or raw key."""
  if not isinstance(key, jax.Array | np.ndarray):
    raise TypeError(
      f"expected a JAX PRNG key, got {type(key).__name__} {key!r}; pass "
      "key=jax.random.key(seed) (e.g. jax.random.key(0))"
    )
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.dtype != jnp.uint32:
    raise TypeError(
      f"expected a JAX PRNG key, got an array of {key.dtype}; pass "
      "key=jax.random.key(seed) (e.g. jax.random.key(0))"
    )
  if key.ndim != 1:
    raise ValueError(
      f"expected a single PRNG key, got a key array of shape {key.shape}; "
      "split it and pass one key"
    )
  return key


def _seeds(key) -> tuple[jax.Array, jax.Array]:
  words = key_words(key)
  k0 = jnp.uint32(0x243F6A88)
  k1 = jnp.uint32(0x85A308D3)
  for i in range(words.shape[0]):
    k0 = _mix(k0 ^ words[i])
    k1 = _mix(k1 + words[i] + k0)
  return k0, k1


def global_index(shape) -> jax.Array:
  """Row-major flat index of every element (uint32, wraps at `2**32`)."""
  shape = tuple(int(s) for s in shape)
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for d in reversed(range(len(shape))):
    iota = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    idx = idx + iota * jnp.uint32(stride % (1 << 32))
    stride *= shape[d]
  return idx


def hash_bits(key, shape) -> jax.Array:
  """uint32 bits for every element of `shape`, from (key, global index)."""
  return hash_at(global_index(shape), *_seeds(key))


def hash_at(index, k0, k1) -> jax.Array:
  """`hash_bits`'s bits at the uint32 global indices `index`, under the
  key words `k0, k1` (`_seeds`): for code that numbers its elements
  itself (a kernel's tile)."""
  return _mix(_mix(index ^ k0) + k1)


def random_bits(key, shape, *, rng: str = "hash", width: int = 32):
  """Uniform random unsigned integers of `width` (32 or 64) bits.

  Args:
    key: a JAX PRNG key.
    shape: output shape.
    rng: "hash" (counter-based, sharding-invariant, fast) or "threefry"
      (`jax.random.bits`).
    width: 32 gives uint32, 64 gives uint64 (needs jax x64).
  """
  if rng not in _RNGS:
    raise ValueError(f"unknown rng {rng!r}; valid: {', '.join(_RNGS)}")
  if width == 64:
    hi_key, lo_key = jax.random.split(_as_typed(key))
    hi = random_bits(hi_key, shape, rng=rng).astype(jnp.uint64)
    lo = random_bits(lo_key, shape, rng=rng).astype(jnp.uint64)
    return (hi << np.uint64(32)) | lo
  if rng == "threefry":
    return jax.random.bits(_as_typed(key), shape, jnp.uint32)
  return hash_bits(key, shape)


def _as_typed(key):
  if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key_words(key))


# ---- keys of the stores: one per transform, split per step, folded per leaf


def state_key(key, who: str) -> tuple[jax.Array, object]:
  """The raw words a transform keeps in its state, and the key's
  implementation (None for a raw key), for a transform that draws bits.

  Raises:
    ValueError: `key` is None; the message names `who` and the fix.
    TypeError: `key` is not a PRNG key.
  """
  if key is None:
    raise ValueError(
      f"{who} draws random bits and needs a PRNG key: pass "
      "key=jax.random.key(seed)"
    )
  words = key_words(key)  # raises for what is not a key
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  return words, jax.random.key_impl(key) if typed else None


def next_step(words, impl) -> tuple[jax.Array, jax.Array]:
  """`(words kept for the next step, this step's key)`: one split."""
  pair = jax.random.split(jax.random.wrap_key_data(words, impl=impl))
  return jax.random.key_data(pair[0]), pair[1]


def leaf_seed(name: str) -> int:
  """The fold-in of a leaf, from its path: masking or adding a leaf
  leaves the other leaves' random streams as they were."""
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def leaf_keys(step_key, names) -> dict[str, jax.Array]:
  """`{name: key words of fold_in(step_key, leaf_seed(name))}`, in one
  vectorized fold (one threefry program rather than one per leaf)."""
  names = list(names)
  if not names:
    return {}
  seeds = jnp.asarray([leaf_seed(n) for n in names], jnp.uint32)
  fold = jax.vmap(lambda s: jax.random.fold_in(step_key, s))
  words = jax.random.key_data(fold(seeds))
  return {n: words[i] for i, n in enumerate(names)}

"""Rounding throughput: 2**24 float32 values under jit, vs a native cast."""

from __future__ import annotations

import time

import gfloat
import jax
import jax.numpy as jnp
import numpy as np
from gfloat.formats import format_info_ocp_e4m3

import lowprec
from scripts.benchlib import Result, interleave

FMT = "float8_e4m3fn"


def run(quick: bool = False) -> Result:
  n = 1 << (20 if quick else 24)
  repeats = 3 if quick else 9  # rounds
  x = jnp.asarray(np.random.default_rng(0).normal(0, 30, n).astype(np.float32))
  key = jax.random.key(0)
  fns = {
    "float32 copy (memory floor)": jax.jit(lambda v: -v),
    "native astype float8_e4m3fn": jax.jit(
      lambda v: v.astype(jnp.float8_e4m3fn)
    ),
    "native astype e4m3fn and back": jax.jit(
      lambda v: v.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    ),
    "round_nearest": jax.jit(lambda v: lowprec.round_nearest(v, FMT)),
    "round_nearest to float8 (dtype=)": jax.jit(
      lambda v: lowprec.round_nearest(v, FMT, dtype=jnp.float8_e4m3fn)
    ),
    "round_stochastic (hash bits)": jax.jit(
      lambda v, k: lowprec.round_stochastic(v, FMT, k)
    ),
    "round_stochastic to float8 (dtype=)": jax.jit(
      lambda v, k: lowprec.round_stochastic(v, FMT, k, dtype=jnp.float8_e4m3fn)
    ),
    "round_stochastic (threefry bits)": jax.jit(
      lambda v, k: lowprec.round_stochastic(v, FMT, k, rng="threefry")
    ),
  }
  calls = {
    name: (fn, (x, key) if "stochastic" in name else (x,))
    for name, fn in fns.items()
  }
  times = interleave(calls, rounds=repeats, repeats=3 if quick else 5)
  # gfloat is a numpy reference implementation: time a slice and scale up.
  part = np.asarray(x[: n // 64], np.float64)
  t0 = time.perf_counter()
  gfloat.round_ndarray(format_info_ocp_e4m3, part, sat=True)
  scaled = (time.perf_counter() - t0) * 64
  times["gfloat round_ndarray (numpy, scaled; one run)"] = [scaled] * repeats
  return Result(
    f"rounding: 2^{n.bit_length() - 1} float32 values to {FMT}",
    times,
    ("native astype float8_e4m3fn", "native astype e4m3fn and back"),
  )

"""Stored AdamW moments on the fixed gradient stream of the PyTorch peers.

  python -m scripts.peer_stream [--steps N] [--seeds K] [--only LABEL ...]

Draws the stream in-process as the peers' generator does (numpy seed 1234:
bf16 initial weights of sd 0.1, then per coordinate a gradient magnitude
10^U(-2, 0), a persistent mean and a noise level, then 1000 steps of
bf16-representable gradients over 16,384 coordinates; a learning rate of
1e-3 peak, 50 warmup steps and a cosine to 0 at step 1000). Runs float32
AdamW (`optax.adamw`: b1 0.9, b2 0.999, eps 1e-8, weight decay 0.1, the
learning rate of each step) and the same AdamW with its moments stored by
each recipe (`lowprec.store_state`, float32 weights), and prints the RMS
over coordinates of (final weights - float32 final weights) in units of
U = 2^-11, beside the number the PyTorch peers report for the same recipe
(torchao 0.18). Stochastic recipes are averaged over `--seeds` keys.

`--steps N` runs the first N steps of the same stream (the schedule still
ends at step 1000). About a minute for the whole table on two CPU cores.
"""

if not __package__:  # run as a file, `python scripts/peer_stream.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.peer_stream ..."
  )

import argparse
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

import lowprec

T, D = 1000, 16384
U = 2.0**-11  # the bf16 gap for |w| in [1/16, 1/8)
HP = {"lr_peak": 1e-3, "warmup": 50, "b1": 0.9, "b2": 0.999, "eps": 1e-8}
HP["wd"] = 0.1


class Recipe(NamedTuple):
  label: str
  rules: dict  # store_state rules; {} is float32 AdamW
  peer: str  # what the PyTorch peers report for it, in U ("" if none)


E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
RECIPES = (
  Recipe(
    "e4m3 both, nearest, block256:amax (torchao AdamWFp8)",
    {
      "mu": f"{E4M3}:nearest:block256:amax",
      "nu": f"{E4M3}:nearest:block256:amax",
    },
    "1529",
  ),
  Recipe(
    "dynamic8 mu, dynamic8u nu, block256 (torchao AdamW8bit)",
    {"mu": "dynamic8:block256", "nu": "dynamic8u:block256"},
    "57",
  ),
  Recipe(
    "dynamic8 (signed) both, block256",
    {"mu": "dynamic8:block256", "nu": "dynamic8:block256"},
    "",
  ),
  Recipe(
    "dynamic8 mu, dynamic8u nu, block2048",
    {"mu": "dynamic8:block2048", "nu": "dynamic8u:block2048"},
    "",
  ),
  Recipe(
    "dynamic8 (signed) both, block2048",
    {"mu": "dynamic8:block2048", "nu": "dynamic8:block2048"},
    "",
  ),
  Recipe(
    "companded8 mu, sqrt8 nu, block32 (FlashOptim)",
    {"mu": "companded8:block32", "nu": "sqrt8:block32"},
    "",
  ),
  Recipe(
    "dynamic4 mu, uint4nz nu, block128 (torchao AdamW4bit)",
    {"mu": "dynamic4:block128", "nu": "uint4nz:block128"},
    "",
  ),
  Recipe(
    "int4:amax mu, uint4nz nu, block128",
    {"mu": "int4:nearest:block128:amax", "nu": "uint4nz:block128"},
    "",
  ),
  Recipe(
    "e4m3 both, nearest, block256 (power-of-two scales)",
    {"mu": f"{E4M3}:nearest:block256", "nu": f"{E4M3}:nearest:block256"},
    "4724",
  ),
  Recipe(
    "mu e4m3 / nu e5m2, stochastic, block128",
    {"mu": f"{E4M3}:stochastic:block128", "nu": f"{E5M2}:stochastic:block128"},
    "46.5",
  ),
  Recipe(
    "dynamic8 mu, dynamic8u nu, stochastic, block256",
    {
      "mu": "dynamic8:stochastic:block256",
      "nu": "dynamic8u:stochastic:block256",
    },
    "",
  ),
)


def _bf16(x) -> np.ndarray:
  """float32 values on the bfloat16 grid (float64 -> float32 -> bf16)."""
  x = np.asarray(x, np.float32)
  return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def learning_rates(steps: int = T) -> np.ndarray:
  """float32 per step: linear warmup to the peak, then a cosine to 0 at
  step T."""
  t = np.arange(steps, dtype=np.float64)
  peak, warmup = HP["lr_peak"], HP["warmup"]
  cosine = (
    0.5
    * peak
    * (1 + np.cos(np.pi * np.clip((t - warmup) / (T - warmup), 0, 1)))
  )
  return np.where(t < warmup, peak * (t + 1) / warmup, cosine).astype(
    np.float32
  )


def stream(steps: int = T):
  """`(g [steps, D], w0 [D], lr [T])`, float32, as the peers draw them."""
  rng = np.random.default_rng(1234)
  w0 = _bf16(0.1 * rng.standard_normal(D))
  size = 10.0 ** rng.uniform(-2, 0, D)
  mean = size * rng.standard_normal(D)
  noise = size * rng.uniform(0.5, 3.0, D)
  g = np.empty((steps, D), np.float32)
  for t in range(steps):
    g[t] = _bf16(mean + noise * rng.standard_normal(D))
  return g, w0, learning_rates()


def adamw(lr: np.ndarray) -> optax.GradientTransformation:
  """float32 AdamW with the learning rate of each step."""
  table = jnp.asarray(lr)
  return optax.adamw(
    lambda count: table[count],
    b1=HP["b1"],
    b2=HP["b2"],
    eps=HP["eps"],
    weight_decay=HP["wd"],
  )


def final_weights(g, w0, lr, rules: dict, seed: int = 0) -> np.ndarray:
  """The weights after `len(g)` steps of AdamW, its moments stored by
  `rules` (float32 AdamW for `{}`)."""
  tx = adamw(lr)
  if rules:
    tx = lowprec.store_state(tx, rules, key=jax.random.key(seed))
  params = {"w": jnp.asarray(w0)}

  @jax.jit
  def run(params, state, gs):
    def body(carry, grad):
      params, state = carry
      updates, state = tx.update({"w": grad}, state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(body, (params, state), gs)[0][0]

  # The initial state, eagerly, is an argument: XLA would fold a constant
  # one, slowly.
  state = tx.init(params)
  return np.asarray(run(params, state, jnp.asarray(g))["w"])


def rms_u(w, ref) -> float:
  """RMS over coordinates of `w - ref`, in U = 2^-11."""
  d = np.asarray(w, np.float64) - np.asarray(ref, np.float64)
  return float(np.sqrt(np.mean(d * d)) / U)


def state_bytes(rules: dict) -> float:
  """Bytes per parameter of AdamW's stored moments (codes and scales)."""
  params = {"w": jax.ShapeDtypeStruct((D,), jnp.float32)}
  tx = adamw(learning_rates())
  if rules:
    tx = lowprec.store_state(tx, rules, key=jax.random.key(0))
  return lowprec.bytes_per_param(params, jax.eval_shape(tx.init, params)).state


def stochastic(rules: dict) -> bool:
  return any(
    ":stochastic" in spec or ":deadzone" in spec for spec in rules.values()
  )


def table(steps: int = T, seeds: int = 3, recipes=RECIPES, out=print) -> list:
  """Runs float32 AdamW and every recipe; prints and returns the rows
  `(label, bytes per parameter, RMS in U, peer, seconds)`."""
  g, w0, lr = stream(steps)
  ref = final_weights(g, w0, lr, {})
  out(f"{steps} steps x {D} coordinates; U = 2^-11")
  out("| recipe | state bytes/param | RMS (U) | PyTorch peer (U) |")
  out("|---|---:|---:|---:|")
  rows = []
  for r in recipes:
    start = time.perf_counter()
    n = seeds if stochastic(r.rules) else 1
    rms = np.mean(
      [rms_u(final_weights(g, w0, lr, r.rules, s), ref) for s in range(n)]
    )
    label = r.label + (f" ({n} seeds)" if n > 1 else "")
    rows.append(
      (
        label,
        state_bytes(r.rules),
        float(rms),
        r.peer,
        time.perf_counter() - start,
      )
    )
    out(f"| {label} | {rows[-1][1]:.4g} | {rms:.4g} | {r.peer} |")
  return rows


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=T, help=f"1 to {T}")
  ap.add_argument(
    "--seeds", type=int, default=3, help="keys per stochastic recipe"
  )
  ap.add_argument(
    "--only",
    nargs="*",
    default=None,
    help="run the recipes whose label contains one of these words",
  )
  args = ap.parse_args(argv)
  if not 1 <= args.steps <= T:
    ap.error(f"--steps takes 1 to {T}, got {args.steps}")
  recipes = RECIPES
  if args.only:
    recipes = [r for r in RECIPES if any(w in r.label for w in args.only)]
    if not recipes:
      ap.error(
        f"--only matches no recipe; labels: {[r.label for r in RECIPES]}"
      )
  table(args.steps, args.seeds, recipes)


if __name__ == "__main__":
  main()

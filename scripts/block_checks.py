"""Prints the FP8/FP4 recipe choices, predicted and verified on one layer.

  python -m scripts.block_checks [--n_forward 1024] [--seed 0]

Each row: a choice a recipe makes about a dense layer's GEMMs
(`experiments.block_checks.CHOICES`), what `lowprec.audit.predict` says it
does to the mean gradient, what Monte Carlo measures (`audit.verify`, the
forward held fixed; biased when |z| >= 4 or the difference is the same
nonzero value in every draw), and the noise of one gradient draw. Then the
bytes each weight-orientation scheme stores. The tables of
docs/block_scaled.md.
"""

if not __package__:  # run as a file, `python scripts/block_checks.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.block_checks ..."
  )

from absl import app, flags  # noqa: E402

from experiments import block_checks  # noqa: E402
from lowprec.backward.ops import ScaledDense  # noqa: E402

_N = flags.DEFINE_integer("n_forward", 1024, "Forward draws per check.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the Monte Carlo keys.")

SCHEMES = (
  ("NVFP4, 16x16 tiles (one copy)", ScaledDense.nvfp4()),
  ("NVFP4, 1x16 blocks (two copies)", ScaledDense.nvfp4(kernel_blocks="1d")),
  ("MXFP8, 1x32 blocks (two copies)", ScaledDense.mxfp8()),
  ("MXFP8, 32x32 tiles (one copy)", ScaledDense.mxfp8(kernel_blocks="2d")),
  ("bf16", ScaledDense(kernel="bfloat16")),
)


def bytes_table(k: int = 4096, n: int = 4096) -> str:
  lines = [
    f"| weights of a {k} x {n} layer | forward copy | data-gradient copy "
    "| bytes/param |",
    "|---|---:|---:|---:|",
  ]
  for name, op in SCHEMES:
    f, d = op.kernel_bytes(k, n)
    lines.append(
      f"| {name} | {f / 2**20:.3f} MiB | {d / 2**20:.3f} MiB | "
      f"{(f + d) / (k * n):.4f} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  rows = block_checks.run(_N.value, _SEED.value)
  print(block_checks.markdown(rows))
  print()
  print(bytes_table())
  bad = [r.choice.name for r in rows if not r.agrees]
  print("\npredictions that did not hold: " + ("; ".join(bad) or "none"))


if __name__ == "__main__":
  app.run(main)

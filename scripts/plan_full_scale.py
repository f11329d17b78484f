"""What the full-scale configs cost, and a check that they step.

  python -m scripts.plan_full_scale                 # the table (compiles)
  python -m scripts.plan_full_scale --step --config attention_reuse \
      --batch_size 2 --steps 1                      # build, step, measure
  python -m scripts.plan_full_scale --step --config freeze_gpt2_fp8 \
      --batch_size 4 --steps 2 --model n_layer=1,d_model=32  # tiny shapes
  python -m scripts.plan_full_scale --roofline --config freeze_gpt2_fp8 \
      --recipe float32 --model compute_dtype=bfloat16  # bound on an H200

The table: parameters, tokens and model FLOPs per step (checked against
XLA's cost analysis), bytes per device from XLA's memory analysis, and
wall-clock at each device's peak (see experiments/costs.py). `--step` runs
the full-scale model on synthetic token files and prints one JSON line:
losses, probe, step time, tokens/s and peak memory. docs/scaling.md holds
the numbers measured. `--roofline` compiles (without running) the
step's gradient pass and optimizer at a few small shapes and prints, per
config, recipe and device, the step time its FLOPs and XLA's byte count
bound (`experiments.costs.roofline`), one JSON line each.
"""

from __future__ import annotations

if not __package__:  # run as a file, `python scripts/plan_full_scale.py`
  raise SystemExit(
    "run it from the repository root as a module: "
    "python -m scripts.plan_full_scale ..."
  )


import argparse
import importlib
import json
import sys
import tempfile


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--config", action="append", help="config name(s); default: all"
  )
  parser.add_argument("--data_dir", default="", help="token files (made)")
  parser.add_argument(
    "--per_device_batch",
    type=int,
    default=None,
    help="rows per microbatch for the memory analysis (default: config's)",
  )
  parser.add_argument(
    "--skip_probe", action="store_true", help="table without the probe"
  )
  parser.add_argument("--step", action="store_true", help="run steps")
  parser.add_argument(
    "--roofline",
    action="store_true",
    help="the step time FLOPs and bytes bound on an accelerator",
  )
  parser.add_argument(
    "--device",
    action="append",
    default=None,
    help="with --roofline: H100, H200 (default: both)",
  )
  parser.add_argument("--steps", type=int, default=1)
  parser.add_argument("--batch_size", type=int, default=None)
  parser.add_argument("--virtual_shards", type=int, default=None)
  parser.add_argument("--probe_every_steps", type=int, default=None)
  parser.add_argument("--probe_draws", type=int, default=None)
  parser.add_argument("--probe_batch_size", type=int, default=None)
  parser.add_argument("--probe_chunk_rows", type=int, default=None)
  parser.add_argument(
    "--probe_groups", default=None, help="probe groups (name=regex,...)"
  )
  parser.add_argument(
    "--model",
    default="",
    help="model.* overrides for --step and --roofline, e.g. "
    "n_layer=1,d_model=32 (integers, true/false or names: tiny shapes for a "
    "dry run, scan_layers=false, compute_dtype=bfloat16)",
  )
  parser.add_argument(
    "--recipe",
    action="append",
    default=None,
    help="with --step or --roofline: each config once per storage recipe "
    "(lowprec.recipes names: float32, bf16_rn, bf16_sr, bf16_kahan, "
    "bf16_split8, bf16_eco, bf16_sr+q8, ...), one JSON line each",
  )
  parser.add_argument(
    "--probe_remat",
    action="store_true",
    help="the probe's passes recompute each block (one block's activations)",
  )
  args = parser.parse_args(argv)
  importlib.import_module("experiments.xla_flags")  # before jax starts
  from experiments import costs

  names = args.config or list(costs.planned())
  data_dir = args.data_dir or tempfile.mkdtemp(prefix="lowprec_tokens_")
  if args.roofline:
    model = _model_overrides(parser, args.model) if args.model else {}
    devices = args.device or ["H100", "H200"]
    for device in devices:
      if device not in costs.HBM_BANDWIDTH:
        parser.error(
          f"--device {device!r}: the roofline knows "
          f"{', '.join(costs.HBM_BANDWIDTH)}"
        )
    for name in names:
      for recipe in args.recipe or [None]:
        for r in costs.roofline_of(name, data_dir, recipe, model, devices):
          print(costs.describe_roofline(r), file=sys.stderr, flush=True)
          print(json.dumps(r), flush=True)
    return
  if not args.step:
    costs.main(names, data_dir, args.per_device_batch, not args.skip_probe)
    return
  keys = ("batch_size", "virtual_shards", "probe_draws", "probe_batch_size")
  keys += ("probe_chunk_rows", "probe_every_steps", "probe_groups")
  overrides = {
    k: getattr(args, k) for k in keys if getattr(args, k) is not None
  }
  if args.probe_remat:
    overrides["probe_remat"] = True
  if args.model:
    overrides["model"] = _model_overrides(parser, args.model)
  for name in names:
    for recipe in args.recipe or [None]:
      kw = dict(overrides, recipe=recipe) if recipe else dict(overrides)
      result = costs.step(name, data_dir, args.steps, **kw)
      print(costs.describe(result), file=sys.stderr, flush=True)
      print(json.dumps(result), flush=True)


def _model_overrides(parser, text: str) -> dict[str, int | bool]:
  out = {}
  for item in text.split(","):
    key, _, value = item.partition("=")
    value = value.strip()
    if value.lower() in ("true", "false"):
      out[key.strip()] = value.lower() == "true"
      continue
    if value.isidentifier():  # a name: compute_dtype=bfloat16
      out[key.strip()] = value
      continue
    if not value.lstrip("-").isdigit():
      parser.error(
        "--model takes key=integer, key=true/false or key=name pairs, got "
        f"{item!r}"
      )
    out[key.strip()] = int(value)
  return out


if __name__ == "__main__":
  main()

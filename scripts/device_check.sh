#!/usr/bin/env bash
# One prepared check of the full-scale configs on a machine with an
# accelerator (GPU or TPU), in under 10 minutes:
#
#   bash scripts/device_check.sh [WORK_DIR]
#
# Makes synthetic token files, runs each full-scale config (GPT-2 124M of
# freeze_gpt2_fp8, the 390M GPT of attention_reuse with its probe) for 20
# steps of a reduced batch, and prints tokens/s, MFU (against the peaks in
# experiments/plan.py) and peak device memory per config, then the ratios of
# scripts/bench.py on this device. Each part has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=${1:-$(mktemp -d)}
STEPS=${STEPS:-20}
mkdir -p "$WORK"
echo "work dir: $WORK"
timeout 60 "$PY" -c "import jax; print(jax.devices())" || exit 1
status=0
run() {  # name, time limit (s), then plan_full_scale --step arguments
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$PY" -m scripts.plan_full_scale --step --config "$name" \
    --data_dir "$WORK/tokens" --steps "$STEPS" "$@" \
    >"$WORK/$name.json" || { echo "$name: failed or timed out"; status=1; }
}
# 64 x 1024 and 32 x 1024 tokens per step, 8 microbatches each.
run freeze_gpt2_fp8 200 --batch_size 64 --virtual_shards 8
run attention_reuse 240 --batch_size 32 --virtual_shards 8
timeout 120 "$PY" -m scripts.bench --quick || { echo "bench failed"; status=1; }
exit $status

#!/usr/bin/env bash
# One prepared check of the full-scale configs on a machine with an
# accelerator (GPU or TPU), in under 8 minutes, without network:
#
#   bash scripts/device_wheels.sh   # here, with network: wheels into .whl/
#   bash scripts/device_check.sh    # there (OUT=DIR: where results go)
#
# Installs the wheels of .whl/ into a target folder (what the machine's
# image lacks), prints the versions and devices, checks the golden bits of
# every storage recipe (tests/golden_bits.json) with XLA's default flags
# and with --xla_allow_excess_precision=false, runs each full-scale
# config (GPT-2 124M of freeze_gpt2_fp8; the 390M GPT of attention_reuse
# with its probe) for $STEPS steps of a reduced batch on synthetic token
# files, GPT-2 124M once per write-back family (float32, nearest,
# stochastic, Kahan, split, ECO, 8-bit state), each section of
# scripts/bench.py, and the frontier study's smoke with the advisor. Each part runs under its own
# time limit and a failing part does not stop the others. Results:
# device_check.json and device_check.md (per config tokens/s, MFU, peak
# device memory, compile time; the benchmark ratios; each part's status) in
# $OUT when set, else in the repository; each part's output in
# device_check/ there. Exit status 0 when every part passed.
#
# DEVICE_CHECK_DRY=1 runs the same parts on the CPU with tiny shapes (a
# 1-layer d=32 model, 2 steps, the rounding benchmark only) in about a
# minute and a half; tests/device_check_test.py runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${DEVICE_CHECK_DRY:-0}
RESULTS=${OUT:-$PWD}
PARTS=$RESULTS/device_check
SITE=${DEVICE_CHECK_SITE:-/tmp/site}
BUDGET=${DEVICE_CHECK_BUDGET_S:-470}  # seconds for all parts together
WORK=$(mktemp -d)  # token files: not results
mkdir -p "$PARTS"
: >"$PARTS/parts.tsv"
START=$SECONDS
status=0

part() {  # name, time limit (s), command...: runs one part, records it
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START) - 20))  # 20 s kept for the report
  if ((left < 10)); then
    printf '%s\tskipped\t0\t0\n' "$name" >>"$PARTS/parts.tsv"
    echo "$name: skipped (out of time)"
    status=1
    return
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS rc
  echo "== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" >"$PARTS/$name.out" 2>"$PARTS/$name.err"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" \
    >>"$PARTS/parts.tsv"
  if ((rc != 0)); then
    local why="exit $rc"
    ((rc == 124 || rc == 137)) && why="timed out after $limit s"
    echo "$name: $why; last lines of $PARTS/$name.err:"
    tail -n 5 "$PARTS/$name.err"
    status=1
  fi
}

if [[ $DRY == 1 ]]; then
  # The CPU, tiny shapes: the same code paths in seconds.
  export JAX_PLATFORMS=cpu
  STEPS=${STEPS:-2}
  GPT2=(--batch_size 2 --virtual_shards 1)
  ATTN=(--batch_size 2 --virtual_shards 1 --probe_draws 2
    --probe_batch_size 2)
  TINY=(--model n_layer=1,n_head=2,d_model=32,seq_len=32,vocab_size=256)
  BENCH=(rounding)
  FAMILY_STEPS=2
else
  STEPS=${STEPS:-20}
  # 64 x 1024 and 32 x 1024 tokens per step, 8 microbatches each.
  GPT2=(--batch_size 64 --virtual_shards 8)
  ATTN=(--batch_size 32 --virtual_shards 8)
  TINY=()
  BENCH=(rounding writeback trace ops train user_ops frontier)
  FAMILY_STEPS=4
fi

if [[ $DRY != 1 ]] && compgen -G ".whl/*.whl" >/dev/null; then
  # Without pip, unpack them: every wheel of the list is pure Python.
  part wheels 60 bash -c 'python3 -m pip install -q --no-index --no-deps \
    --upgrade --target "$0" "$@" || { echo "pip failed; unpacking" >&2;
    for w in "$@"; do python3 -m zipfile -e "$w" "$0" || exit 1; done; }' \
    "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

part env 60 python3 -m scripts.device_report --env
cat "$PARTS/env.out"
# Golden bits: every recipe's stored outputs on fixed float32 inputs must
# equal the CPU's bit for bit, with XLA's default flags and with excess
# precision off; the AdamW records are information.
part golden_bits 90 python3 -m experiments.golden_bits \
  --json "$PARTS/golden_bits.json"
part golden_bits_no_excess 90 python3 -m experiments.golden_bits \
  --no_excess_precision --json "$PARTS/golden_bits_no_excess.json"
step() {  # config name, time limit (s), plan_full_scale --step arguments
  local name=$1 limit=$2
  shift 2
  part "step_$name" "$limit" python3 -m scripts.plan_full_scale --step \
    --config "$name" --data_dir "$WORK/tokens_$name" --steps "$STEPS" \
    "${TINY[@]}" "$@"
}
step freeze_gpt2_fp8 140 "${GPT2[@]}"
# One compiled step per write-back family on the same model, a few steps
# each: what a user pays for each recipe against float32 AdamW.
part families 150 python3 -m scripts.plan_full_scale --step \
  --config freeze_gpt2_fp8 --data_dir "$WORK/tokens_families" \
  --steps "$FAMILY_STEPS" "${TINY[@]}" "${GPT2[@]}" \
  --recipe float32 --recipe bf16_rn --recipe bf16_sr --recipe bf16_kahan \
  --recipe bf16_split8 --recipe bf16_eco --recipe "bf16_sr+q8"
step attention_reuse 170 "${ATTN[@]}"
for section in "${BENCH[@]}"; do
  part "bench_$section" 30 python3 -m scripts.bench "$section" --quick \
    --json "$PARTS/bench_$section.json"
done
# The frontier study's smoke (the float32 arm with every trace and one
# recipe), then the advisor on its float32 run.
part frontier 180 bash -c 'python3 -m experiments.run \
  --config configs/frontier.py:scale=smoke \
  --config.log.results_dir="$0/results" && python3 -m scripts.advise \
  --config configs/frontier.py:scale=smoke --results "$0/results" \
  --out "$1/frontier_advice.py" --code "$1/frontier_optax.py"' \
  "$WORK" "$PARTS"
dry=()
[[ $DRY == 1 ]] && dry=(--dry_run)
timeout 60 python3 -m scripts.device_report --parts "$PARTS" \
  --out "$RESULTS" "${dry[@]}" || status=1
rm -rf "$WORK"
echo "results: $RESULTS/device_check.json, $RESULTS/device_check.md" \
  "($((SECONDS - START)) s)"
exit $status

#!/usr/bin/env bash
# One prepared check of the full-scale configs on a machine with an
# accelerator (GPU or TPU), in 8 minutes, without network:
#
#   bash scripts/device_wheels.sh   # here, with network: wheels into .whl/
#   bash scripts/device_check.sh    # there (OUT=DIR: where results go)
#
# The parts, in the order of their value, each under the time limit of
# the plan (experiments/device_plan.py: the expected seconds on an H200
# and the limits, which add up to the budget less 10 s for the report;
# `python3 -m scripts.device_report --plan` prints it, and so does the
# check before it starts): installs the wheels of .whl/ into a target
# folder (what the machine's image lacks); prints the versions and
# devices; checks the golden bits of every storage recipe
# (tests/golden_bits.json) with XLA's default options and with excess
# precision off, in one process; runs each full-scale config (GPT-2 124M
# of freeze_gpt2_fp8; the 390M GPT of attention_reuse with its probe) for
# $STEPS steps of a reduced batch on synthetic token files; the write-back
# families (float32, nearest, stochastic, Kahan, split, ECO, 8-bit state)
# on two layers of the 124M width, a few steps each; the rounding and
# write-back sections of scripts/bench.py --quick; the frontier study's
# smoke (its float32 arm, every trace) and the advisor on it. A failing
# part does not stop the others. The parts share a persistent compilation
# cache (JAX_COMPILATION_CACHE_DIR, default /tmp/lowprec-device-xla), so a
# second check on the same machine compiles little; the report says how
# many programs it held at the start.
#
# Results: device_check.json and device_check.md (each part's status,
# seconds, expected seconds and limit, peak memory where it measures it;
# per config tokens/s, MFU, peak device memory, compile time; per family
# the step relative to float32's; the golden bits; the benchmark ratios;
# the advice) in $OUT when set, else in the repository, rewritten after
# every part so that a check stopped midway keeps what finished; each
# part's output in device_check/ there. Exit status 0 when every part
# passed.
#
# DEVICE_CHECK_DRY=1 prints the plan, then runs every part on the CPU with
# tiny shapes (a d=32 model, 2 steps; the same golden bits, benchmark
# sections and smoke) under a limit of its own per part;
# tests/device_check_test.py runs it among the slow tests.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${DEVICE_CHECK_DRY:-0}
RESULTS=${OUT:-$PWD}
PARTS=$RESULTS/device_check
SITE=${DEVICE_CHECK_SITE:-/tmp/site}
WORK=$(mktemp -d)  # token files: not results
dry=()
[[ $DRY == 1 ]] && dry=(--dry_run)
plan() { python3 -m scripts.device_report "$@" "${dry[@]}"; }
BUDGET=${DEVICE_CHECK_BUDGET_S:-$(plan --budget)}  # all parts and the report
RESERVE=$(plan --reserve)  # seconds kept for the report
: "${JAX_COMPILATION_CACHE_DIR:=/tmp/lowprec-device-xla}"
: "${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:=0}"  # every program
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
mkdir -p "$PARTS"
: >"$PARTS/parts.tsv"
START=$SECONDS
status=0

report() {  # writes device_check.json and .md from what the parts left
  timeout 60 python3 -m scripts.device_report --parts "$PARTS" \
    --out "$RESULTS" "${dry[@]}" "$@"
}

part() {  # name, command...: runs one part under its limit, records it
  local name=$1
  shift
  local limit left t0 rc
  limit=$(plan --limit "$name") || exit 2  # a part the plan lacks
  left=$((BUDGET - (SECONDS - START) - RESERVE))
  if ((left < 5)); then
    printf '%s\tskipped\t0\t0\n' "$name" >>"$PARTS/parts.tsv"
    echo "$name: skipped (out of time)"
    status=1
    report --quiet
    return
  fi
  ((limit > left)) && limit=$left
  t0=$SECONDS
  echo "== $name (limit ${limit} s)"
  timeout --kill-after=5 "$limit" "$@" >"$PARTS/$name.out" \
    2>"$PARTS/$name.err"
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
  report --quiet || status=1
}

plan --plan
if [[ $DRY == 1 ]]; then
  # The CPU, tiny shapes: the same code paths in seconds.
  export JAX_PLATFORMS=cpu
  STEPS=${STEPS:-2}
  GPT2=(--batch_size 2 --virtual_shards 1)
  ATTN=(--batch_size 2 --virtual_shards 1 --probe_draws 2
    --probe_batch_size 2)
  TINY=n_head=2,d_model=32,seq_len=32,vocab_size=256
  MODEL=(--model "n_layer=1,$TINY")
  FAMILY_MODEL=(--model "n_layer=2,$TINY")
  FAMILY_STEPS=2
else
  STEPS=${STEPS:-10}
  # 64 x 1024 and 32 x 1024 tokens per step, 8 microbatches each.
  GPT2=(--batch_size 64 --virtual_shards 8)
  ATTN=(--batch_size 32 --virtual_shards 8)
  MODEL=()
  # The families: two layers of the 124M width (what each recipe costs
  # against float32 is per parameter; fewer layers compile faster).
  FAMILY_MODEL=(--model n_layer=2)
  FAMILY_STEPS=4
fi

if [[ $DRY != 1 ]] && compgen -G ".whl/*.whl" >/dev/null; then
  # Without pip, unpack them: every wheel of the list is pure Python.
  part wheels bash -c 'python3 -m pip install -q --no-index --no-deps \
    --upgrade --target "$0" "$@" || { echo "pip failed; unpacking" >&2;
    for w in "$@"; do python3 -m zipfile -e "$w" "$0" || exit 1; done; }' \
    "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

part env python3 -m scripts.device_report --env
cat "$PARTS/env.out"
# Golden bits: every recipe's stored outputs on fixed float32 inputs must
# equal the CPU's bit for bit, with XLA's default options and with excess
# precision off (one process, each recipe compiled under both); the AdamW
# records are information.
part golden_bits python3 -m experiments.golden_bits \
  --settings default,no_excess_precision --json "$PARTS/golden_bits.json"
step() {  # config name, plan_full_scale --step arguments
  local name=$1
  shift
  part "step_$name" python3 -m scripts.plan_full_scale --step \
    --config "$name" --data_dir "$WORK/tokens_$name" --steps "$STEPS" \
    "${MODEL[@]}" "$@"
}
step freeze_gpt2_fp8 "${GPT2[@]}"
step attention_reuse "${ATTN[@]}"
# One compiled step per write-back family, a few steps each: what a user
# pays for each recipe against float32 AdamW (a line per recipe as it
# finishes).
part families python3 -m scripts.plan_full_scale --step \
  --config freeze_gpt2_fp8 --data_dir "$WORK/tokens_families" \
  --steps "$FAMILY_STEPS" "${FAMILY_MODEL[@]}" "${GPT2[@]}" \
  --recipe float32 --recipe bf16_rn --recipe bf16_sr --recipe bf16_kahan \
  --recipe bf16_split8 --recipe bf16_eco --recipe "bf16_sr+q8"
for section in rounding writeback; do
  part "bench_$section" python3 -m scripts.bench "$section" --quick \
    --json "$PARTS/bench_$section.json"
done
# The frontier study's smoke, its float32 arm (the one carrying every
# trace), then the advisor on it.
part frontier bash -c 'python3 -m experiments.run \
  --config configs/frontier.py:scale=smoke,arm=fp32 \
  --config.log.results_dir="$0/results" && python3 -m scripts.advise \
  --config configs/frontier.py:scale=smoke --results "$0/results" \
  --out "$1/frontier_advice.py" --code "$1/frontier_optax.py"' \
  "$WORK" "$PARTS"
report || status=1
rm -rf "$WORK"
echo "results: $RESULTS/device_check.json, $RESULTS/device_check.md" \
  "($((SECONDS - START)) s)"
exit $status

#!/usr/bin/env bash
# The one command a GPU session runs, from the repository root:
#
#     bash scripts/device_check.sh              # on the GPU machine (about 6 minutes)
#     bash scripts/device_check.sh --dry-run    # the same stages on a CPU, in the Pallas
#                                               # interpreter (about 2 minutes)
#     bash scripts/device_check.sh --stages env,bench,profile   # some stages, in this order
#
# Stages (by default in this order; --stages gives any order), each under its own
# `timeout`, each logged into $OUT; a failing stage is recorded and the next one still runs:
#   env      nvidia-smi, python / jax / jaxlib versions, jax.devices()     -> env.log
#   pytest   tests/test_gpu_device.py in 3 pytest processes at once
#            (scripts/run_device_tests.py): compiled kernels vs the
#            reference, the engine with backend="gpu" vs "xla", then
#            kv_memory_fraction alone                                      -> pytest.log,
#                                                          pytest_shard*.log, gpu_test_errors.jsonl
#   bench    scripts/bench_kernels.py --out $OUT: copy bandwidth, matmul
#            TFLOP/s, decode cases vs JAX's bundled kernel and dense XLA,
#            ragged cases; one JSON line per finished row                  -> bench.log,
#                                                                             bench_kernels.jsonl
#   profile  scripts/profile_decode.py at (32, 4096), page 16: where the
#            time goes (kernel, merge, scattered pages, fixed cost)        -> profile.log,
#                                                                             profile_decode.jsonl
#   ncu      one launch of that kernel under Nsight Compute (counters:
#            DRAM throughput, occupancy, stall reasons), if ncu is there   -> ncu.log
#   memory   scripts/bench_step_memory.py: XLA:GPU's buffers for the
#            engine's compiled steps at Llama-3-8B's shapes (bf16, one
#            layer; compiled, not run) against the step reserve           -> memory.log,
#                                                                             step_memory.json
# and, on a GPU, nvidia-smi dmon (clocks, power, temperature) throughout -> dmon.log
#   tune     (only when named in --stages) scripts/tune_kernels.py: joint
#            sweeps of the knobs per shape, to choose the defaults         -> tune.log,
#                                                                             tune.jsonl
#   lora     (only when named in --stages) scripts/bench_lora.py: LoRA's
#            cost on the decode path, llama3.2-1b in bf16, 4 rank-16
#            adapters, batch 1 and 32                                      -> lora.log
# and a summary (each stage's exit code and duration, the test counts, the bench
# rows) printed at the end and written to summary.txt. Everything in $OUT is also packed
# into $OUT.tgz beside it (the device tool brings back at most 8 files).
#
# Environment: OUT (default ./device_out); PYTHON (default python3);
# DEVICE_CHECK_DEADLINE_S (default 540): the whole run's time, which clips each
# stage's limit; DEVICE_CHECK_LIMITS (e.g. pytest=200,ncu=45): other stage limits
# (defaults env 60, pytest 220, bench 250, profile 90, ncu 60, memory 60, tune 200,
# lora 150);
# DEVICE_CHECK_DRY_RUN=1 is --dry-run; DEVICE_TEST_SHARDS (default 3; 2 in a dry run).
# Nothing is installed: the code runs from the tree with PYTHONPATH=.
set -u

DRY_RUN=${DEVICE_CHECK_DRY_RUN:-0}
STAGES=env,pytest,bench,profile,ncu,memory
while (($#)); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --stages)
      STAGES=${2:-}
      shift
      ;;
    --stages=*) STAGES=${1#--stages=} ;;
    -h | --help)
      sed -n '2,47p' "$0"
      exit 0
      ;;
    *)
      echo "device_check.sh: unknown argument $1 (try --help)" >&2
      exit 2
      ;;
  esac
  shift
done
for stage in ${STAGES//,/ }; do
  case "$stage" in
    env | pytest | bench | profile | ncu | memory | tune | lora) ;;
    *)
      echo "device_check.sh: unknown stage '$stage' in --stages $STAGES" \
        "(stages: env,pytest,bench,profile,ncu,memory,tune,lora)" >&2
      exit 2
      ;;
  esac
done
wants() { [[ ",$STAGES," == *",$1,"* ]]; }

cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-./device_out}
mkdir -p "$OUT" || exit 2
PY=${PYTHON:-python3}
DEADLINE_S=${DEVICE_CHECK_DEADLINE_S:-540}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PAGEDJAX_GPU_TESTS_LOG="$OUT/gpu_test_errors.jsonl"
# A stage that fails before writing must not leave an earlier run's results in $OUT
# for the summary to report as this run's.
rm -f "$OUT"/{bench_kernels,profile_decode,tune}.jsonl "$OUT"/*.log "$OUT/summary.txt" \
  "$OUT/step_memory.json"
: >"$PAGEDJAX_GPU_TESTS_LOG"
SHARDS=${DEVICE_TEST_SHARDS:-3}
DRY=()
if [ "$DRY_RUN" = 1 ]; then
  export PAGEDJAX_GPU_TESTS_INTERPRET=1
  SHARDS=${DEVICE_TEST_SHARDS:-2}
  DRY=(--dry-run)
fi

SUMMARY=()
FAILED=0

# run_stage NAME LIMIT_S LOG_FILE COMMAND...: COMMAND under `timeout`, output shown and
# written to $OUT/LOG_FILE; the limit is cut to what the deadline leaves.
run_stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((DEADLINE_S - SECONDS))
  if ((left < limit)); then
    limit=$left
  fi
  if ((limit < 10)); then
    SUMMARY+=("$(printf '%-7s skipped: a %ss limit (%ss left of the %ss deadline)' \
      "$name" "$limit" "$left" "$DEADLINE_S")")
    FAILED=1
    return
  fi
  echo "=== $name (limit ${limit}s): $*" | tee "$OUT/$log"
  local t0=$SECONDS
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0))
  local note=""
  if ((rc == 124 || rc == 137)); then
    note="  TIMED OUT"
  fi
  ((rc == 0)) || FAILED=1
  SUMMARY+=("$(printf '%-7s rc=%-3s %4ss of %4ss  %s%s' "$name" "$rc" "$took" "$limit" "$log" "$note")")
}

# (0) environment
env_report() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')  dry_run=$DRY_RUN"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  else
    echo "nvidia-smi: not available"
  fi
  "$PY" - <<'EOF'
import platform

import jax
import jaxlib

print(f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")
print(f"default backend: {jax.default_backend()}")
print(f"devices: {jax.devices()}")
device = jax.devices()[0]
print(f"device_kind: {getattr(device, 'device_kind', '?')}")
try:
    stats = device.memory_stats() or {}
except Exception as e:  # noqa: BLE001 - some backends have none
    stats = {"error": repr(e)}
print(f"memory_stats: bytes_limit={stats.get('bytes_limit')} bytes_in_use={stats.get('bytes_in_use')}")
EOF
}
export -f env_report
export DRY_RUN PY
# Each stage's usual limit in seconds; the bench stage gets what the stages after it leave.
declare -A LIMIT=([env]=60 [pytest]=220 [bench]=250 [profile]=90 [ncu]=60 [memory]=60 [tune]=200
  [lora]=150)
LIMITS=${DEVICE_CHECK_LIMITS:-}
for item in ${LIMITS//,/ }; do # e.g. DEVICE_CHECK_LIMITS=pytest=200,ncu=45
  name=${item%%=*} value=${item#*=}
  if [ -z "${LIMIT[$name]+set}" ] || ! [[ "$value" =~ ^[0-9]+$ ]]; then
    echo "device_check.sh: bad DEVICE_CHECK_LIMITS entry '$item' (want STAGE=SECONDS)" >&2
    exit 2
  fi
  LIMIT[$name]=$value
done

stage_env() { run_stage env "${LIMIT[env]}" env.log bash -c env_report; }

# The device tests: about 255 s in one process on the H200 (2026-11-29), mostly
# compiling on the host; 3 processes at once share the GPU. -v names each test as it
# starts, so a stage cut short shows where.
stage_pytest() {
  run_stage pytest "${LIMIT[pytest]}" pytest.log "$PY" scripts/run_device_tests.py \
    --shards "$SHARDS" --log-dir "$OUT" -- --maxfail=5 --durations=15
}

# The kernel benchmark: tuning sweeps stop at --budget-s, leaving ~130 s of the stage
# for the fixed part (every case's checks and default timings, the ragged cases).
stage_bench() {
  local after=$1 limit budget
  limit=$((DEADLINE_S - SECONDS - 5 - after))
  ((limit > LIMIT[bench])) && limit=${LIMIT[bench]}
  budget=$((limit - 130))
  ((budget < 60)) && budget=60
  if [ "$DRY_RUN" = 1 ]; then
    run_stage bench "$limit" bench.log "$PY" scripts/bench_kernels.py --quick --interpret \
      --out "$OUT"
  else
    run_stage bench "$limit" bench.log "$PY" scripts/bench_kernels.py --out "$OUT" \
      --budget-s "$budget"
  fi
}

# Where the decode time goes at (32, 4096): leave-one-out timings.
stage_profile() {
  run_stage profile "${LIMIT[profile]}" profile.log "$PY" scripts/profile_decode.py \
    --out "$OUT" --device-times ${DRY[@]+"${DRY[@]}"}
}

# Nsight Compute on one launch of that kernel (clocks left alone, as METHOD.md says).
ncu_stage() {
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
  if [ -z "$ncu" ]; then
    echo "ncu: not found (no PATH entry, nothing under /opt/nvidia/nsight-compute)"
    return 0
  fi
  # Few sections: each needs its own replay passes of the kernel, and six of them did
  # not finish within 45 s on the H200 (2026-11-30).
  local sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats)
  # The decode kernel only: its split merge is the launch "paged_decode_merge".
  "$ncu" --clock-control none --target-processes all -k regex:'paged_decode_gpu' \
    --launch-skip 3 --launch-count 1 "${sections[@]}" \
    "$PY" scripts/profile_decode.py --ncu 2>&1 | tee "$OUT/ncu_raw.log"
  local rc=${PIPESTATUS[0]}
  if grep -q "No kernels were profiled" "$OUT/ncu_raw.log"; then
    # The name filter matched nothing: list what ran, so the next run can fix it.
    echo "=== no kernel matched the filter; the kernels that ran (LaunchStats only):"
    "$ncu" --clock-control none --target-processes all --section LaunchStats \
      --launch-count 40 "$PY" scripts/profile_decode.py --ncu 2>&1 |
      grep -E '^  [A-Za-z_].*\(|==PROF==|==ERROR==' | head -n 60
  fi
  rm -f "$OUT/ncu_raw.log"
  return "$rc"
}
stage_ncu() {
  if [ "$DRY_RUN" = 1 ]; then
    SUMMARY+=("$(printf '%-7s skipped in a dry run (no GPU to count)' ncu)")
  else
    export -f ncu_stage
    export OUT DRY_RUN
    run_stage ncu "${LIMIT[ncu]}" ncu.log bash -c ncu_stage
  fi
}

# The step reserve against XLA's buffers for the engine's compiled steps (nothing runs).
memory_stage() {
  local args=(--json)
  [ "$DRY_RUN" = 1 ] && args+=(--preset tiny)
  "$PY" scripts/bench_step_memory.py "${args[@]}" | tee "$OUT/step_memory.json"
  return "${PIPESTATUS[0]}"
}
stage_memory() {
  export -f memory_stage
  export OUT DRY_RUN PY
  run_stage memory "${LIMIT[memory]}" memory.log bash -c memory_stage
}

# Joint sweeps of the knobs; stops starting measurements 30 s before its limit.
stage_tune() {
  local limit=$((DEADLINE_S - SECONDS - 5))
  ((limit > LIMIT[tune])) && limit=${LIMIT[tune]}
  run_stage tune "$limit" tune.log "$PY" scripts/tune_kernels.py --out "$OUT" \
    --budget-s $((limit > 60 ? limit - 30 : 30)) ${DRY[@]+"${DRY[@]}"}
}

# LoRA's cost on the decode path: the engine without LoRA, with it and no adapter in
# use, and with four adapters in every batch (ratios; `scripts/bench_lora.py`).
stage_lora() {
  local args=(--batch 1 32 --prompt-len 64 --gen-len 32 --reps 3 --max-loras 4 --lora-rank 16)
  if [ "$DRY_RUN" = 1 ]; then
    args=(--batch 1 2 --prompt-len 8 --gen-len 4 --reps 1 --max-loras 2 --lora-rank 4)
    args+=(--backend xla)
  else
    args+=(--model llama3.2-1b --dtype bfloat16 --backend gpu)
  fi
  run_stage lora "${LIMIT[lora]}" lora.log "$PY" scripts/bench_lora.py "${args[@]}"
}

# The GPU's clocks, power and temperature every 2 s for the whole run (drift explains
# timings that move within a run).
DMON_PID=
if [ "$DRY_RUN" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi dmon -s pc -d 2 -o T >"$OUT/dmon.log" 2>&1 &
  DMON_PID=$!
fi

read -r -a ORDER <<<"${STAGES//,/ }"
for i in "${!ORDER[@]}"; do
  if [ "${ORDER[i]}" = bench ]; then
    after=0
    for later in "${ORDER[@]:i+1}"; do
      after=$((after + LIMIT[$later]))
    done
    stage_bench "$after"
  else
    "stage_${ORDER[i]}"
  fi
done

[ -n "$DMON_PID" ] && kill "$DMON_PID" 2>/dev/null

# Summary: stages, test counts, bench rows.
{
  echo "=== summary (dry_run=$DRY_RUN, ${SECONDS}s in all, deadline ${DEADLINE_S}s)"
  printf '%s\n' "${SUMMARY[@]}"
  if wants pytest; then
    result=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped)|no tests ran' \
      "$OUT/pytest.log" 2>/dev/null | tail -n 1)
    echo "pytest: ${result:-no result line (cut short?)}"
  fi
  if wants lora; then
    grep -E -A4 '^LoRA on the decode path' "$OUT/lora.log" 2>/dev/null ||
      echo "lora: no table (cut short?)"
  fi
  if wants profile; then
    echo "profile:"
    grep -E -A10 '^variant ' "$OUT/profile.log" 2>/dev/null || echo "  no table (cut short?)"
  fi
  if wants memory; then
    echo "step memory (XLA temp bytes / the step reserve):"
    "$PY" - "$OUT/step_memory.json" <<'EOF' 2>/dev/null || echo "  no rows (cut short?)"
import json
import sys

for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"  {r['case']:<36} T={r['tokens']:<5} B={r['rows']:<4} {r['ratio']:.2f}")
EOF
  fi
  wants bench && "$PY" - "$OUT/bench_kernels.jsonl" <<'EOF'
import json
import sys

try:
    lines = [json.loads(line) for line in open(sys.argv[1])]
except (OSError, ValueError) as e:
    sys.exit(f"bench: no rows ({e})")
meta = next((r for r in lines if r.get("kind") == "meta"), {})
print(
    f"bench: {meta.get('device')}, jax {meta.get('jax_version')}, copy "
    f"{meta.get('copy_gbps')} GB/s, matmul {meta.get('matmul_tflops')} TFLOP/s; "
    + ("finished" if lines and lines[-1].get("kind") == "end" else "CUT SHORT (no end line)")
)
keys = (
    "ours_us", "ours_first_us", "ours_frac_copy", "speedup_vs_bundled", "paged_over_dense",
    "one_buffer_over_default", "merge_us", "merge_over_xla", "ours_frac_matmul",
    "prefetch_over_default",
    "prefetch_kv64_over_default", "ours_best_us", "err_ours",
)
for r in (r for r in lines if r.get("kind") == "row"):
    shown = ", ".join(
        f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r
    )
    errors = ("error", "error_ours", "error_prefetch", "error_prefetch_kv64")
    error = " ".join(r[k] for k in errors if r.get(k))
    print(f"  {r.get('family', '?'):6} {r.get('case', '?'):30} ok={r.get('ok')} {shown} {error}")
EOF
  echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
} 2>&1 | tee "$OUT/summary.txt"
tar czf "$OUT.tgz" -C "$OUT" . && echo "packed into $OUT.tgz"
exit "$FAILED"

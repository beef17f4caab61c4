#!/usr/bin/env bash
# The GPU host check, one script, at most 8 minutes (issues #6 and #8). For a host like the one
# the device tool lends: one H200, 16 CPU cores, Python 3.12 with torch and transformers
# installed, no network, at most 64 MiB brought along. Bring this checkout plus
# dist/deps-py312.tar.xz (made here by `python scripts/pack_deps.py`: Ray 2.60.0 + Serve and
# what else the app needs, 53 MiB).
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # default $OUT or ./gpu_check_out
#
# Steps, each bounded, each writing into OUT_DIR:
#   1. env.json: GPU, CPU, Python, torch, what the kernels build to
#   2. a random-weight model with a real shape the CPU pool decodes usefully (KEYACC_BENCH_SIZE,
#      default the ~0.4B "bench" shape), made on the GPU
#   2b. the engine's decode speed on it (issue #21: scripts/bench_gpu_decode.py, CUDA graphs, the Triton
#      decode attention): tokens/s at batch 1, 16, 64, 256 of 1k-token sequences, each step against the
#      HBM roofline, prefill tokens/s, host CPU per step -> decode_<size>.json
#   3. the engine check on it: GPU prefill -> CPU decode continuation (and back), tokens compared
#   then, each while the time left allows it besides the side-by-side's reserve, in this order:
#   4. Qwen3-14B's shape (KEYACC_CHECK_SIZE): its decode speed at batch 1, 16, 64 (decode_<size>.json)
#   2c. the step-2 model at batch 64 and 256 with asynchronous scheduling -> decode_<size>_async.json
#   3b. where the host CPU has AMX: the CPU fast path with and without AMX tiles (a JSON line in log.txt)
#   4b. the engine check on the 14B shape -> engine_check.json
#   5. bench/: the side-by-side on the GPU + the CPU cores (report.json, written after every run,
#      + PNG plots), on the step-2 model: gpu_only and auto at 64 clients (KEYACC_CHECK_POLICIES,
#      KEYACC_CHECK_LEVELS), the CPU pool alone, one low-load round
# KEYACC_CHECK_QUICK=1: a shorter run (about 4 minutes with the device's start) for a session with
# little device time left: no CPU kernel build, steps 2, 2b (batches 1, 64, 256, each with a kernel
# profile; then batches 64 and 256 with asynchronous scheduling, or with KEYACC_CHECK_AB=unfused
# batches 1 and 64 with KEYACC_GPU_FUSE=torch, the fused ops' A/B), 3 (its CPU engine
# on the torch path), then 4's decode speed (profiled) and nothing after.
# Files that come back (8 at most): log.txt, env.json, decode_*.json, engine_check.json, bench/report.json,
# plots.tar (5's PNG plots).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-$PWD/gpu_check_out}}
SIZE=${KEYACC_CHECK_SIZE:-qwen3-14b}
PY=${PYTHON:-python3}
DEPS=${KEYACC_DEPS:-dist/deps-py312.tar.xz}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/keyacc-check.XXXX)
START=$(date +%s)
BUDGET=${KEYACC_CHECK_BUDGET_S:-470}   # seconds for the whole check: 8 minutes less 10 s spare
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
log() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT_DIR/log.txt"; }

if ! $PY -c "import ray, ray.serve, httpx" 2>/dev/null; then
  [ -f "$DEPS" ] || { log "no Ray here and no $DEPS: run python scripts/pack_deps.py first"; exit 2; }
  log "unpacking $DEPS"
  tar -xJf "$DEPS" -C "$WORK"
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  for d in "$WORK"/site/*.data/scripts; do PATH="$d:$PATH"; done   # ninja (the kernel build), ray's CLI
  export PATH
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export KEYACC_KERNEL_CACHE="$WORK/kernels" RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

log "1/5 environment"
timeout 120 $PY - "$OUT_DIR/env.json" <<'PYEOF' 2>&1 | tail -3 | tee -a "$OUT_DIR/log.txt"
import json, os, platform, subprocess, sys
import torch
info = {"python": sys.version, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
        "cpus": os.cpu_count(), "platform": platform.platform()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
try:
    info["cpu_model"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
    info["cpu_flags"] = [f for f in flags if f.startswith(("avx512", "amx"))]
except Exception as e:
    info["cpu_model"] = repr(e)
import ray, transformers
info["ray"], info["transformers"] = ray.__version__, transformers.__version__
from keyacc_ray import kernels
m = None if os.environ.get("KEYACC_CHECK_QUICK") else kernels.load()
info["kernels"] = m.isa() if m else (f"unavailable: {kernels.unavailable_reason()}"
                                     if not os.environ.get("KEYACC_CHECK_QUICK") else "not built (quick run)")
from keyacc_ray.hw import topology
info["topology"] = topology.describe()
json.dump(info, open(sys.argv[1], "w"), indent=1, default=str)
print(json.dumps({k: info[k] for k in ("gpu", "cpus", "kernels", "torch", "ray") if k in info}, default=str))
PYEOF

DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
GPU_FLAG=--gpu
BENCH_SIZE=${KEYACC_BENCH_SIZE:-bench}
if [ "$DEVICE" = cpu ]; then   # a dry run on a box without CUDA: small models, emulated GPU pools
  SIZE=${KEYACC_CHECK_SIZE:-small}; BENCH_SIZE=${KEYACC_BENCH_SIZE:-small}; GPU_FLAG=""
  log "no CUDA here: dry run with sizes $BENCH_SIZE/$SIZE, GPU pools emulated"
fi
cap() { local l=$(( $(left) - ${2:-0} )); echo $(( l > $1 ? $1 : (l > 10 ? l : 10) )); }   # min(cap, left - reserve)
make_model() {  # size dest seconds
  timeout "$3" $PY scripts/make_tiny_model.py --arch qwen3 --size "$1" --dtype bfloat16 --device "$DEVICE" \
    --out "$2" 2>&1 | tail -2 | tee -a "$OUT_DIR/log.txt"
  [ -f "$2/config.json" ]
}
CONTEXT=${KEYACC_DECODE_CONTEXT:-1024}
[ "$DEVICE" = cpu ] && CONTEXT=${KEYACC_DECODE_CONTEXT:-64}
decode_bench() {  # model name seconds batches...: the engine's decode speed, one JSON line kept
  # (DECODE_FLAGS: more of bench_gpu_decode.py's options)
  local model=$1 size=$2 secs=$3; shift 3
  [ "$DEVICE" = cpu ] && set -- 1 4
  timeout "$secs" $PY scripts/bench_gpu_decode.py --model "$model" --batches "$@" --context "$CONTEXT" \
    --steps 24 ${DECODE_FLAGS:-} >"$WORK/decode_$size.log" 2>&1
  local rc=$?
  if [ "$rc" = 0 ]; then
    grep '^{' "$WORK/decode_$size.log" | tail -1 >"$OUT_DIR/decode_$size.json"
  else   # a run cut short or failed is a failure in its JSON, never a partial pass (its rows: log.txt)
    echo "{\"failed\": true, \"exit_status\": $rc, \"timed_out\": $([ "$rc" = 124 ] && echo true || echo false)}" \
      >"$OUT_DIR/decode_$size.json"
  fi
  grep '^{' "$WORK/decode_$size.log" | tee -a "$OUT_DIR/log.txt" | tail -6
  [ "$rc" = 0 ] || { log "decode bench ($size) exit status $rc"; grep -v Warning "$WORK/decode_$size.log" | tail -15 | tee -a "$OUT_DIR/log.txt"; }
  return "$rc"
}
QUICK=${KEYACC_CHECK_QUICK:-}
engine_check() {  # model out seconds
  timeout "$3" $PY scripts/gpu_engine_check.py --model "$1" --out "$2" ${QUICK:+--cpu-kernels off} 2>&1 | grep -v Warning | tail -6 \
    | tee -a "$OUT_DIR/log.txt"
  return "${PIPESTATUS[0]}"
}

# The side-by-side runs on a model with a real shape that the CPU pool can decode at a useful rate
# (KEYACC_BENCH_SIZE, default the ~0.4B "bench" shape): a 14B model's CPU pool makes a few tokens/s,
# so windows of seconds would measure nothing. The engine check runs on both it and the 14B shape.
log "2/5 model for the engine check and the side-by-side: $BENCH_SIZE (random weights, made on $DEVICE)"
make_model "$BENCH_SIZE" "$WORK/m-$BENCH_SIZE" "$(cap 90)" || { log "model creation failed"; exit 3; }
log "2b decode speed on $BENCH_SIZE ($CONTEXT-token sequences)"
if [ -n "$QUICK" ]; then
  DECODE_FLAGS="--profile-steps 4" decode_bench "$WORK/m-$BENCH_SIZE" "$BENCH_SIZE" "$(cap 90)" 1 64 256
  DECODE_RC=$?
  if [ "$DEVICE" = cuda ] && [ "${KEYACC_CHECK_AB:-async}" = unfused ]; then   # the fused GPU ops' A/B: without them
    KEYACC_GPU_FUSE=torch decode_bench "$WORK/m-$BENCH_SIZE" "${BENCH_SIZE}_unfused" "$(cap 60 150)" 1 64 \
      || DECODE_RC=1
  elif [ "$DEVICE" = cuda ]; then   # asynchronous scheduling: the step's host work behind the device's
    DECODE_FLAGS=--async-scheduling decode_bench "$WORK/m-$BENCH_SIZE" "${BENCH_SIZE}_async" "$(cap 60 150)" 64 256 \
      || DECODE_RC=1
  fi
else
  decode_bench "$WORK/m-$BENCH_SIZE" "$BENCH_SIZE" "$(cap 120)" 1 16 64 256
  DECODE_RC=$?
fi
log "3/5 engine on $BENCH_SIZE: GPU prefill -> CPU decode and back, tokens compared"
engine_check "$WORK/m-$BENCH_SIZE" "$WORK/engine_check_$BENCH_SIZE.json" "$(cap 90)"
SMALL_RC=$?
log "engine check ($BENCH_SIZE) exit status $SMALL_RC"
if [ -n "$QUICK" ]; then   # the large shape's decode speed, profiled, and nothing after it
  log "4 (quick) model $SIZE on $DEVICE and its decode speed ($(left) s left)"
  if make_model "$SIZE" "$WORK/m-$SIZE" "$(cap 90 60)"; then
    DECODE_FLAGS="--profile-steps 3" decode_bench "$WORK/m-$SIZE" "$SIZE" "$(cap 150 5)" 1 16 64 || DECODE_RC=1
  else
    log "model $SIZE: not made in time"; DECODE_RC=1
  fi
  log "quick run: total $(( $(date +%s) - START )) s"
  rm -rf "$WORK"
  [ "$SMALL_RC" = 0 ] && [ "$DECODE_RC" = 0 ]
  exit
fi

# The side-by-side keeps its reserve; what runs before it goes by priority, each step only when
# the time left allows it: the large shape's decode speed (#21's targets), the asynchronous-
# scheduling A/B, the CPU pool with and without AMX (#26), then the large shape's engine check.
BENCH_RESERVE=${KEYACC_BENCH_RESERVE:-170}   # seconds kept for the side-by-side (2 runs at 64 clients, CPU alone, low load)
LARGE_RC=skipped
LARGE_MADE=""
if [ "$SIZE" != "$BENCH_SIZE" ] && [ "$(left)" -gt $(( BENCH_RESERVE + 120 )) ]; then
  log "4/5 model $SIZE on $DEVICE and its decode speed ($(left) s left)"
  if make_model "$SIZE" "$WORK/m-$SIZE" "$(cap 150 $(( BENCH_RESERVE + 60 )))"; then
    LARGE_MADE=1
    log "4 decode speed on $SIZE ($(left) s left)"
    decode_bench "$WORK/m-$SIZE" "$SIZE" "$(cap 150 $(( BENCH_RESERVE + 10 )))" 1 16 64 || DECODE_RC=1
  else
    log "model $SIZE: not made in time"
  fi
else
  log "4/5 skipped: $SIZE model ($(left) s left, $BENCH_RESERVE kept for the side-by-side)"
fi
if [ "$(left)" -gt $(( BENCH_RESERVE + 40 )) ]; then
  log "2c $BENCH_SIZE with asynchronous scheduling (step n+1 launched before step n's ids are read) at batch 64 and 256"
  DECODE_FLAGS=--async-scheduling decode_bench "$WORK/m-$BENCH_SIZE" "${BENCH_SIZE}_async" \
    "$(cap 60 "$BENCH_RESERVE")" 64 256 || DECODE_RC=1
fi
if grep -q amx_bf16 /proc/cpuinfo && [ "$(left)" -gt $(( BENCH_RESERVE + 60 )) ]; then
  # the CPU pool's kernels with and without AMX tiles (issue #26), one JSON line into log.txt
  log "3b CPU fast path on $BENCH_SIZE, AMX vs AVX-512 alone ($(nproc) threads)"
  timeout "$(cap 90 "$BENCH_RESERVE")" $PY scripts/bench_cpu_isa.py --model "$WORK/m-$BENCH_SIZE" \
    --threads "$(nproc)" --steps 8 --isa amx avx512 2>&1 | tail -1 | tee -a "$OUT_DIR/log.txt"
fi
if [ -n "$LARGE_MADE" ] && [ "$(left)" -gt $(( BENCH_RESERVE + 60 )) ]; then
  log "4 engine check on $SIZE ($(left) s left)"
  engine_check "$WORK/m-$SIZE" "$OUT_DIR/engine_check.json" "$(cap 150 "$BENCH_RESERVE")"
  LARGE_RC=$?
  log "engine check ($SIZE) exit status $LARGE_RC"
fi
rm -rf "$WORK/m-$SIZE"   # its page cache and disk back to the side-by-side

log "5/5 side by side on $BENCH_SIZE, GPU + CPU cores ($(left) s left)"
timeout "$(cap 600)" $PY scripts/bench.py $GPU_FLAG --model-path "$WORK/m-$BENCH_SIZE" \
  --policies ${KEYACC_CHECK_POLICIES:-gpu_only auto} --levels ${KEYACC_CHECK_LEVELS:-64} --duration ${KEYACC_CHECK_DURATION:-6} --ramp 2 --low-load-rounds 1 \
  --tpot-slo-ms 200 --ttft-slo-ms 3000 --out-dir "$OUT_DIR/bench" --profile-steps "$WORK/prof:500:40" \
  >"$WORK/bench.log" 2>&1
BENCH_RC=$?
grep -v "^INFO\|^WARNING\|^(\|it/s\]\|s/it\]" "$WORK/bench.log" | tail -25 | tee -a "$OUT_DIR/log.txt"
for f in "$WORK"/prof/steps-*.txt; do   # where each pool replica's step time goes (host ops, launches)
  [ -f "$f" ] && head -24 "$f" >> "$OUT_DIR/log.txt" && head -3 "$f"
done
if [ "$BENCH_RC" != 0 ]; then   # what went wrong, for the log that comes back
  grep -n "Error\|Traceback\|error" "$WORK/bench.log" | tail -20 | tee -a "$OUT_DIR/log.txt"
  for f in /tmp/ray/session_latest/logs/serve/*.log; do
    grep -l "Traceback" "$f" >/dev/null 2>&1 && { echo "== $f"; grep -A12 "Traceback" "$f" | tail -30; }
  done 2>/dev/null | tail -80 | tee -a "$OUT_DIR/log.txt"
fi
log "bench exit status $BENCH_RC; total $(( $(date +%s) - START )) s"
# the device tool brings back at most 8 files: the plots travel as one tarball
ls "$OUT_DIR"/bench/*.png >/dev/null 2>&1 && tar -cf "$OUT_DIR/plots.tar" -C "$OUT_DIR/bench" $(cd "$OUT_DIR/bench" && ls *.png) \
  && rm -f "$OUT_DIR"/bench/*.png
rm -rf "$WORK"
[ "$SMALL_RC" = 0 ] && [ "$LARGE_RC" != 1 ] && [ "$BENCH_RC" = 0 ] && [ "$DECODE_RC" = 0 ]

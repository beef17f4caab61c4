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
#   2. a random-weight model with Qwen3-14B's shape (KEYACC_CHECK_SIZE to change), made on the GPU
#   3. engine_check.json: GPU prefill -> CPU decode continuation (and back), tokens compared
#   4. bench/: the side-by-side policy run on the GPU + the CPU cores (report.json + PNG plots)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-$PWD/gpu_check_out}}
SIZE=${KEYACC_CHECK_SIZE:-qwen3-14b}
PY=${PYTHON:-python3}
DEPS=${KEYACC_DEPS:-dist/deps-py312.tar.xz}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/keyacc-check.XXXX)
START=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - START) )); }   # seconds left of the 8 minutes (10 s spare)
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

log "1/4 environment"
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
m = kernels.load()
info["kernels"] = m.isa() if m else f"unavailable: {kernels.unavailable_reason()}"
from keyacc_ray.hw import topology
info["topology"] = topology.describe()
json.dump(info, open(sys.argv[1], "w"), indent=1, default=str)
print(json.dumps({k: info[k] for k in ("gpu", "cpus", "kernels", "torch", "ray") if k in info}, default=str))
PYEOF

DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
GPU_FLAG=--gpu
if [ "$DEVICE" = cpu ]; then   # a dry run on a box without CUDA: small model, emulated GPU pools
  SIZE=${KEYACC_CHECK_SIZE:-small}; GPU_FLAG=""; log "no CUDA here: dry run with size $SIZE, GPU pools emulated"
fi
log "2/4 model: $SIZE (random weights, made on $DEVICE)"
timeout $(( $(left) > 150 ? 150 : $(left) )) $PY scripts/make_tiny_model.py --arch qwen3 --size "$SIZE" \
  --dtype bfloat16 --device "$DEVICE" --out "$WORK/check-$SIZE" 2>&1 | tail -2 | tee -a "$OUT_DIR/log.txt"
[ -f "$WORK/check-$SIZE/config.json" ] || { log "model creation failed"; exit 3; }

log "3/4 engine: GPU prefill -> CPU decode, tokens compared"
timeout $(( $(left) > 150 ? 150 : $(left) )) $PY scripts/gpu_engine_check.py --model "$WORK/check-$SIZE" \
  --out "$OUT_DIR/engine_check.json" 2>&1 | tail -6 | tee -a "$OUT_DIR/log.txt"
ENGINE_RC=${PIPESTATUS[0]}
log "engine check exit status $ENGINE_RC"

log "4/4 side by side on GPU + CPU cores ($(left) s left)"
timeout $(( $(left) > 30 ? $(left) : 30 )) $PY scripts/bench.py $GPU_FLAG --model-path "$WORK/check-$SIZE" \
  --levels ${KEYACC_CHECK_LEVELS:-8 32 64} --duration ${KEYACC_CHECK_DURATION:-8} --tpot-slo-ms 200 \
  --ttft-slo-ms 3000 --out-dir "$OUT_DIR/bench" 2>&1 | grep -v "^INFO\|^WARNING\|^(" | tail -30 | tee -a "$OUT_DIR/log.txt"
BENCH_RC=${PIPESTATUS[0]}
log "bench exit status $BENCH_RC; total $(( $(date +%s) - START )) s"
rm -rf "$WORK"
[ "$ENGINE_RC" = 0 ] && [ "$BENCH_RC" = 0 ]

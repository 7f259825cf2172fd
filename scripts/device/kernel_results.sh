#!/usr/bin/env bash
# Device-side results for the kernel issue in one call: the stage breakdown (C++ variants, interleaved
# and paired), the sm_90a C++ tests, and the product benchmark with its anchors (cuDNN BF16 SDPA, the
# FP8 GEMM ceiling) for the given head counts, from a wheel built earlier (or "build": built here).
# Writes two files under $OUT (the device tool returns at most 8): kernel_results.log and the JSON.
# Usage (on the device): bash scripts/device/kernel_results.sh BUILD_DIR WHEEL|build HEADS [variants|novariants]
set -u
B=${1:-build/dev}
WHEEL=${2:-build}
HEADS=${3:-7,14,56}
OUT=${OUT:-/tmp/out}
R=$PWD
LOG=$OUT/kernel_results.log
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >> "$LOG"
if [ "${4:-variants}" = variants ]; then
  bash scripts/device/variants.sh "$B" 7 >> "$LOG" 2>&1
  (export LD_LIBRARY_PATH=$R/$B/src
   timeout 120 "$B/tests/cpp/openvc_gpu_tests" --gtest_filter='Sm90*' 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" >> "$LOG")
fi
if [ "$WHEEL" = build ]; then
  ( export OPENVC_CUTLASS_INCLUDE=$R/third_party/cutlass/include CMAKE_BUILD_PARALLEL_LEVEL=16
    python3 -m pip wheel -q --no-build-isolation --no-deps . -w /tmp/wheel ) >> "$LOG" 2>&1 || { tail -30 "$LOG"; exit 1; }
  WHEEL=$(ls /tmp/wheel/*.whl | head -1)
fi
python3 -m pip install -q --no-deps --force-reinstall "$WHEEL" >> "$LOG" 2>&1 || { tail "$LOG"; exit 1; }
cd /tmp   # the installed package, not the source tree
tag=$(echo "$HEADS" | tr ',' '-')
timeout 330 open-vc-attn-bench --preset video --heads "$HEADS" --backends open-vc,sdpa-cudnn --accuracy-rows 4096 \
  --rounds 8 --out "$OUT/video-h$tag.json" >> "$LOG" 2>&1
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> "$LOG"
grep -E "S=|variant|^\[  (PASSED|FAILED)|TF|record" "$LOG" | tail -60

#!/usr/bin/env bash
# Device-side results for the kernel issue in one call: the stage breakdown (C++ variants, interleaved
# and paired), the sm_90a C++ tests, and the product benchmark with its anchors (cuDNN BF16 SDPA, the
# FP8 GEMM ceiling) for the given head counts, from a wheel built earlier and carried.
# Usage (on the device): bash scripts/device/kernel_results.sh BUILD_DIR WHEEL HEADS [variants|novariants]
set -u
B=${1:-build/dev}
WHEEL=$2
HEADS=${3:-7,14}
OUT=${OUT:-/tmp/out}
R=$PWD
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${4:-variants}" = variants ]; then
  bash scripts/device/variants.sh "$B" 7 > "$OUT/variants.log" 2>&1
  grep -E "S=|variant" "$OUT/variants.log"
  (export LD_LIBRARY_PATH=$R/$B/src
   timeout 120 "$B/tests/cpp/openvc_gpu_tests" --gtest_filter='Sm90*' 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > "$OUT/sm90_tests.log"
   grep -E "^\[  (PASSED|FAILED) |FAILED TEST|negative" "$OUT/sm90_tests.log" | tail -8)
fi
python3 -m pip install -q --no-deps --force-reinstall "$WHEEL" > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
cd /tmp
tag=$(echo "$HEADS" | tr ',' '_')
timeout 330 open-vc-attn-bench --preset video --heads "$HEADS" --backends open-vc,sdpa-cudnn --accuracy-rows 4096 \
  --rounds 8 --out "$OUT/video_h$tag.json" > "$OUT/bench_h$tag.log" 2>&1
grep -E "TF|record|Error|error" "$OUT/bench_h$tag.log" | tail -24
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$OUT/gpu.txt"

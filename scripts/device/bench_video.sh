#!/usr/bin/env bash
# Device-side: install, then the `video` benchmark preset with its report, then the Python GPU tests.
# Usage: bash scripts/device/bench_video.sh GIT_COMMIT   (carry third_party/cutlass)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export OPENVC_CUTLASS_INCLUDE=$PWD/third_party/cutlass/include CMAKE_BUILD_PARALLEL_LEVEL=16 PYTHONUNBUFFERED=1
( time python3 -m pip install -q --no-build-isolation --no-deps . ) > "$OUT/pip.log" 2>&1 || { tail -30 "$OUT/pip.log"; exit 1; }
timeout 400 open-vc-attn-bench --preset video --out "$OUT/bench-video.json" --git-commit "$1" --time-budget-s 330 \
  2>&1 | tee "$OUT/bench-video.log" | tail -45
open-vc-attn-report "$OUT/bench-video.json" --out-dir "$OUT/report" 2>&1 | tail -3
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_gpu_api.py 2>&1 | tail -4

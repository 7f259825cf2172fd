#!/usr/bin/env bash
# Device-side: build and install open_vc_attn with the image's torch, then the Python GPU tests and the
# smoke check. Carry third_party/cutlass (headers; the device has no package registry).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export OPENVC_CUTLASS_INCLUDE=$PWD/third_party/cutlass/include
export CMAKE_BUILD_PARALLEL_LEVEL=16
( time python3 -m pip install -q --no-build-isolation --no-deps . ) > "$OUT/pip.log" 2>&1 || { tail -30 "$OUT/pip.log"; exit 1; }
tail -3 "$OUT/pip.log"
PYTHONUNBUFFERED=1 timeout 420 python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-tests/python} 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout 120 open-vc-attn-check --smoke 2>&1 | tee "$OUT/smoke.log" | tail -15

#!/bin/bash
# Twenty-fourth session, call A (the twenty-third's unrun call C, extended): library F (77dd5f1; the INT8 huge-score
# fix) through every C++ GPU test (with Sm90Int8Modes.AFewLargeQueryRows), the Python INT8 GPU tests (with
# test_gpu_a_few_large_query_rows) on the wheel built on the CI machine for this image's Python 3.12 (carried), issue
# 28's short shapes and issue 25's INT8 shapes with FA3 (hopper/ 0251105a, built here from the carried .anchors) and
# cuDNN in the same process (SageAttention2 not carried).
cd "$(dirname "$0")/../../.."
bash .anchors/build.sh
mkdir -p /tmp/F /tmp/bin
gunzip -c .carry/libopenvc_F.so.gz > /tmp/F/libopenvc.so
gunzip -c .carry/openvc_gpu_tests_F.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
LD_LIBRARY_PATH=/tmp/F timeout 200 /tmp/bin/openvc_gpu_tests 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_F_callA.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_F_callA.log
tail -3 $OUT/tests_F_callA.log
w=0; while [ ! -f /tmp/w/fa3.rc ] && [ $w -lt 240 ]; do sleep 5; w=$((w + 5)); done
echo "fa3 build rc=$(cat /tmp/w/fa3.rc 2>/dev/null) after ${w} s more"
export PYTHONPATH=/tmp/w/fa/hopper OPENVC_WHEEL=$(ls $PWD/.carry/*.whl | head -1) MODES_ROUNDS=5
PYTEST_ARGS="tests/python/test_gpu_int8_mode.py" timeout 390 bash scripts/device/check.sh install pytest modes-short modes-int8

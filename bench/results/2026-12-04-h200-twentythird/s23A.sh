#!/bin/bash
# Twenty-third session, call A: every C++ GPU test on main's library (858c6dc: the twenty-second session's last test
# changes, unrun there), then where the complete call's preparation sits at issue 28's short shapes: the preparation
# alone (prep section) and the one call against the step-wise call (onecall).
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/M /tmp/bin
gunzip -c .carry/libopenvc_M.so.gz > /tmp/M/libopenvc.so
gunzip -c .carry/openvc_gpu_tests_M.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
gunzip -c .carry/openvc_bench_attention_M.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
LD_LIBRARY_PATH=/tmp/M timeout 300 /tmp/bin/openvc_gpu_tests 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_M_callA.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_M_callA.log
tail -5 $OUT/tests_M_callA.log
B=/tmp/bin/openvc_bench_attention
{
for a in "4096 7 1 7 4 prep" "8192 40 1 7 4 prep" "4096 7 1 9 4 onecall" "8192 40 1 9 4 onecall" "9000 24 8 7 4 onecall packed"; do
  echo "== $a"; LD_LIBRARY_PATH=/tmp/M timeout 90 $B $a | grep -E "^onecall|^S=|prep round"; done
} > $OUT/prep_M_callA.log 2>&1
cat $OUT/prep_M_callA.log

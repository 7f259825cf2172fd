#!/bin/bash
# Twenty-first session, call A: Q quantized in the kernel for packed and key-count calls (library A) and, on top, the
# first Q tile quantized before the wait for the preparation (library B). Tests on B, sanitizers on the new tests,
# one-call vs step-wise pairs with A and B alternating in separate processes.
cd "$(dirname "$0")/.."
mkdir -p /tmp/A /tmp/B /tmp/bin
gunzip -c .carry/libopenvc_A.so.gz > /tmp/A/libopenvc.so
gunzip -c .carry/libopenvc_B.so.gz > /tmp/B/libopenvc.so
gunzip -c .carry/openvc_bench_attention.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
gunzip -c .carry/openvc_gpu_tests.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
B=/tmp/bin/openvc_bench_attention
LD_LIBRARY_PATH=/tmp/B timeout 200 /tmp/bin/openvc_gpu_tests 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_B.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_B.log
tail -4 $OUT/tests_B.log
LD_LIBRARY_PATH=/tmp/A timeout 60 /tmp/bin/openvc_gpu_tests --gtest_filter='Sm90FusedQ.*:AttentionCall.*' 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_A.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_A.log
tail -2 $OUT/tests_A.log
{
for i in 1 2 3; do
  for lib in A B; do
    for a in "9000 24 8 9 4 onecall packed" "32760 12 2 9 4 onecall packed" "4096 24 4 9 4 onecall packed" "4096 7 1 9 4 onecall" "8192 40 1 9 4 onecall" "16384 24 1 9 4 onecall"; do
      echo -n "[$lib $i] "; LD_LIBRARY_PATH=/tmp/$lib timeout 60 $B $a | grep -E "^onecall"; done
  done
done
} > $OUT/onecall_AB.log 2>&1
cat $OUT/onecall_AB.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
LD_LIBRARY_PATH=/tmp/B timeout 150 $san --tool memcheck --error-exitcode 9 /tmp/bin/openvc_gpu_tests --gtest_filter='Sm90FusedQ.Packed*:AttentionCall.SameBytes*' > $OUT/memcheck_B.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' $OUT/memcheck_B.log | tail -1)"
LD_LIBRARY_PATH=/tmp/B timeout 150 $san --tool racecheck --error-exitcode 9 /tmp/bin/openvc_gpu_tests --gtest_filter='Sm90FusedQ.Packed*' > $OUT/racecheck_B.log 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY' $OUT/racecheck_B.log | tail -1)"

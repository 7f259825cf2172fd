#!/bin/bash
# Twenty-third session, call B: library X (the INT8 huge-score decision made per warpgroup; V's block maxima taken by
# the K blocks of quantize_qk_kernel, v_amax_kernel gone) against M (main, 858c6dc). Every C++ GPU test on X; the new
# INT8 case on M (expected to fail: a warp-divergent huge-score decision); sanitizers on X's changed kernels; then
# both libraries alternating in separate processes on X's bench binary (prep and onecall sections).
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/M /tmp/X /tmp/bin
for l in M X; do gunzip -c .carry/libopenvc_$l.so.gz > /tmp/$l/libopenvc.so; done
gunzip -c .carry/openvc_gpu_tests_X.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
gunzip -c .carry/openvc_bench_attention_X.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
T=/tmp/bin/openvc_gpu_tests
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
LD_LIBRARY_PATH=/tmp/X timeout 300 $T 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_X_callB.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_X_callB.log
tail -4 $OUT/tests_X_callB.log
{ LD_LIBRARY_PATH=/tmp/M timeout 60 $T --gtest_filter='Sm90Int8.AttentionMatchesTheReferenceOnTheSameCodes:Sm90Grid.*' 2>&1 | grep -E "Failure|illegal|OK \]|FAILED|PASSED|Which is"; echo "M rc ${PIPESTATUS[0]}"; } > $OUT/int8_huge_M_callB.log
cat $OUT/int8_huge_M_callB.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
F='Prepare*:*Prepare*:Sm90Int8.*'
{
LD_LIBRARY_PATH=/tmp/X timeout 150 $san --tool memcheck --error-exitcode 9 $T --gtest_filter="$F" > /tmp/memcheck.log 2>&1; echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1) $(grep -cE 'OK \]' /tmp/memcheck.log) ok"
LD_LIBRARY_PATH=/tmp/X timeout 100 $san --tool racecheck --error-exitcode 9 $T --gtest_filter='Prepare*:*Prepare*' > /tmp/racecheck.log 2>&1; echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY' /tmp/racecheck.log | tail -1) $(grep -cE 'OK \]' /tmp/racecheck.log) ok"
} > $OUT/sanitizers_X_callB.log 2>&1
cat $OUT/sanitizers_X_callB.log
B=/tmp/bin/openvc_bench_attention
{
for i in 1 2 3; do
  for lib in M X; do
    for a in "4096 7 1 7 4 prep" "8192 40 1 5 4 prep" "4096 7 1 9 4 onecall" "2048 66 1 9 4 onecall" "8192 40 1 9 4 onecall" "9000 24 8 7 4 onecall packed"; do
      echo -n "[$lib $i] "; LD_LIBRARY_PATH=/tmp/$lib timeout 60 $B $a | grep -E "^onecall|prep round 2"; done
  done
done
} > $OUT/ab_MX_callB.log 2>&1
cat $OUT/ab_MX_callB.log

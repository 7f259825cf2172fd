#!/bin/bash
# Twenty-first session, call E: the review's fixes (every CTA of the early-Q launch waits once; key counts with one
# query row per entry; the tests' independent oracle for key counts): every C++ GPU test, racecheck and memcheck on the
# one-call path (q_before_prior_grid set), the Python GPU tests of the changed call forms, a timing sanity check.
cd "$(dirname "$0")/.."
mkdir -p /tmp/E /tmp/bin
gunzip -c .carry/libopenvc_E.so.gz > /tmp/E/libopenvc.so
gunzip -c .carry/openvc_gpu_tests_E.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
gunzip -c .carry/openvc_bench_attention_E.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
LD_LIBRARY_PATH=/tmp/E timeout 200 /tmp/bin/openvc_gpu_tests 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_E.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_E.log
tail -4 $OUT/tests_E.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
LD_LIBRARY_PATH=/tmp/E timeout 120 $san --tool racecheck --error-exitcode 9 /tmp/bin/openvc_gpu_tests --gtest_filter='AttentionCall.SameBytes*:AttentionCall.ProgrammaticLaunches*' > $OUT/racecheck_E.log 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY' $OUT/racecheck_E.log | tail -1)"
LD_LIBRARY_PATH=/tmp/E timeout 120 $san --tool memcheck --error-exitcode 9 /tmp/bin/openvc_gpu_tests --gtest_filter='Sm90FusedQ.Packed*:AttentionCall.*' > $OUT/memcheck_E.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' $OUT/memcheck_E.log | tail -1)"
{ for a in "4096 7 1 9 4 onecall" "9000 24 8 9 4 onecall packed"; do LD_LIBRARY_PATH=/tmp/E timeout 60 /tmp/bin/openvc_bench_attention $a | grep -E "^onecall"; done; } > $OUT/onecall_E.log 2>&1
cat $OUT/onecall_E.log
PYTEST_ARGS="tests/python/test_gpu_fast_modes.py tests/python/test_gpu_varlen_prepared.py tests/python/test_gpu_general.py tests/python/test_gpu_api.py tests/python/test_gpu_capture.py" bash scripts/device/check.sh install pytest

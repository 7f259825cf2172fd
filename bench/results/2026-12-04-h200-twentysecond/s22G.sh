#!/bin/bash
# Twenty-second session, calls B, D, E and G (G: LIBS="G J", J = the few-keys mode up to 32 key blocks a tile): libraries
# GPU tests (TESTLIB) and sanitizers on the grid test first. Call B: E (twenty-first session) vs F (a tile start under the
# last PV, reverted); call D: G (HEAD) vs H (the epilogue per output dtype).
cd "$(dirname "$0")/.."
LIBS=${LIBS:-"E F"}
mkdir -p /tmp/bin
for l in $LIBS; do mkdir -p /tmp/$l; gunzip -c .carry/libopenvc_$l.so.gz > /tmp/$l/libopenvc.so; done
gunzip -c .carry/openvc_bench_attention_${BIN:-F}.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
gunzip -c .carry/openvc_gpu_tests_${BIN:-F}.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
TESTLIB=${TESTLIB:-F}
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
if [ "${SKIP_TESTS:-0}" = 0 ]; then
LD_LIBRARY_PATH=/tmp/$TESTLIB timeout 240 /tmp/bin/openvc_gpu_tests 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_$TESTLIB.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_$TESTLIB.log
tail -4 $OUT/tests_$TESTLIB.log
fi
B=/tmp/bin/openvc_bench_attention
{
for i in 1 2 3; do
  for lib in $LIBS; do
    for a in "2048 66 1 9 4 onecall" "4096 33 1 9 4 onecall" "4096 7 1 9 4 onecall" "3000 24 1 9 4 onecall" "8192 40 1 7 4 onecall"; do
      c=0; case $a in C*) c=1; a=${a#C};; esac
      echo -n "[$lib $i c$c] "; OPENVC_BENCH_CAUSAL=$c LD_LIBRARY_PATH=/tmp/$lib timeout 60 $B $a | grep -E "^onecall|^S="; done
  done
done
} > $OUT/ab.log 2>&1
cat $OUT/ab.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
if [ "${SKIP_SAN:-0}" = 0 ]; then
LD_LIBRARY_PATH=/tmp/$TESTLIB timeout 300 $san --tool racecheck --error-exitcode 9 /tmp/bin/openvc_gpu_tests --gtest_filter="${SAN_FILTER:-Sm90Grid.*}" > $OUT/racecheck_$TESTLIB.log 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY' $OUT/racecheck_$TESTLIB.log | tail -1)"
LD_LIBRARY_PATH=/tmp/$TESTLIB timeout 150 $san --tool memcheck --error-exitcode 9 /tmp/bin/openvc_gpu_tests --gtest_filter="${SAN_FILTER:-Sm90Grid.*}" > $OUT/memcheck_$TESTLIB.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' $OUT/memcheck_$TESTLIB.log | tail -1)"
fi

#!/bin/bash
# Split tiles' first GPU run (twenty-fourth session's work, written without a device): library S (split tiles built,
# off by default: AttentionCall::tile_split kAuto acts as kOff) through every C++ GPU test (Sm90Split.* among them:
# the kernel against the reference on its plan, same bits every launch, whole-tile bits where no boundary cuts, the
# one call with kOn eager and replayed from a CUDA graph), compute-sanitizer memcheck / racecheck on Sm90Split.*,
# then the one call with split tiles (kOn) against whole tiles (kOff) at issue 28's shapes (`split-tiles` section:
# interleaved rounds, paired ratios, one process per shape).
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/S /tmp/bin
gunzip -c .carry/libopenvc_S.so.gz > /tmp/S/libopenvc.so
gunzip -c .carry/openvc_gpu_tests_S.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
gunzip -c .carry/openvc_bench_attention_S.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
T=/tmp/bin/openvc_gpu_tests B=/tmp/bin/openvc_bench_attention
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
LD_LIBRARY_PATH=/tmp/S timeout 120 $T --gtest_filter='Sm90Split.*' 2>&1 | tail -40 > $OUT/tests_split_S.log
cat $OUT/tests_split_S.log | tail -8
LD_LIBRARY_PATH=/tmp/S timeout 240 $T 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_S.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_S.log
tail -3 $OUT/tests_S.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
{
LD_LIBRARY_PATH=/tmp/S timeout 120 $san --tool memcheck --error-exitcode 9 $T --gtest_filter='Sm90Split.*' > /tmp/memcheck.log 2>&1; echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"
LD_LIBRARY_PATH=/tmp/S timeout 120 $san --tool racecheck --error-exitcode 9 $T --gtest_filter='Sm90Split.MatchesTheReferenceOnItsPlan' > /tmp/racecheck.log 2>&1; echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY' /tmp/racecheck.log | tail -1)"
} > $OUT/sanitizers_S.log 2>&1
cat $OUT/sanitizers_S.log
{
for a in "4096 7 1 9 4" "8192 40 1 7 4" "2048 66 1 9 4" "4096 33 1 9 4" "16384 24 1 7 4" "32760 12 2 5 4" "73397 7 1 5 4" "73397 14 1 5 4"; do
  LD_LIBRARY_PATH=/tmp/S timeout 90 $B $a split-tiles | grep -E "^split-tiles"
done
} > $OUT/split_tiles_S.log 2>&1
cat $OUT/split_tiles_S.log

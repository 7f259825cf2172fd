#!/bin/bash
# Twenty-seventh session, call A: grouped-query attention (branch gqa-wip, library G = the cp312 wheel's) on the H200.
# In order of need, each step with its own time limit: the GQA C++ tests, every other C++ GPU test, compute-sanitizer
# memcheck on the GQA tests, the Python GPU tests of the changed files, the existing modes' speed with G against M
# (main's library, 5c19e98's) on G's bench binary (libraries alternating in separate processes), then bench.modes'
# gqa case against FA3 (built in the background from the start) and cuDNN. Carry: .carry/gqa (wheel, test and bench
# binaries built on the CI machine from this commit), .carry/libopenvc_F.so.gz, .anchors.
cd "$(dirname "$0")/../../.."
REPO=$PWD
mkdir -p /tmp/M /tmp/G /tmp/bin
gunzip -c .carry/libopenvc_F.so.gz > /tmp/M/libopenvc.so
export OPENVC_WHEEL=$(ls $REPO/.carry/gqa/open_vc_attn-*.whl | head -1)
(cd /tmp/G && unzip -o -q -j "$OPENVC_WHEEL" 'open_vc_attn/libopenvc.so')
for b in openvc_gpu_tests openvc_bench_attention; do
  gunzip -c .carry/gqa/${b}_G.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b
done
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
OUT=$OUT PYTHON=python3 bash .anchors/build.sh > $OUT/anchors.log 2>&1   # FA3 builds in the background
T=/tmp/bin/openvc_gpu_tests
filter() { grep -vE "^\[ +(RUN|OK) +\]"; }
LD_LIBRARY_PATH=/tmp/G timeout 60 $T --gtest_filter='Sm90Gqa.*' 2>&1 | filter > $OUT/tests_gqa_G.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_gqa_G.log; tail -4 $OUT/tests_gqa_G.log
LD_LIBRARY_PATH=/tmp/G timeout 150 $T --gtest_filter='-Sm90Gqa.*' 2>&1 | filter > $OUT/tests_G.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_G.log; tail -4 $OUT/tests_G.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
LD_LIBRARY_PATH=/tmp/G timeout 100 $san --tool memcheck --error-exitcode 9 $T --gtest_filter='Sm90Gqa.*' > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1) $(grep -cE 'OK \]' /tmp/memcheck.log) ok" | tee $OUT/sanitizer_gqa_G.log
grep -m20 -E "Invalid|FAILED|Failure" /tmp/memcheck.log >> $OUT/sanitizer_gqa_G.log
B=/tmp/bin/openvc_bench_attention
{
for i in 1 2; do
  for lib in M G; do
    echo -n "[$lib $i] "; LD_LIBRARY_PATH=/tmp/$lib timeout 30 $B 73397 7 1 5 4 | grep -E "^S="
    for a in "4096 7 1 9 4 onecall" "8192 40 1 7 4 onecall" "9000 24 8 7 4 onecall packed"; do
      echo -n "[$lib $i] "; LD_LIBRARY_PATH=/tmp/$lib timeout 30 $B $a | grep -E "^onecall"; done
    echo -n "[$lib $i] "; OPENVC_BENCH_CAUSAL=1 LD_LIBRARY_PATH=/tmp/$lib timeout 30 $B 16384 24 1 7 4 onecall | grep -E "^onecall"
  done
done
} > $OUT/ab_MG.log 2>&1
cat $OUT/ab_MG.log
PYTEST_ARGS="-m gpu tests/python/test_gpu_gqa.py tests/python/test_gpu_api.py tests/python/test_gpu_capture.py tests/python/test_gpu_general.py tests/python/test_gpu_varlen_prepared.py" \
  timeout 150 bash scripts/device/check.sh install pytest > $OUT/check_pytest.log 2>&1
tail -5 $OUT/check_pytest.log
while [ ! -f /tmp/w/fa3.rc ]; do sleep 3; done; echo "fa3 rc $(cat /tmp/w/fa3.rc)"
export PYTHONPATH=/tmp/w/fa/hopper
OPENVC_SKIP_INSTALL=1 MODES_ROUNDS=5 timeout 170 bash scripts/device/check.sh modes-gqa > $OUT/check_modes.log 2>&1
tail -25 $OUT/check_modes.log

#!/bin/bash
# Twenty-seventh session, call C (call A ran on an H100 without unzip: the G library was missing, so its C++ steps
# and G's bench rows did not run; its Python GPU tests of the changed files passed, 130; bench.modes' gqa case died
# with a segmentation fault and no output). This call: the G library taken from the wheel with Python's zipfile;
# the GQA C++ tests, every other C++ GPU test, memcheck on the GQA tests, G against M (main's library) on G's bench
# binary, bench.modes' gqa case under faulthandler (a crash names its Python line) against FA3, and Cosmos 3's
# transformer forward (scripts/device/diffusers_e2e.py --models cosmos3) with the carried .whl/ (diffusers 0.42.1).
cd "$(dirname "$0")/../../.."
REPO=$PWD
mkdir -p /tmp/M /tmp/G /tmp/bin
gunzip -c .carry/libopenvc_F.so.gz > /tmp/M/libopenvc.so
export OPENVC_WHEEL=$(ls $REPO/.carry/gqa/open_vc_attn-*.whl | head -1)
python3 -c "import sys, zipfile; open('/tmp/G/libopenvc.so', 'wb').write(zipfile.ZipFile(sys.argv[1]).read('open_vc_attn/libopenvc.so'))" "$OPENVC_WHEEL"
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
timeout 60 bash scripts/device/check.sh install > $OUT/check_install.log 2>&1; tail -2 $OUT/check_install.log
while [ ! -f /tmp/w/fa3.rc ]; do sleep 3; done; echo "fa3 rc $(cat /tmp/w/fa3.rc)"
(cd /tmp && PYTHONPATH=/tmp/w/fa/hopper timeout 170 python3 -X faulthandler -m open_vc_attn.bench.modes --cases gqa \
   --rounds 5 --out $OUT/modes-gqa.json > $OUT/modes-gqa.log 2>&1; echo "modes rc $?" >> $OUT/modes-gqa.log)
tail -30 $OUT/modes-gqa.log
if ! grep -q "modes rc 0" $OUT/modes-gqa.log; then   # again without FA3 on the path: openvc against cuDNN
  (cd /tmp && timeout 120 python3 -X faulthandler -m open_vc_attn.bench.modes --cases gqa --rounds 5 \
     --out $OUT/modes-gqa-nofa3.json > $OUT/modes-gqa-nofa3.log 2>&1; echo "modes rc $?" >> $OUT/modes-gqa-nofa3.log)
  tail -20 $OUT/modes-gqa-nofa3.log
fi
OPENVC_SKIP_INSTALL=1 DIFFUSERS_E2E_ARGS="--models cosmos3" timeout 200 bash scripts/device/check.sh diffusers-e2e \
  > $OUT/check_e2e.log 2>&1
tail -20 $OUT/check_e2e.log

#!/bin/bash
# Twenty-eighth session, call D: the FP8 KV cache with grouped K/V heads (FP8KVCache(kv_heads=), PrepareParams'
# KV-cache fields and AttentionParams::v_descale_per_block with kv_heads). The library (N) taken from the wheel
# built here; the C++ GPU tests of GQA, V block descales and the cache's layouts, memcheck on the GQA step-wise test, the Python GPU tests of the cache and
# GQA files, the two files call B failed (fixed in f8fb62e), and the smoke check.
# Then bench.modes' kvcache case (the H12 step and the 32 / 8-head grouped step) against FA3 in the same process.
# Carry: .carry/kvgqa (wheel, openvc_gpu_tests_N.gz), .anchors.
cd "$(dirname "$0")/../../.."
OUT=$OUT PYTHON=python3 bash .anchors/build.sh > $OUT/anchors.log 2>&1   # FA3 builds in the background
mkdir -p /tmp/N /tmp/bin
export OPENVC_WHEEL=$(ls $PWD/.carry/kvgqa/open_vc_attn-*.whl | head -1)
python3 -c "import sys, zipfile; open('/tmp/N/libopenvc.so', 'wb').write(zipfile.ZipFile(sys.argv[1]).read('open_vc_attn/libopenvc.so'))" "$OPENVC_WHEEL"
gunzip -c .carry/kvgqa/openvc_gpu_tests_N.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
T=/tmp/bin/openvc_gpu_tests
filter() { grep -vE "^\[ +(RUN|OK) +\]"; }
LD_LIBRARY_PATH=/tmp/N timeout 60 $T --gtest_filter='Sm90Gqa.*:Sm90VBlockDescale*:*PrepareOutLayout*' 2>&1 | filter > $OUT/tests_gqa_N.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_gqa_N.log; tail -4 $OUT/tests_gqa_N.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
LD_LIBRARY_PATH=/tmp/N timeout 100 $san --tool memcheck --error-exitcode 9 $T --gtest_filter='Sm90Gqa.Stepwise*' > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1) $(grep -cE 'OK \]' /tmp/memcheck.log) ok" | tee $OUT/sanitizer_N.log
grep -m20 -E "Invalid|FAILED|Failure" /tmp/memcheck.log >> $OUT/sanitizer_N.log
# every other C++ GPU test only where time is left (OPENVC_ALL_CPP=1): the device budget was short this session
if [ -n "$OPENVC_ALL_CPP" ]; then
  LD_LIBRARY_PATH=/tmp/N timeout 150 $T --gtest_filter='-Sm90Gqa.*:Sm90VBlockDescale*:*PrepareOutLayout*' 2>&1 | filter > $OUT/tests_N.log
  echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_N.log; tail -4 $OUT/tests_N.log
fi
PYTEST_ARGS="tests/python/test_gpu_kv_cache.py tests/python/test_gpu_gqa.py tests/python/test_gqa.py \
  tests/python/test_integrations_diffusers_anyflow_helios.py" timeout 200 bash scripts/device/check.sh install pytest \
  > $OUT/check_pytest.log 2>&1
tail -6 $OUT/check_pytest.log
OPENVC_SKIP_INSTALL=1 timeout 120 bash scripts/device/check.sh smoke > $OUT/check_smoke.log 2>&1
tail -4 $OUT/check_smoke.log
while [ ! -f /tmp/w/fa3.rc ]; do sleep 3; done; echo "fa3 rc $(cat /tmp/w/fa3.rc)"
(cd /tmp && PYTHONPATH=/tmp/w/fa/hopper timeout 150 python3 -m open_vc_attn.bench.modes --cases kvcache --rounds 5 \
   --out $OUT/modes-kvcache.json > $OUT/modes-kvcache.log 2>&1; echo "modes rc $?" >> $OUT/modes-kvcache.log)
tail -8 $OUT/modes-kvcache.log

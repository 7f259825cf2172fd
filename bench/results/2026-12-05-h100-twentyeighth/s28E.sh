#!/bin/bash
# Twenty-eighth session, call E: s28D.sh cut to what about 110 s of device time holds (the rest of the session's
# device budget after a cold start): the C++ GPU tests of GQA, V block descales and the cache's layouts, memcheck on
# the GQA step-wise test (the cache's fields with kv_heads), the Python GPU tests of the FP8 KV cache and GQA, then
# the smoke check. Carry: .carry/kvgqa.
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/N /tmp/bin
export OPENVC_WHEEL=$(ls $PWD/.carry/kvgqa/open_vc_attn-*.whl | head -1)
python3 -c "import sys, zipfile; open('/tmp/N/libopenvc.so', 'wb').write(zipfile.ZipFile(sys.argv[1]).read('open_vc_attn/libopenvc.so'))" "$OPENVC_WHEEL"
gunzip -c .carry/kvgqa/openvc_gpu_tests_N.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
T=/tmp/bin/openvc_gpu_tests
LD_LIBRARY_PATH=/tmp/N timeout 40 $T --gtest_filter='Sm90Gqa.*:Sm90VBlockDescale*:*PrepareOutLayout*' 2>&1 \
  | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_gqa_N.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_gqa_N.log; tail -3 $OUT/tests_gqa_N.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
LD_LIBRARY_PATH=/tmp/N timeout 60 $san --tool memcheck --error-exitcode 9 $T --gtest_filter='Sm90Gqa.Stepwise*' > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1) $(grep -cE 'OK \]' /tmp/memcheck.log) ok" | tee $OUT/sanitizer_N.log
grep -m20 -E "Invalid|FAILED|Failure" /tmp/memcheck.log >> $OUT/sanitizer_N.log
PYTEST_ARGS="-x tests/python/test_gpu_kv_cache.py tests/python/test_gpu_gqa.py" timeout 150 bash scripts/device/check.sh \
  install pytest > $OUT/check_pytest.log 2>&1
tail -4 $OUT/check_pytest.log
OPENVC_SKIP_INSTALL=1 timeout 90 bash scripts/device/check.sh smoke > $OUT/check_smoke.log 2>&1
tail -3 $OUT/check_smoke.log

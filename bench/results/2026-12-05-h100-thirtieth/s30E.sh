#!/bin/bash
# Thirtieth session, call E: the review's test additions (causal rows without keys in tiles with keys, causal with key
# counts, a packed sequence longer than max_seqlen_k) on the branch's library: Sm90VBias* and memcheck on them, the
# Python correction and policy tests. Carry: .carry/v30 (the same libopenvc.so; new test binary, wheel repackaged).
cd "$(dirname "$0")/../../.."
W=$(ls $PWD/.carry/v30/open_vc_attn-*.whl | head -1)
mkdir -p /tmp/V /tmp/bin
python3 -c "import sys, zipfile; open('/tmp/V/libopenvc.so', 'wb').write(zipfile.ZipFile(sys.argv[1]).read('open_vc_attn/libopenvc.so'))" "$W"
gunzip -c .carry/v30/openvc_gpu_tests.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
T=/tmp/bin/openvc_gpu_tests
LD_LIBRARY_PATH=/tmp/V timeout 90 $T --gtest_filter='Sm90VBias*' 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_vbias_e.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_vbias_e.log; tail -3 $OUT/tests_vbias_e.log; grep -m10 -E "Failure|FAILED|Expected|Which is" $OUT/tests_vbias_e.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
LD_LIBRARY_PATH=/tmp/V timeout 150 $san --tool memcheck --error-exitcode 9 $T --gtest_filter='Sm90VBias.*' > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1) $(grep -cE 'OK \]' /tmp/memcheck.log) ok" | tee $OUT/sanitizer_vbias_e.log
grep -m20 -E "Invalid|FAILED|Failure" /tmp/memcheck.log >> $OUT/sanitizer_vbias_e.log
OPENVC_WHEEL=$W PYTEST_ARGS="tests/python/test_gpu_v_bias.py tests/python/test_integrations_policy.py tests/python/test_ops_call.py" \
  timeout 200 bash scripts/device/check.sh install pytest > $OUT/check_pytest_e.log 2>&1
tail -3 $OUT/check_pytest_e.log; cp $OUT/pytest.log $OUT/pytest_e.log 2>/dev/null; grep -E "FAILED|Error" $OUT/pytest_e.log | head

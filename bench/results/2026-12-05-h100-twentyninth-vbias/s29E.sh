#!/bin/bash
# Twenty-ninth session, call 5: the review fixes of branch v-bias (a packed sequence past max_seqlen_k; tests that see
# the bias itself) and the two C++ tests that matched the old workspace message. Carry: .carry/vbias.
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/V /tmp/bin
WV=$(ls $PWD/.carry/vbias/open_vc_attn-*.whl | head -1)
python3 -c "import sys, zipfile; open('/tmp/V/libopenvc.so', 'wb').write(zipfile.ZipFile(sys.argv[1]).read('open_vc_attn/libopenvc.so'))" "$WV"
gunzip -c .carry/vbias/openvc_gpu_tests_V.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
LD_LIBRARY_PATH=/tmp/V timeout 90 /tmp/bin/openvc_gpu_tests --gtest_filter='Sm90VBias*:PrepareInt8Args.*:PrepareVarlenArgs.*:*Prepare*' 2>&1 \
  | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_e.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_e.log; tail -4 $OUT/tests_e.log
OPENVC_WHEEL=$WV PYTEST_ARGS="tests/python/test_gpu_v_bias.py tests/python/test_ops_direct.py" timeout 150 \
  bash scripts/device/check.sh install pytest > $OUT/check_pytest_e.log 2>&1
tail -4 $OUT/check_pytest_e.log

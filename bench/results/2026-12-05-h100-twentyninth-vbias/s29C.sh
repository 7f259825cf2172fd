#!/bin/bash
# Twenty-ninth session, call 3: the V rounding bias correction (branch v-bias). The branch's wheel (V) and GPU test
# binary from .carry/vbias; main's wheel (M, the kvcache-gqa wheel: same kernels as main) for the A/B of the default
# call. C++: Sm90VBias* then every other GPU test; memcheck on Sm90VBias*; Python GPU tests of the correction and the
# one-call op; the error of each mode with and without it (bench.qk_tradeoff, no peers); the complete call's time
# with and without it; the default call's time on V against M (alternating processes).
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/V /tmp/bin /tmp/M
WV=$(ls $PWD/.carry/vbias/open_vc_attn-*.whl | head -1); WM=$(ls $PWD/.carry/kvgqa/open_vc_attn-*.whl | head -1)
python3 -c "import sys, zipfile; open('/tmp/V/libopenvc.so', 'wb').write(zipfile.ZipFile(sys.argv[1]).read('open_vc_attn/libopenvc.so'))" "$WV"
gunzip -c .carry/vbias/openvc_gpu_tests_V.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
T=/tmp/bin/openvc_gpu_tests
filter() { grep -vE "^\[ +(RUN|OK) +\]"; }
LD_LIBRARY_PATH=/tmp/V timeout 60 $T --gtest_filter='Sm90VBias*' 2>&1 | filter > $OUT/tests_vbias.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_vbias.log; tail -4 $OUT/tests_vbias.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
LD_LIBRARY_PATH=/tmp/V timeout 90 $san --tool memcheck --error-exitcode 9 $T --gtest_filter='Sm90VBias.Bias*:Sm90VBias.Out*' > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1) $(grep -cE 'OK \]' /tmp/memcheck.log) ok" | tee $OUT/sanitizer_vbias.log
grep -m20 -E "Invalid|FAILED|Failure" /tmp/memcheck.log >> $OUT/sanitizer_vbias.log
LD_LIBRARY_PATH=/tmp/V timeout 130 $T --gtest_filter='-Sm90VBias*' 2>&1 | filter > $OUT/tests_all.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_all.log; tail -3 $OUT/tests_all.log
OPENVC_WHEEL=$WV PYTEST_ARGS="tests/python/test_gpu_v_bias.py tests/python/test_ops_call.py" timeout 120 \
  bash scripts/device/check.sh install pytest > $OUT/check_pytest.log 2>&1
tail -4 $OUT/check_pytest.log
(cd /tmp && timeout 100 python3 -m open_vc_attn.bench.qk_tradeoff --methods \
  openvc-e4m3,openvc-e4m3+vbias,openvc-int8+smooth,openvc-int8+smooth+vbias,openvc-int8+smooth+exp2,openvc-int8+smooth+exp2+vbias \
  --speed-shape none --no-png --out $OUT/qk_vbias.json > $OUT/qk_vbias.log 2>&1; echo "qk rc $?" >> $OUT/qk_vbias.log)
tail -12 $OUT/qk_vbias.md 2>/dev/null | head -12
(cd /tmp && timeout 120 python3 $OLDPWD/bench/results/2026-12-05-h100-twentyninth-vbias/time_v_bias.py > $OUT/time_v_bias.log 2>&1)
cat $OUT/time_v_bias.log | python3 -c "import sys, json; [print(r['shape'], {k: round(v, 4) for k, v in r['vbias_over_plain'].items()}) for r in map(json.loads, sys.stdin)]"
python3 -m pip install -q --no-deps --target /tmp/M "$WM" > /dev/null 2>&1
for i in 1 2; do
  (cd /tmp && PYTHONPATH=/tmp/M timeout 40 python3 $OLDPWD/bench/results/2026-12-05-h100-twentyninth-vbias/time_v_bias.py --only-default | sed 's/^/M /')
  (cd /tmp && timeout 40 python3 $OLDPWD/bench/results/2026-12-05-h100-twentyninth-vbias/time_v_bias.py --only-default | sed 's/^/V /')
done > $OUT/ab_default.log 2>&1
grep -o '^[MV] .*"tflops": {[^}]*}' $OUT/ab_default.log | sed 's/"median_ms.*"tflops"/tflops/'

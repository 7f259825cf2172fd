#!/bin/bash
# Thirtieth session, call D: the branch's whole Python suite on the GPU (diffusers 0.42.1 on the path, so the
# integration tests run, with DispatchPolicy's v_bias_correction among them) and the smoke check. Carry: .carry/v30, .whl.
cd "$(dirname "$0")/../../.."
W=$(ls $PWD/.carry/v30/open_vc_attn-*.whl | head -1)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
OPENVC_WHEEL=$W timeout 570 bash scripts/device/check.sh install pytest smoke > $OUT/check_pytest_smoke.log 2>&1
echo "rc $?"; tail -5 $OUT/check_pytest_smoke.log; grep -E "FAILED|^ERROR" $OUT/pytest.log | head -20; tail -2 $OUT/pytest.log

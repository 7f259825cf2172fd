#!/bin/bash
# Twenty-seventh session, call B: the branch's wheel (.carry/gqa) on the H200: every Python GPU test (pytest -m gpu
# tests/python), the smoke check, then Cosmos 3's transformer forward (scripts/device/diffusers_e2e.py --models
# cosmos3: 36 layers at class-default widths, 44,160 video + 256 prompt tokens, its GQA video attention on openvc)
# against diffusers' native attention, with the carried .whl/ (diffusers 0.42.1, importlib_metadata).
cd "$(dirname "$0")/../../.."
export OPENVC_WHEEL=$(ls $PWD/.carry/gqa/open_vc_attn-*.whl | head -1)
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
PYTEST_ARGS="-m gpu tests/python" timeout 330 bash scripts/device/check.sh install pytest smoke > $OUT/check_pytest.log 2>&1
tail -8 $OUT/check_pytest.log
OPENVC_SKIP_INSTALL=1 DIFFUSERS_E2E_ARGS="--models cosmos3" timeout 230 bash scripts/device/check.sh diffusers-e2e \
  > $OUT/check_e2e.log 2>&1
tail -20 $OUT/check_e2e.log

#!/bin/bash
# The Python side on the device, with peers (the twenty-third session's unrun call C, on this session's tree): the
# package wheel built on the CI machine for this image's Python 3.12 from 246857b or later (carried in .carry; split
# tiles off by default there, so every call takes the twenty-third session's kernels), the Python INT8 GPU tests (the
# few-large-query-rows case of a2e4bd7's fix among them), issue 28's short shapes and issue 25's INT8 shapes with FA3
# (hopper/ 0251105a, built here from the carried .anchors) and cuDNN in the same process (SageAttention2 not carried).
# Run after s24B.sh (the C++ GPU tests of the same kernels).
cd "$(dirname "$0")/../../.."
bash .anchors/build.sh
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
export PYTHONPATH=/tmp/w/fa/hopper OPENVC_WHEEL=$(ls $PWD/.carry/open_vc_attn-*.whl | head -1) MODES_ROUNDS=5
# The install and the tests while FA3 builds; then the peers' shapes on the installed package.
PYTEST_ARGS="tests/python/test_gpu_int8_mode.py" timeout 200 bash scripts/device/check.sh install pytest
w=0; while [ ! -f /tmp/w/fa3.rc ] && [ $w -lt 240 ]; do sleep 5; w=$((w + 5)); done
echo "fa3 build rc=$(cat /tmp/w/fa3.rc 2>/dev/null) after ${w} s more"
OPENVC_SKIP_INSTALL=1 timeout 330 bash scripts/device/check.sh modes-short modes-int8

#!/bin/bash
# Call C: the final tree on the GPU (library and wheel of 5c19e98: split tiles' planner model removed, kAuto = whole
# tiles, library SASS identical to 246857b's; C++ GPU tests of 9cac04b: the shared graph-capture helper): every C++ GPU
# test, then the cp312 wheel installed, every Python GPU test
# (pytest -m gpu tests/python) and the smoke check (open-vc-attn-check --smoke). Carry: .carry with
# libopenvc_F.so.gz, openvc_gpu_tests_F.gz and final/open_vc_attn-*.whl, built on the CI machine.
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/F /tmp/bin
gunzip -c .carry/libopenvc_F.so.gz > /tmp/F/libopenvc.so
gunzip -c .carry/openvc_gpu_tests_F.gz > /tmp/bin/openvc_gpu_tests_F; chmod +x /tmp/bin/openvc_gpu_tests_F
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
LD_LIBRARY_PATH=/tmp/F timeout 240 /tmp/bin/openvc_gpu_tests_F 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_F.log
echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_F.log; tail -3 $OUT/tests_F.log
export OPENVC_WHEEL=$(ls $PWD/.carry/final/open_vc_attn-*.whl | head -1)
PYTEST_ARGS="-m gpu tests/python" timeout 420 bash scripts/device/check.sh install pytest smoke

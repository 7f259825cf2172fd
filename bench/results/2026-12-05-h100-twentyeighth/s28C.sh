#!/bin/bash
# Twenty-eighth session, call C: the two Python GPU tests call B failed, as fixed since (test_gpu_kv_cache.py: the
# refusal's new words; test_integrations_diffusers_anyflow_helios.py: skips without diffusers), and the smoke check
# call B's time limit cut. Carry: .carry/gqa (the branch's cp312 wheel).
cd "$(dirname "$0")/../../.."
export OPENVC_WHEEL=$(ls $PWD/.carry/gqa/open_vc_attn-*.whl | head -1)
PYTEST_ARGS="tests/python/test_gpu_kv_cache.py tests/python/test_integrations_diffusers_anyflow_helios.py" \
  timeout 400 bash scripts/device/check.sh install pytest smoke

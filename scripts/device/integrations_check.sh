#!/usr/bin/env bash
# Device-side check of the diffusers and SGLang integrations (docs/integrations/diffusers.md, sglang.md):
# the carried wheels (.whl: diffusers, sglang, pyzmq; installed with --no-deps into /tmp/site), open_vc_attn
# (installed from this tree when `import open_vc_attn.integrations` fails or OPENVC_REINSTALL=1; that needs
# third_party/cutlass carried), then the integration tests and the examples. Logs and JSON under $OUT
# (7 files). Usage: bash scripts/device/integrations_check.sh     (carry .whl and third_party/cutlass)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rc=0
if [ "${OPENVC_REINSTALL:-0}" = 1 ] || ! python3 -c "import open_vc_attn.integrations.policy" 2>/dev/null; then
  export OPENVC_CUTLASS_INCLUDE=$PWD/third_party/cutlass/include CMAKE_BUILD_PARALLEL_LEVEL=16
  ( time python3 -m pip install -q --no-build-isolation --no-deps . ) > "$OUT/setup.log" 2>&1 \
    || { tail -30 "$OUT/setup.log"; exit 1; }
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import open_vc_attn, diffusers, torch; print('open_vc_attn', open_vc_attn.__file__, '| diffusers',
diffusers.__version__, '| torch', torch.__version__)" 2>&1 | tee -a "$OUT/setup.log"

timeout 400 python3 -m pytest -q -rs -s -p no:cacheprovider tests/python/test_integrations_policy.py \
  tests/python/test_integrations_diffusers.py tests/python/test_integrations_sglang.py > "$OUT/pytest.log" 2>&1 || rc=1
grep -E "passed|failed|SKIPPED|FAILED|Error|sglang attention backends|Wan random" "$OUT/pytest.log" | tail -20

ex() {  # ex NAME ARGS...: one example, appended to examples.log
  echo "== $*" >> "$OUT/examples.log"
  timeout 150 python3 "$@" >> "$OUT/examples.log" 2>&1 || { echo "FAILED: $*"; rc=1; }
}
ex examples/diffusers_wan.py --frames 11 --json "$OUT/diffusers_wan_17k.json"
ex examples/diffusers_wan.py --frames 21 --require-speedup --json "$OUT/diffusers_wan_33k.json"
ex examples/sglang_backend.py --json "$OUT/sglang_backend.json"
ex examples/policy_crossover.py --json "$OUT/policy_crossover.json"
grep -vE "^\s*$" "$OUT/examples.log" | tail -32
echo "integrations_check: rc=$rc"
exit $rc

#!/usr/bin/env bash
# Device-side: build and install the wheel from this tree, the Python GPU tests (integration tests
# aside: scripts/device/integrations_check.sh), the video benchmark at H = 7 and 14 (open-vc, repair,
# VC, cuDNN), the repair selection study and the VC grouping cost at S = 73,397, H = 56.
# Carry third_party/cutlass. Usage (on the device): bash scripts/device/results_check.sh
set -u
OUT=${OUT:-/tmp/out}
R=$PWD
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPENVC_CUTLASS_INCLUDE=$R/third_party/cutlass/include CMAKE_BUILD_PARALLEL_LEVEL=16
( time python3 -m pip wheel -q --no-build-isolation --no-deps . -w "$OUT/wheel" ) > "$OUT/wheel.log" 2>&1 \
  || { tail -30 "$OUT/wheel.log"; exit 1; }
python3 -m pip install -q --no-deps --force-reinstall "$OUT"/wheel/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
cd /tmp
timeout 60 python3 -m pytest -q -p no:cacheprovider "$R/tests/python/test_gpu_repair.py::test_extension_repair_bindings" \
  2>&1 | tail -3
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider "$R/tests/python" -k "not integrations" > "$OUT/pytest.log" 2>&1
grep -E "passed|failed|FAILED|^E  " "$OUT/pytest.log" | tail -20
timeout 200 open-vc-attn-bench --preset video --heads 7,14 --backends open-vc,open-vc-repair,vc,sdpa-cudnn \
  --repair-budgets 0,0.005 --accuracy-rows 4096 --rounds 8 --out "$OUT/video7_14.json" > "$OUT/bench7_14.log" 2>&1
grep -E "TF|record" "$OUT/bench7_14.log" | tail -24
timeout 150 python3 "$R/scripts/device/repair_selection_eval.py" "$OUT/repair_eval.json" > "$OUT/repair_eval.log" 2>&1
tail -25 "$OUT/repair_eval.log"
timeout 90 python3 - <<'PY' 2>&1 | tee "$OUT/vc_cost.log"
import json, os, torch
from open_vc_attn import baselines
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 73397, 56, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
r = baselines.benchmark_vc(q, k, v, iters=5)
print("VC stages at S=73397 H=56 (random normal):", json.dumps(r))
json.dump(r, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "vc_cost.json"), "w"))
PY

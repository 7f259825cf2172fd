#!/usr/bin/env bash
# The one entry point for work on the GPU machine: named steps, run in the order given, each logging to
# $OUT/<step>.log and printing a short summary; a failing step is reported and the next one still runs
# (exit status 1 if any failed). scripts/README.md maps each doc to the step it cites.
#
#   bash scripts/device/check.sh STEP [STEP ...]        e.g.  check.sh install cpp-tests sanitizer pytest
#   bash scripts/device/check.sh help
#
# Steps (C++ ones use binaries built on the CPU machine and carried: $BUILD/src/libopenvc.so,
# $BUILD/tests/cpp/openvc_gpu_tests, $BUILD/openvc_bench_attention; Python ones the installed package):
#   install           build the package wheel with this machine's torch (no network: --no-build-isolation
#                     --no-deps) and install it. CUTLASS headers: third_party/cutlass/include when carried,
#                     else unpacked from the carried .whl/nvidia_cutlass-*.whl (scripts/cutlass_headers.py
#                     --offline). Python steps run it once per call by themselves (OPENVC_SKIP_INSTALL=1:
#                     use what is installed; OPENVC_WHEEL=path: install that wheel instead of building one).
#   cpp-tests         the C++ GPU suites ($CPP_FILTER, default all).
#   sanitizer         compute-sanitizer memcheck and racecheck on small shapes of each kernel family
#                     ($SANITIZER_FILTERS, space-separated gtest filters).
#   sass              instruction counts of the attention kernel's SASS (cuobjdump).
#   kernel-bench      openvc_bench_attention over $KERNEL_SHAPES ("S,H" pairs); KERNEL_BENCH_MODE=int8 also times
#                     the INT8 kernel modes next to E4M3 in the same process.
#   prev              the production kernel against an earlier commit's (scripts/prev_kernel.sh), paired.
#   variants          the stage-breakdown variants, interleaved and paired (binary built with
#                     -DOPENVC_BENCH_VARIANTS=ON), S = 73,397 at H = 7, 14, 56, $VARIANT_ROUNDS rounds.
#   profile           Nsight Compute profile of the production kernel (S = 32,768, H = 7): ncu_details.txt
#                     and the per-instruction CSV ncu_source.csv (read it with scripts/profile_summary.py).
#   profile-cross     the same for one text cross-attention call (scripts/device/cross_call.py: 32,760 queries x 512
#                     keys, H = 40; issue 28), with the installed package: ncu_cross_details.txt, ncu_cross_source.csv
#                     ($CROSS_CALL_ARGS appended, e.g. "--complete": the one-call path's kernel, Q quantized in it).
#   pytest            the Python tests against the installed package ($PYTEST_ARGS, default tests/python).
#   smoke             open-vc-attn-check --smoke.
#   bench PRESET      open-vc-attn-bench --preset PRESET with the options below, then open-vc-attn-report;
#                     $BENCH_ARGS are appended (later options win). PRESET is a preset of the benchmark or
#                     one of the two named runs video-kernel / video-repair-vc.
#   repair-eval       scripts/device/repair_selection_eval.py (energy vs attention-aware selection).
#   vc-cost           the VC baseline's stage costs at S = 73,397, H = 56 (baselines.benchmark_vc).
#   integrations      diffusers, SGLang and yunchang: the carried .whl/*.whl (diffusers, sglang, pyzmq, yunchang)
#                     into /tmp/site, the integration tests and the four examples.
#   diffusers-e2e     scripts/device/diffusers_e2e.py with the carried .whl/ (diffusers): HunyuanVideo, LTX-Video,
#                     Motif-Video, CogVideoX 5B and 1.5, Mochi and Cosmos 3 (GQA, 32 / 8 heads) transformer forwards
#                     at real widths and token counts, native SDPA vs openvc, calls by path; $OUT/diffusers_e2e.json
#                     ($DIFFUSERS_E2E_ARGS appended, e.g. "--models cosmos3" or "--models ltx --policy-head-dims
#                     64,128"; not yet timed with the four new models: estimated ~5 min, < 40 GiB).
#   dispatch-floor    scripts/device/dispatch_floor.py: eager per-call time of attention() against SDPA (default,
#                     cuDNN, flash): the floor at tiny shapes, a profile of one call, the (Sq, Sk) grid at 12/24/40
#                     heads and its crossover ($FLOOR_ARGS are appended; about 3 minutes).
#   host-breakdown    scripts/device/host_breakdown.py: host time of each step of one eager attention() call
#                     (Sq = Sk = 256, H = 12) against SDPA; $OUT/host_breakdown.json.
#   ulysses           torchrun over every GPU of the machine: scripts/device/ulysses_multi_gpu.py.
#   anchors           the same-run peers: runs the carried, git-ignored .anchors/build.sh (made as
#                     shared/tools/fa3-anchor.md and sage2-anchor.md say; it starts the FA3 and SageAttention2
#                     builds in the background under /tmp/w, logs $OUT/anchor-*.log) and sets PYTHONPATH for the
#                     later steps (/tmp/w/fa/hopper, /tmp/w/sage). On a warm machine a later call starts nothing new.
#   modes-int8        python -m open_vc_attn.bench.modes --cases int8 (issue 25's shapes: openvc e4m3 / int8 /
#                     int8+smooth / int8+smooth+exp2, SA2, FA3, cuDNN), $OUT/modes-int8.json ($MODES_ROUNDS
#                     rounds, default 7).
#   modes-kvcache     python -m open_vc_attn.bench.modes --cases kvcache (issue 26's KV cache: one step of a 3-frame
#                     chunk, 4,680 tokens, H = 12 and 32 / 8 K/V heads, after 18 cached frames of 1,560 tokens, against
#                     FA3 FP8 / BF16 and cuDNN BF16), $OUT/modes-kvcache.json ($MODES_ROUNDS rounds; waits for the anchors' FA3).
#   modes-cross       python -m open_vc_attn.bench.modes --cases cross (issue 28's text cross-attention: 32,760 and
#                     75,600 queries against 512 keys, H = 40; the complete call and the kernel against FA3 BF16 / FP8
#                     and cuDNN BF16), $OUT/modes-cross.json ($MODES_ROUNDS rounds; waits for the anchors' FA3).
#   modes-short       python -m open_vc_attn.bench.modes --cases short (issue 28's short shapes: S = 4,096 H = 7, 8,192
#                     H = 40, causal 16,384 H = 24, 8 packed x 9,000 H = 24, batch 2 x 32,760 H = 12; the complete call
#                     and the kernel against FA3 BF16 / FP8, cuDNN BF16 and SA2 when built), $OUT/modes-short.json.
#   modes-gqa         python -m open_vc_attn.bench.modes --cases gqa (grouped-query attention: 32 query on 8 K/V heads
#                     at S = 32,760 and causal 32,768, MQA 24 on 1 at 16,384; the complete call, the call on repeated
#                     K/V heads and the kernel against FA3 BF16 / FP8, SA2 when built, cuDNN BF16), $OUT/modes-gqa.json.
#   modes-sparse      python -m open_vc_attn.bench.modes --cases sparse (issue 26: S = 75,600 H = 40, openvc dense,
#                     block masks window / frame causal / random 10..100% / radial and chunked causal against
#                     torch.compile(flex_attention) BF16 on the same BlockMask, acceptance lines printed at the end),
#                     $OUT/modes-sparse.json ($MODES_ROUNDS rounds, default 7; at most $MODES_SPARSE_TIMEOUT s,
#                     default 420; no anchors needed).
#   qk-tradeoff       python -m open_vc_attn.bench.qk_tradeoff: error vs speed of the Q/K formats and the peers,
#                     $OUT/qk_tradeoff.{json,md,png} ($QK_TRADEOFF_ARGS appended, e.g. "--seeds 0,1,2").
#                     modes-int8 and qk-tradeoff wait for the anchors' builds first (at most $ANCHOR_WAIT_S s, default 420) and say
#                     which peers are available.
#   wan-formats       scripts/device/wan_formats.py (issue 25's end-to-end line) with the carried .whl/ (diffusers):
#                     the Wan transformer (examples/diffusers_wan.py, sharpen 3) at 1.3B 480p widths (32,760 tokens,
#                     4 blocks) and 14B 720p widths (75,600 tokens, 2 blocks), native SDPA vs openvc e4m3 /
#                     int8+smooth / int8+smooth+exp2 / int8+smooth+exp2+vbias / auto (per-module choice, not
#                     timed) vs SageAttention2 routed in for the same calls: rel L2 vs native, ms per forward,
#                     calls by path;
#                     $OUT/wan_formats.json ($WAN_FORMATS_ARGS appended, e.g. "--configs 14b-720p --runs 7").
#                     Waits for the anchors' SageAttention2 like modes-int8.
# Environment: OUT (default /tmp/out), BUILD (default build/dev), GIT_COMMIT (recorded by bench), PYTHON.
set -u
OUT=${OUT:-/tmp/out}
BUILD=${BUILD:-build/dev}
PY=${PYTHON:-python3}
REPO=$PWD
CPP_TESTS=$BUILD/tests/cpp/openvc_gpu_tests
KERNEL_BENCH=$BUILD/openvc_bench_attention
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The Python package must load its own libopenvc.so (RUNPATH $ORIGIN), never the carried one (a library
# built with another toolchain need not match this machine's libstdc++): C++ steps set the path locally.
unset LD_LIBRARY_PATH

cpp_env() { export LD_LIBRARY_PATH=$REPO/$BUILD/src; }
tool() { command -v "$1" 2>/dev/null || ls $2 2>/dev/null | head -1; }

# ---- install (one block for every Python step) -------------------------------------------------------------

WHEEL_DIR=/tmp/openvc-wheel
INSTALLED=0
WHEEL_PID=

wheel_start() {  # builds the wheel in the background, so that C++ steps can run meanwhile
  [ -n "$WHEEL_PID" ] || [ "$INSTALLED" = 1 ] || [ "${OPENVC_SKIP_INSTALL:-0}" = 1 ] || [ -n "${OPENVC_WHEEL:-}" ] \
    && return 0
  rm -rf "$WHEEL_DIR"
  ( "$PY" "$REPO/scripts/cutlass_headers.py" --offline   # nothing to do when the headers are there
    export OPENVC_CUTLASS_INCLUDE=$REPO/third_party/cutlass/include CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
    time "$PY" -m pip wheel -q --no-build-isolation --no-deps "$REPO" -w "$WHEEL_DIR" ) > "$OUT/install.log" 2>&1 &
  WHEEL_PID=$!
}

step_install() {
  [ "$INSTALLED" = 1 ] && return 0
  if [ "${OPENVC_SKIP_INSTALL:-0}" = 1 ]; then
    "$PY" -c "import open_vc_attn._openvc_ext" || { echo "install: OPENVC_SKIP_INSTALL=1 but nothing installed"; return 1; }
    INSTALLED=1; return 0
  fi
  local wheel=${OPENVC_WHEEL:-}
  if [ -z "$wheel" ]; then
    wheel_start
    wait "$WHEEL_PID" || { echo "install: wheel build FAILED"; tail -30 "$OUT/install.log"; WHEEL_PID=; return 1; }
    WHEEL_PID=
    wheel=$(ls "$WHEEL_DIR"/*.whl | head -1)
  fi
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel" >> "$OUT/install.log" 2>&1 \
    || { echo "install: pip install FAILED"; tail -20 "$OUT/install.log"; return 1; }
  INSTALLED=1
  (cd /tmp && "$PY" -c "import open_vc_attn; print('install:', open_vc_attn.__file__)")
}

# ---- C++ steps (carried binaries) ---------------------------------------------------------------------------

step_cpp_tests() {
  (cpp_env
   timeout 420 "$CPP_TESTS" --gtest_filter="${CPP_FILTER:-*}" 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > "$OUT/cpp-tests.log"
   rc=${PIPESTATUS[0]}
   grep -E "^\[  (PASSED|FAILED) |FAILED TEST|^\[==========\]" "$OUT/cpp-tests.log" | tail -12
   exit "$rc")
}

step_sanitizer() {
  local filters=${SANITIZER_FILTERS:-"Sm90Attention.SmallShapes:Prepare/PrepareShapes.*B2_Sq1000*:PrepareVarlen*
    Sm90Attention.ZeroResidual* GeneralAttention.PackedThreeSequences RepairGiven.* VcPrepare.ByteIdenticalToReference"}
  local san rc=0
  san=$(tool compute-sanitizer /usr/local/cuda/bin/compute-sanitizer)
  (cpp_env
   for f in $filters; do
     for t in memcheck racecheck; do
       timeout 150 "$san" --tool $t --error-exitcode 9 "$CPP_TESTS" --gtest_filter="$f" >> "$OUT/sanitizer.log" 2>&1
       r=$?
       echo "sanitizer $t $f: rc=$r $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -1)"
       [ $r = 0 ] || rc=1
     done
   done
   exit $rc)
}

step_sass() {
  local objdump
  objdump=$(tool cuobjdump /usr/local/cuda/bin/cuobjdump)
  [ -n "$objdump" ] || { echo "sass: cuobjdump not found"; return 1; }
  "$objdump" -sass "$BUILD/src/libopenvc.so" > "$OUT/libopenvc.sass" 2>/dev/null || return 1
  echo "SASS of the attention kernel (instruction counts):"
  awk '/Function : .*expcast_attention/{f=1} /Function : /{if($0 !~ /expcast_attention/) f=0} f' "$OUT/libopenvc.sass" |
    grep -oE "(QGMMA|MUFU\.[A-Z0-9]+|F2FP\.[A-Z0-9.]+|LDL|STL|CALL[A-Z.]*|HMNMX2|PRMT|WARPGROUP\.[A-Z]+)" | sort | uniq -c |
    tee "$OUT/sass.log"
}

step_kernel_bench() {
  local shapes=${KERNEL_SHAPES:-"73397,7 73397,14 73397,56 32760,40 4096,7"} rc=0
  (cpp_env
   for sh in $shapes; do   # S,H pairs
     timeout 120 "$KERNEL_BENCH" ${sh%,*} ${sh#*,} 1 7 4 ${KERNEL_BENCH_MODE:-} 2>&1 | tee -a "$OUT/kernel-bench.log"
     [ "${PIPESTATUS[0]}" = 0 ] || rc=1
   done
   exit $rc)
}

# The production kernel against an earlier commit's (scripts/prev_kernel.sh; binary built with
# -DOPENVC_BENCH_PREV_KERNEL=...), interleaved and paired in one process, S = 73,397 at H = 7, 14, 56.
step_prev() {
  (cpp_env
   rc=0
   for h in ${PREV_HEADS:-7 14 56}; do
     timeout 200 "$KERNEL_BENCH" 73397 $h 1 "${VARIANT_ROUNDS:-9}" 4 prev 2>&1 | tee -a "$OUT/prev.log"
     [ "${PIPESTATUS[0]}" = 0 ] || rc=1
   done
   exit $rc)
}

step_variants() {
  (cpp_env
   rc=0
   for h in 7 14 56; do
     timeout 240 "$KERNEL_BENCH" 73397 $h 1 "${VARIANT_ROUNDS:-7}" 4 variants 2>&1 | tee -a "$OUT/variants.log"
     [ "${PIPESTATUS[0]}" = 0 ] || rc=1
   done
   exit $rc)
}

# Nsight Compute of one launch of the attention kernel in COMMAND (the launch after SKIP others), then its details
# page and per-instruction CSV: ncu_profile TAG SKIP COMMAND... writes $OUT/prof$TAG.ncu-rep, ncu${TAG}_run.txt,
# ncu${TAG}_details.txt and ncu${TAG}_source.csv (read it with scripts/profile_summary.py).
ncu_profile() {
  local tag=$1 skip=$2 ncu
  shift 2
  ncu=$(tool ncu "/opt/nvidia/nsight-compute/*/ncu")
  [ -n "$ncu" ] || { echo "profile$tag: ncu not found"; return 1; }
  timeout 300 "$ncu" --clock-control none -k regex:expcast_attention --launch-skip "$skip" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    -o "$OUT/prof$tag" -f "$@" > "$OUT/ncu${tag}_run.txt" 2>&1 || { tail -20 "$OUT/ncu${tag}_run.txt"; return 1; }
  tail -3 "$OUT/ncu${tag}_run.txt"
  "$ncu" --import "$OUT/prof$tag.ncu-rep" --page details > "$OUT/ncu${tag}_details.txt" 2>&1
  "$ncu" --import "$OUT/prof$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu${tag}_source.csv" 2>&1
  wc -l "$OUT/ncu${tag}_source.csv"
  grep -E "Issue Slot|Eligible|Active Warps|No Eligible|SM Busy|Compute \(SM\)|Duration" "$OUT/ncu${tag}_details.txt" | head -12
}

step_profile() { (cpp_env; ncu_profile "" 0 "$KERNEL_BENCH" 32768 7 1 1 4); }

# The second attention kernel launch of scripts/device/cross_call.py (the installed package; attention_fp8, or
# the one-call attention() with CROSS_CALL_ARGS=--complete).
step_profile_cross() {
  step_install || return 1
  # shellcheck disable=SC2086 (word splitting of the arguments is meant)
  (cd /tmp && ncu_profile _cross 1 "$PY" "$REPO/scripts/device/cross_call.py" ${CROSS_CALL_ARGS:-})
}

# ---- Python steps (the installed package; run from /tmp so that the source tree is not imported) -----------

step_pytest() {
  step_install || return 1
  local args=() a
  eval "set -- ${PYTEST_ARGS:-tests/python}"   # keeps quoted words, e.g. -k "not integrations"
  for a in "$@"; do
    case $a in -*) args+=("$a") ;; *) if [ -e "$REPO/${a%%::*}" ]; then args+=("$REPO/$a"); else args+=("$a"); fi ;; esac
  done
  (cd /tmp && timeout 540 "$PY" -m pytest -q -rs -p no:cacheprovider "${args[@]}" > "$OUT/pytest.log" 2>&1)
  local rc=$?
  grep -E "passed|failed|FAILED|^E  |Error" "$OUT/pytest.log" | tail -25
  return $rc
}

step_smoke() {
  step_install || return 1
  (cd /tmp && timeout 120 open-vc-attn-check --smoke 2>&1 | tee "$OUT/smoke.log" | tail -15; exit "${PIPESTATUS[0]}")
}

step_bench() {  # step_bench PRESET
  step_install || return 1
  local name=$1 opts
  case $name in
    video) opts="--preset video --time-budget-s 330" ;;
    wan480) opts="--preset wan480 --backends open-vc,sdpa-cudnn --rounds 6 --no-ceilings --time-budget-s 60" ;;
    sweep) opts="--preset sweep --backends open-vc,sdpa-cudnn --rounds 4 --time-budget-s 80" ;;
    video-kernel) opts="--preset video --heads ${HEADS:-7,14,56} --backends open-vc,sdpa-cudnn --accuracy-rows 4096 --rounds 8" ;;
    video-repair-vc) opts="--preset video --heads 7,14 --backends open-vc,open-vc-repair,vc,sdpa-cudnn \
                           --repair-budgets 0,0.005 --accuracy-rows 4096 --rounds 8" ;;
    *) opts="--preset $name" ;;
  esac
  local json=$OUT/bench-$name.json
  (cd /tmp && timeout 540 open-vc-attn-bench $opts ${GIT_COMMIT:+--git-commit "$GIT_COMMIT"} ${BENCH_ARGS:-} \
     --out "$json" > "$OUT/bench-$name.log" 2>&1)
  local rc=$?
  grep -E "TF|ceilings|record" "$OUT/bench-$name.log" | tail -30
  [ -f "$json" ] && (cd /tmp && open-vc-attn-report "$json" --out-dir "$OUT/report-$name" 2>&1 | tail -3)
  return $rc
}

step_repair_eval() {
  step_install || return 1
  (cd /tmp && timeout 300 "$PY" "$REPO/scripts/device/repair_selection_eval.py" "$OUT/repair_eval.json" \
     > "$OUT/repair-eval.log" 2>&1; r=$?; tail -25 "$OUT/repair-eval.log"; exit $r)
}

step_vc_cost() {
  step_install || return 1
  (cd /tmp && timeout 120 "$PY" - <<'PY' 2>&1 | tee "$OUT/vc-cost.log"; exit "${PIPESTATUS[0]}")
import json, os, torch
from open_vc_attn import baselines
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 73397, 56, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
r = baselines.benchmark_vc(q, k, v, iters=5)
print("VC stages at S=73397 H=56 (random normal):", json.dumps(r))
json.dump(r, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "vc_cost.json"), "w"))
PY
}

# The carried framework wheels (.whl/*.whl) into /tmp/site, which the integration steps put on PYTHONPATH.
site_wheels() {  # site_wheels STEP
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl/*.whl >> "$OUT/$1.log" 2>&1 || { echo "$1: carry .whl/"; tail -20 "$OUT/$1.log"; return 1; }
}

step_integrations() {
  step_install || return 1
  local rc=0
  site_wheels integrations || return 1
  (export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
   cd /tmp && "$PY" -c "import open_vc_attn, diffusers, torch; print('open_vc_attn', open_vc_attn.__file__,
'| diffusers', diffusers.__version__, '| torch', torch.__version__)" 2>&1 | tee -a "$OUT/integrations.log"
   cd /tmp && timeout 400 "$PY" -m pytest -q -rs -s -p no:cacheprovider "$REPO/tests/python/test_integrations_policy.py" \
     "$REPO/tests/python/test_integrations_diffusers.py" "$REPO/tests/python/test_integrations_sglang.py" \
     "$REPO/tests/python/test_integrations_yunchang.py" "$REPO/tests/python/test_integrations_diffusers_cp.py" \
     "$REPO/tests/python/test_integrations_diffusers_masks.py" >> "$OUT/integrations.log" 2>&1 || rc=1
   grep -E "passed|failed|SKIPPED|FAILED|Error|sglang attention backends|Wan random" "$OUT/integrations.log" | tail -20
   cd "$REPO"
   for ex in "diffusers_wan.py --frames 11 --json $OUT/diffusers_wan_17k.json" \
             "diffusers_wan.py --frames 21 --require-speedup --json $OUT/diffusers_wan_33k.json" \
             "sglang_backend.py --json $OUT/sglang_backend.json" "policy_crossover.py --json $OUT/policy_crossover.json"; do
     echo "== $ex" >> "$OUT/examples.log"
     timeout 150 "$PY" examples/$ex >> "$OUT/examples.log" 2>&1 || { echo "FAILED: $ex"; rc=1; }
   done
   grep -vE "^\s*$" "$OUT/examples.log" | tail -32
   exit $rc)
}

step_diffusers_e2e() {
  step_install || return 1
  site_wheels diffusers-e2e || return 1
  (export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
   cd /tmp && timeout 560 "$PY" "$REPO/scripts/device/diffusers_e2e.py" --json "$OUT/diffusers_e2e.json" \
     ${DIFFUSERS_E2E_ARGS:-} >> "$OUT/diffusers-e2e.log" 2>&1
   r=$?; grep -vE "^\s*$" "$OUT/diffusers-e2e.log" | tail -40; exit $r)
}

step_dispatch_floor() {
  step_install || return 1
  (cd /tmp && timeout 300 "$PY" "$REPO/scripts/device/dispatch_floor.py" --out "$OUT/dispatch_floor.json" \
     ${FLOOR_ARGS:-} > "$OUT/dispatch-floor.log" 2>&1; r=$?; grep -vE "^\s*$" "$OUT/dispatch-floor.log" | tail -120; exit $r)
}

step_host_breakdown() {
  step_install || return 1
  (cd /tmp && timeout 120 "$PY" "$REPO/scripts/device/host_breakdown.py" 2>&1 | grep -v Warn | tee "$OUT/host-breakdown.log";
   exit "${PIPESTATUS[0]}")
}

step_ulysses() {
  step_install || return 1
  local n
  n=$(nvidia-smi -L | wc -l)
  (cd /tmp && timeout 540 "$PY" -m torch.distributed.run --nproc_per_node="$n" "$REPO/scripts/device/ulysses_multi_gpu.py" \
     --heads 56 --iters 5 --json "$OUT/ulysses.json" 2>&1 | tee "$OUT/ulysses.log" | grep "\[ulysses\]"; exit "${PIPESTATUS[0]}")
}

# ---- same-run peers from the carried .anchors (never committed) ------------------------------------------------

ANCHOR_W=/tmp/w
ANCHORS_STARTED=

anchor_running() { [ -f "$ANCHOR_W/$1.pid" ] && kill -0 "$(cat "$ANCHOR_W/$1.pid")" 2>/dev/null; }

# The peers are built by the carried, git-ignored .anchors/build.sh (made on the CPU machine as
# shared/tools/fa3-anchor.md and sage2-anchor.md say; nothing that builds them is committed): it unpacks
# under /tmp/w, starts both builds in the background (pid and exit code in /tmp/w/NAME.pid, NAME.rc for
# NAME fa3 and sage2) and returns.
step_anchors() {
  [ -f "$REPO/.anchors/build.sh" ] || { echo "anchors: carry .anchors (with its build.sh) to measure the peers"; return 1; }
  OUT=$OUT PYTHON=$PY bash "$REPO/.anchors/build.sh" || return 1
  export PYTHONPATH=$ANCHOR_W/fa/hopper:$ANCHOR_W/sage${PYTHONPATH:+:$PYTHONPATH}
  ANCHORS_STARTED=1
}

anchors_wait() {  # anchors_wait STEP: waits for the builds (at most $ANCHOR_WAIT_S s), then says which peers import
  [ -n "$ANCHORS_STARTED" ] || { echo "$1: no anchors step before this one: peers only if already importable"; }
  local waited=0 limit=${ANCHOR_WAIT_S:-420} n
  if [ -n "$ANCHORS_STARTED" ]; then
    while { anchor_running fa3 || anchor_running sage2; } && [ $waited -lt "$limit" ]; do sleep 5; waited=$((waited + 5)); done
    for n in fa3 sage2; do
      if [ -f "$ANCHOR_W/$n.rc" ]; then echo "$1: $n build rc=$(cat "$ANCHOR_W/$n.rc") (waited ${waited} s)"
        [ "$(cat "$ANCHOR_W/$n.rc")" = 0 ] || tail -5 "$OUT/anchor-$n.log"
      else echo "$1: $n still building after ${waited} s (log $OUT/anchor-$n.log): measured without it"; fi
    done
  fi
  (cd /tmp && "$PY" - <<'PY'
import importlib
for mod, attr, name in (("flash_attn_interface", "flash_attn_func", "FA3 (fa3-fp8, fa3-bf16)"),
                        ("sageattention", "sageattn", "SageAttention2 (sage2)")):
    try:
        getattr(importlib.import_module(mod), attr)
        print(f"peers: {name}: available")
    except Exception as exc:
        print(f"peers: {name}: NOT available ({type(exc).__name__}: {str(exc)[:160]})")
PY
  )
}

# bench.modes for one case name after the anchors' peers: modes_with_peers CASE TIMEOUT_S TAIL_LINES
modes_with_peers() {
  step_install || return 1
  anchors_wait "modes-$1" | tee -a "$OUT/modes-$1.log"
  (cd /tmp && timeout "$2" "$PY" -m open_vc_attn.bench.modes --cases "$1" --rounds "${MODES_ROUNDS:-7}" \
     --out "$OUT/modes-$1.json" >> "$OUT/modes-$1.log" 2>&1; r=$?; grep -vE "^\s*$" "$OUT/modes-$1.log" | tail -"$3"; exit $r)
}
step_modes_int8() { modes_with_peers int8 540 40; }
step_modes_kvcache() { modes_with_peers kvcache 300 20; }
step_modes_cross() { modes_with_peers cross 300 20; }
step_modes_short() { modes_with_peers short 420 50; }
step_modes_gqa() { modes_with_peers gqa 300 30; }

step_modes_sparse() {
  step_install || return 1
  (cd /tmp && timeout "${MODES_SPARSE_TIMEOUT:-420}" "$PY" -m open_vc_attn.bench.modes --cases sparse \
     --rounds "${MODES_ROUNDS:-7}" --out "$OUT/modes-sparse.json" >> "$OUT/modes-sparse.log" 2>&1; r=$?
   grep -vE "^\s*$" "$OUT/modes-sparse.log" | tail -30; exit $r)
}

step_qk_tradeoff() {
  step_install || return 1
  anchors_wait qk-tradeoff | tee -a "$OUT/qk-tradeoff.log"
  (cd /tmp && timeout 540 "$PY" -m open_vc_attn.bench.qk_tradeoff --out "$OUT/qk_tradeoff.json" ${QK_TRADEOFF_ARGS:-} \
     >> "$OUT/qk-tradeoff.log" 2>&1; r=$?; grep -vE "^\s*$" "$OUT/qk-tradeoff.log" | tail -45; exit $r)
}

step_wan_formats() {
  step_install || return 1
  site_wheels wan-formats || return 1
  anchors_wait wan-formats | tee -a "$OUT/wan-formats.log"
  # the anchors' SageAttention2 also when built by an earlier call on this machine (no anchors step now)
  (export PYTHONPATH=/tmp/site:$ANCHOR_W/sage${PYTHONPATH:+:$PYTHONPATH}
   cd /tmp && timeout 540 "$PY" "$REPO/scripts/device/wan_formats.py" --json "$OUT/wan_formats.json" \
     ${WAN_FORMATS_ARGS:-} >> "$OUT/wan-formats.log" 2>&1
   r=$?; grep -vE "^\s*$" "$OUT/wan-formats.log" | grep -v "^wan_formats: {" | tail -40; exit $r)
}

# ---- driver -------------------------------------------------------------------------------------------------

[ $# -gt 0 ] && [ "$1" != help ] || { sed -n '2,/^set -u/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0; }
STEPS=()
while [ $# -gt 0 ]; do   # bench takes its preset as the next word
  if [ "$1" = bench ]; then STEPS+=("bench:${2:?bench needs a PRESET}"); shift 2; else STEPS+=("$1"); shift; fi
done
PY_STEPS=" install pytest smoke repair-eval vc-cost integrations diffusers-e2e dispatch-floor host-breakdown ulysses \
modes-int8 modes-kvcache modes-cross modes-short modes-gqa modes-sparse qk-tradeoff wan-formats profile-cross "
CPP_STEPS=" cpp-tests sanitizer sass kernel-bench prev variants profile "
OTHER_STEPS=" anchors "
for s in "${STEPS[@]}"; do
  case "$PY_STEPS$CPP_STEPS$OTHER_STEPS" in *" $s "*) ;; *) [[ $s == bench:* ]] ||
    { echo "check.sh: unknown step '$s' (bash scripts/device/check.sh help)"; exit 2; } ;; esac
done
for s in "${STEPS[@]}"; do   # a Python step ahead: the wheel builds while the C++ steps run
  if [[ $PY_STEPS == *" $s "* || $s == bench:* ]]; then wheel_start; break; fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader \
  | tee "$OUT/gpu.txt"
FAILED=()
for s in "${STEPS[@]}"; do
  echo "==== $s"
  case $s in
    bench:*) step_bench "${s#bench:}" ;;
    *) "step_${s//-/_}" ;;
  esac || FAILED+=("$s")
done
[ -n "$WHEEL_PID" ] && wait "$WHEEL_PID"
if [ ${#FAILED[@]} -gt 0 ]; then echo "check.sh: FAILED steps: ${FAILED[*]}"; exit 1; fi
echo "check.sh: all steps passed (${STEPS[*]})"

#!/bin/bash
# Thirtieth session, call B: issue 25's speed lines with the V bias correction: bench.modes --cases int8 (E4M3, INT8,
# INT8 + smoothing, + exp2 P, + exp2 P + V bias correction; SageAttention2 eager, FA3 FP8 / BF16 and cuDNN BF16 in
# the same process, interleaved rounds). Carry: .carry/v30, .anchors (with sage2-so.tar.gz from call A: no rebuild).
cd "$(dirname "$0")/../../.."
W=$(ls $PWD/.carry/v30/open_vc_attn-*.whl | head -1)
OPENVC_WHEEL=$W MODES_ROUNDS=${MODES_ROUNDS:-4} ANCHOR_WAIT_S=240 timeout 590 bash scripts/device/check.sh install anchors modes-int8 \
  > $OUT/check_modes_int8.log 2>&1
echo "rc $?"; grep -vE "^\s*$" $OUT/check_modes_int8.log | tail -30

#!/bin/bash
# Twenty-first session, call C: this tree's package built on the device; issue 28's short shapes against FA3 and cuDNN
# BF16 in the same process (5 rounds), then the dense shapes (3 rounds), the SM clock and power sampled.
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 200 > $OUT/smi_samples.csv 2>&1 &
SMI=$!
ANCHORS_ONLY=fa3 MODES_ROUNDS=5 bash scripts/device/check.sh install anchors modes-short
export PYTHONPATH=/tmp/w/fa/hopper${PYTHONPATH:+:$PYTHONPATH}
(cd /tmp && timeout 240 python3 -m open_vc_attn.bench.modes --cases dense --rounds 3 --out $OUT/modes-dense.json > $OUT/modes-dense.log 2>&1; echo "dense rc=$?")
kill $SMI
grep -vE "^\s*$" $OUT/modes-dense.log | tail -25

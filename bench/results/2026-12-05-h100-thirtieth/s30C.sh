#!/bin/bash
# Thirtieth session, call C: what the correction costs as its own mode (time_v_bias.py: paired complete calls and the
# per-kernel profile), then issue 25's end-to-end line with it: diffusers' Wan transformer (1.3B 480p, 14B widths
# 720p, QK-norm weights x3) on native SDPA, openvc's formats (DispatchPolicy(..., v_bias_correction=True) among them)
# and SageAttention2 for the same calls (scripts/device/wan_formats.py). Carry: .carry/v30 (wheel with the policy),
# .anchors (SageAttention2 rebuilt here), .whl (diffusers 0.42.1). The SageAttention2 .so files come back in two
# parts for later calls.
cd "$(dirname "$0")/../../.."
REPO=$PWD
W=$(ls $PWD/.carry/v30/open_vc_attn-*.whl | head -1)
OUT=$OUT PYTHON=python3 bash .anchors/build.sh
OPENVC_WHEEL=$W bash scripts/device/check.sh install > $OUT/check_install.log 2>&1; tail -1 $OUT/check_install.log
(cd /tmp && PYTHONUNBUFFERED=1 timeout 200 python3 $REPO/bench/results/2026-12-05-h100-thirtieth/time_v_bias.py > $OUT/time_v_bias.log 2>&1)
grep -v Warn $OUT/time_v_bias.log | cut -c1-400
for i in $(seq 1 60); do [ -f /tmp/w/sage2.rc ] && break; sleep 5; done
echo "sage2 rc $(cat /tmp/w/sage2.rc 2>/dev/null)"
OPENVC_SKIP_INSTALL=1 WAN_FORMATS_ARGS="--runs 5" timeout 330 bash scripts/device/check.sh wan-formats > $OUT/check_wan.log 2>&1
echo "wan rc $?"; grep -v "^wan_formats: {" $OUT/check_wan.log | tail -25
(cd /tmp/w/sage && tar -cf - $(find sageattention -name '*.so') | gzip -1 | split -b 15M - $OUT/sage2-so.tgz.part-) ; ls -la $OUT

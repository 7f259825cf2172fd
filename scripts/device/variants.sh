#!/usr/bin/env bash
# Stage-breakdown and candidate timing of the sm_90a kernel (built with -DOPENVC_BENCH_VARIANTS=ON), on
# the device: every variant once per round, interleaved, paired against production in the same round.
set -u
B=${1:-build/dev}
ROUNDS=${2:-7}
export LD_LIBRARY_PATH=$PWD/$B/src:${LD_LIBRARY_PATH:-}
for args in "73397 7" "73397 14" "73397 56"; do
  timeout 240 "$B/openvc_bench_attention" $args 1 "$ROUNDS" 4 variants
done

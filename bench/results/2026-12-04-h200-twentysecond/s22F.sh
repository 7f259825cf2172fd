#!/bin/bash
# Twenty-second session, call F: the bench-only probes of the plain kernel (prepared Q), paired medians of 9, at the
# whole-wave shapes of call A: does ping-pong ordering (the warpgroups out of phase) pay at 16-64 key blocks a tile?
cd "$(dirname "$0")/.."
mkdir -p /tmp/G /tmp/bin
gunzip -c .carry/libopenvc_G.so.gz > /tmp/G/libopenvc.so
gunzip -c .carry/openvc_bench_attention_G.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
export LD_LIBRARY_PATH=/tmp/G
for a in "2048 66 1 9 4" "4096 33 1 9 4" "8192 33 1 9 4" "4096 7 1 9 4"; do
  echo "== $a"; timeout 120 /tmp/bin/openvc_bench_attention $a variants
done > $OUT/variants_callF.log 2>&1
grep -E "^==|^S=|ping-pong|few-keys" $OUT/variants_callF.log

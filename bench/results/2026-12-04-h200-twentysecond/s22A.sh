#!/bin/bash
# Twenty-second session, call A: how much of a short call's kernel time is the last wave's idle SMs and the per-tile
# boundary. Kernel time per wave against key blocks per tile at head counts that fill whole waves (H = 33 / 66: 8-32
# waves of 132 tiles) and at H = 7 / 8 (partial last waves). Library and bench tool of call E (twenty-first session).
cd "$(dirname "$0")/.."
mkdir -p /tmp/E /tmp/bin
gunzip -c .carry/libopenvc_E.so.gz > /tmp/E/libopenvc.so
gunzip -c .carry/openvc_bench_attention_E.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 100 > $OUT/smi.csv &
SMI=$!
{
for r in 1 2; do
  for a in "2048 66" "2048 7" "4096 33" "4096 7" "4096 8" "8192 33" "8192 7" "16384 33" "16384 7"; do
    echo -n "[$r] "; LD_LIBRARY_PATH=/tmp/E timeout 60 /tmp/bin/openvc_bench_attention $a 1 7 4 | grep -E "^S="
  done
done
} > $OUT/waves.log 2>&1
kill $SMI
cat $OUT/waves.log

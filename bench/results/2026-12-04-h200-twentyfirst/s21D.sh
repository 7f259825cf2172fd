#!/bin/bash
# Twenty-first session, call D: the early Q tile (library B) against library A at the longer batched shapes, the one call
# paired against the step-wise call, A and B alternating in separate processes.
cd "$(dirname "$0")/.."
mkdir -p /tmp/A /tmp/B /tmp/bin
gunzip -c .carry/libopenvc_A.so.gz > /tmp/A/libopenvc.so
gunzip -c .carry/libopenvc_B.so.gz > /tmp/B/libopenvc.so
gunzip -c .carry/openvc_bench_attention.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
B=/tmp/bin/openvc_bench_attention
{
for i in 1 2 3; do
  for lib in A B; do
    for a in "32760 12 2 9 4 onecall" "32760 40 1 9 4 onecall" "73397 14 1 7 4 onecall"; do
      echo -n "[$lib $i] "; LD_LIBRARY_PATH=/tmp/$lib timeout 90 $B $a | grep -E "^onecall"; done
  done
done
} > $OUT/onecall_AB_long.log 2>&1
cat $OUT/onecall_AB_long.log

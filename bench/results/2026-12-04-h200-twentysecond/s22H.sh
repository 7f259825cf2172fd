#!/bin/bash
# Twenty-second session, call H: the final library K (the few-keys mode up to 32 key blocks with Q quantized in the
# kernel, 6 on prepared Q): every C++ GPU test, then the one call against the step-wise call at 16 and 32 key blocks.
cd "$(dirname "$0")/.."
mkdir -p /tmp/K /tmp/bin
gunzip -c .carry/libopenvc_K.so.gz > /tmp/K/libopenvc.so
gunzip -c .carry/openvc_bench_attention_K.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
gunzip -c .carry/openvc_gpu_tests_K.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
export LD_LIBRARY_PATH=/tmp/K
timeout 200 /tmp/bin/openvc_gpu_tests 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > $OUT/tests_K.log; echo "tests rc ${PIPESTATUS[0]}" >> $OUT/tests_K.log
tail -4 $OUT/tests_K.log
for a in "2048 66 1 9 4 onecall" "4096 7 1 9 4 onecall"; do timeout 60 /tmp/bin/openvc_bench_attention $a | grep -E "^onecall"; done > $OUT/onecall_K.log 2>&1
cat $OUT/onecall_K.log

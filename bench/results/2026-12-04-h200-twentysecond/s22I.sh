#!/bin/bash
# Twenty-second session, call I: the review's test cases (the plain fused-Q mode above 32 key blocks in the grid test,
# the 4,096 / 4,200-key pair in Sm90FusedQ.SameBitsAsPreparedQ) on the final library K.
cd "$(dirname "$0")/.."
mkdir -p /tmp/K /tmp/bin
gunzip -c .carry/libopenvc_K.so.gz > /tmp/K/libopenvc.so
gunzip -c .carry/openvc_gpu_tests_K.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
LD_LIBRARY_PATH=/tmp/K timeout 150 /tmp/bin/openvc_gpu_tests --gtest_filter='Sm90Grid.*:Sm90FusedQ.*:Sm90Attention.KeyBlockCounts*:AttentionCall.*' > $OUT/tests_K_callI.log 2>&1; echo "rc $?" >> $OUT/tests_K_callI.log
grep -E "OK \]|FAILED|PASSED|rc " $OUT/tests_K_callI.log

#!/bin/bash
# Twenty-second session, call C: where a tile's fixed cost goes. Nsight Compute source counters of the fused-Q and the
# prepared-Q kernel at S = 2,048 H = 66 (16 key blocks a tile, 8 tiles per CTA) and S = 16,384 H = 33 (128 blocks, 32
# tiles per CTA); the library of HEAD (G); the grid test on it first.
cd "$(dirname "$0")/.."
mkdir -p /tmp/G /tmp/bin
gunzip -c .carry/libopenvc_G.so.gz > /tmp/G/libopenvc.so
gunzip -c .carry/openvc_bench_attention_G.gz > /tmp/bin/openvc_bench_attention; chmod +x /tmp/bin/openvc_bench_attention
gunzip -c .carry/openvc_gpu_tests_G.gz > /tmp/bin/openvc_gpu_tests; chmod +x /tmp/bin/openvc_gpu_tests
export LD_LIBRARY_PATH=/tmp/G
timeout 120 /tmp/bin/openvc_gpu_tests --gtest_filter='Sm90Grid.*' 2>&1 | tail -3
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
B=/tmp/bin/openvc_bench_attention
prof() {  # tag skip args...
  local tag=$1 skip=$2; shift 2
  timeout 240 "$ncu" --clock-control none -k regex:expcast_attention --launch-skip "$skip" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight -o "$OUT/prof_$tag" -f "$B" "$@" > "$OUT/ncu_${tag}_run.txt" 2>&1 || { tail -5 "$OUT/ncu_${tag}_run.txt"; return 1; }
  "$ncu" --import "$OUT/prof_$tag.ncu-rep" --page details > "$OUT/ncu_${tag}_details.txt" 2>&1
  "$ncu" --import "$OUT/prof_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${tag}_source.csv" 2>&1
  rm -f "$OUT/prof_$tag.ncu-rep"
  echo "$tag: $(grep -E 'Duration' "$OUT/ncu_${tag}_details.txt" | head -1)"
}
prof prep2048 0 2048 66 1 1 4
prof fused2048 1 2048 66 1 1 4
prof prep16384 0 16384 33 1 1 4
prof fused16384 1 16384 33 1 1 4
ls -la $OUT

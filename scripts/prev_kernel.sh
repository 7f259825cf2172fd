#!/usr/bin/env bash
# Extracts the sm_90a kernel of an earlier commit into DIR/attention/sm90prev/ (namespace
# openvc::sm90prev), so that the timing tool can run it in the same process as the current kernel:
#   bash scripts/prev_kernel.sh b11cc4a build/prev_kernel
#   cmake ... -DOPENVC_BENCH_VARIANTS=ON -DOPENVC_BENCH_PREV_KERNEL=$PWD/build/prev_kernel
# It adds the variant "previous kernel (REF)" to `openvc_bench_attention ... variants`. Only the plain
# production instantiation of that kernel is launched; nothing of it is installed.
set -euo pipefail
REF=${1:?git ref of the previous kernel}
DIR=${2:?output directory}
cd "$(dirname "$0")/.."
rm -rf "$DIR/attention/sm90prev"
mkdir -p "$DIR/attention/sm90prev"
for f in $(git ls-tree --name-only "$REF" src/attention/sm90/); do
  case "$f" in *.cuh|*.h) ;; *) continue ;; esac
  git show "$REF:$f" | sed -e 's@attention/sm90/@attention/sm90prev/@g' -e 's@openvc::sm90\b@openvc::sm90prev@g' \
    -e 's@namespace openvc::sm90 {@namespace openvc::sm90prev {@' > "$DIR/attention/sm90prev/$(basename "$f")"
done
echo "$REF" > "$DIR/attention/sm90prev/REF"
ls "$DIR/attention/sm90prev"

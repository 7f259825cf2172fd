#!/bin/bash
# Call B: few-keys mode forms: fk = ping-pong + flush every tile; fkp4 = fk + the next tile first QK^T under the last PV;
# fkp5 = ping-pong + carried QK^T with the plain flush period (bit-identical to plain; spills). Tests + sanitizers of fkp5,
# the probe sweep per key count, then bench.modes cross,short main (old) / fk / fkp4 / fkp5 alternating.
# pp = ping-pong only (the branch to merge): tests and sanitizers run on pp.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
REPO_DIR=$PWD; R=$OUT; export OUT=/tmp/oB; mkdir -p $OUT; S=$R/summary.log
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >> $S
python3 -m pip install -q --no-deps --no-compile --target /tmp/pkg_old .carry/wheel/*.whl || exit 1
for v in fk fkp4 fkp5 pp; do cp -r /tmp/pkg_old /tmp/pkg_$v; gunzip -c .carry/bin/libopenvc-$v.so.gz > /tmp/pkg_$v/open_vc_attn/libopenvc.so; done
ANCHORS_SAGE=0 OUT=$OUT PYTHON=python3 bash .anchors/build.sh >> $S 2>&1
mkdir -p build/dev/src build/dev/tests/cpp
gunzip -c .carry/bin/openvc_gpu_tests.gz > build/dev/tests/cpp/openvc_gpu_tests; chmod +x build/dev/tests/cpp/openvc_gpu_tests
gunzip -c .carry/bin/openvc_bench_attention.gz > build/dev/openvc_bench_attention; chmod +x build/dev/openvc_bench_attention
cp /tmp/pkg_pp/open_vc_attn/libopenvc.so build/dev/src/libopenvc.so
OUT=$OUT timeout 120 bash scripts/device/check.sh cpp-tests >> $S 2>&1; echo "pp cpp-tests done at $(el) s" >> $S
grep -E "FAILED|PASSED" $OUT/cpp-tests.log | head -20 >> $S; cp $OUT/cpp-tests.log $R/cpp-tests-pp.log
export LD_LIBRARY_PATH=$PWD/build/dev/src
F='Sm90Attention.KeyBlockCountsAroundTheFlushPeriod:Sm90Attention.ManyTilesOfFewKeyBlocks:Sm90FusedQ.SameBitsAsPreparedQ'
(timeout 100 compute-sanitizer --tool racecheck build/dev/tests/cpp/openvc_gpu_tests --gtest_filter='Sm90Attention.KeyBlockCountsAroundTheFlushPeriod:Sm90FusedQ.SameBitsAsPreparedQ' > $OUT/racecheck.log 2>&1; \
  echo "racecheck rc=$? at $(el) s"; tail -3 $OUT/racecheck.log) >> $S 2>&1
(timeout 60 compute-sanitizer --tool memcheck build/dev/tests/cpp/openvc_gpu_tests \
  --gtest_filter='Sm90Attention.KeyBlockCountsAroundTheFlushPeriod:Sm90FusedQ.SameBitsAsPreparedQ' > $OUT/memcheck.log 2>&1; \
  echo "memcheck rc=$? at $(el) s"; tail -3 $OUT/memcheck.log) >> $S 2>&1
(timeout 60 compute-sanitizer --tool synccheck build/dev/tests/cpp/openvc_gpu_tests --gtest_filter=$F > $OUT/synccheck.log 2>&1; \
  echo "synccheck rc=$? at $(el) s"; tail -2 $OUT/synccheck.log) >> $S 2>&1
for SK in 256 512 1024 1152 2048 4096; do
  [ $(el) -lt 260 ] || break
  echo "== SK=$SK" >> $R/variants.log
  OPENVC_BENCH_SK=$SK timeout 40 build/dev/openvc_bench_attention 32760 40 1 5 4 variants >> $R/variants.log 2>&1; echo "SK $SK rc=$? at $(el) s" >> $S
done
unset LD_LIBRARY_PATH
cd /tmp
for i in 1 2; do for v in old pp fk fkp4 fkp5; do
  [ $(el) -lt 540 ] || break 2
  PYTHONPATH=/tmp/pkg_$v:/tmp/w/fa/hopper timeout 60 python3 -m open_vc_attn.bench.modes --cases cross,short \
    --rounds 5 --out $R/B-modes-$i-$v.json > $OUT/B-$i-$v.log 2>&1; echo "B $i $v rc=$? at $(el) s" >> $S
done; done
cd $REPO_DIR
[ $(el) -lt 500 ] && (PYTHONPATH=/tmp/pkg_pp timeout 80 python3 -m pytest -q -x tests/python/test_gpu_fast_modes.py tests/python/test_gpu_block_sparse.py \
  -p no:cacheprovider > $R/pytest-pp.log 2>&1; echo "pytest pp rc=$? at $(el) s"; tail -2 $R/pytest-pp.log) >> $S 2>&1
grep -E "==|variant (plain mode|few-keys|ping-pong \+ fp32|ping-pong ordering|fp32 accumulate every tile)" $R/variants.log
cat $S

#!/bin/bash
# Issue 25: the filtered sampler's mass-sweep block at 32 rows. ptxas spills at the default 8192 and none at 4096 / 2048
# (lab/probes/triton_offline.py, docs/decisions.md); this measures it on the GPU: main at blocks 8192 / 4096 / 2048, and
# the compacted top-k (.ab/a: main + lab/patches/topk_compact_candidates.diff) at 8192 / 2048, alternated twice, then
# the kernel against the XLA loops. One device call (carry .whl and .ab):
#   mkdir -p .ab/a && git archive HEAD jphoton pallas_kernels lab | tar -x -C .ab/a
#   (cd .ab/a && patch -p1 < ../../lab/patches/topk_compact_candidates.diff)
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 lab/probes/filtered_sample_check.py 2 > /tmp/chk.txt 2>&1
echo "kernel == XLA loops: $(grep -c ' ok' /tmp/chk.txt) ok, $(grep mismatches /tmp/chk.txt)"
for round in 1 2; do
  for b in 8192 4096 2048; do
    echo "== main block $b"; PYTHONPATH=$PWD:/tmp/site timeout 100 python3 lab/probes/compact_cost.py --rows 32 --block $b \
      --settings 50,1.0 50,0.9 0,0.9 2>&1 | grep -v Warn
  done
  for b in 8192 2048; do
    echo "== compaction block $b"; (cd .ab/a && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 lab/probes/compact_cost.py \
      --rows 32 --block $b --caps 16384 --settings 50,1.0 50,0.9 0,0.9 2>&1 | grep -v Warn)
  done
done
# rows 1 / 8 / 16 (8 and 16 spill offline at 8192 too), once
for b in 8192 4096 2048; do
  echo "== main block $b, rows 1 8 16"; PYTHONPATH=$PWD:/tmp/site timeout 100 python3 lab/probes/compact_cost.py \
    --rows 1 8 16 --block $b --settings 50,1.0 0,0.9 2>&1 | grep -v Warn
done

#!/bin/bash
# Issue 25: top-k sweeps over a compacted candidate set. The filtered sampler of a tree under .ab/old vs this tree,
# device us per call at [1|32, 128256] (lab/probes/topp_cost.py, flat and peaked rows), alternated, then the kernel
# against the XLA loops on the GPU. One device call, with lab/patches/topk_compact_candidates.diff applied here:
#   mkdir -p .ab/old && git archive <commit> jphoton pallas_kernels lab | tar -x -C .ab/old
#   bash lab/issue25_compact_ab.sh   (carry .whl and .ab)
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache OUT=${OUT:-/tmp}
ONLY=${ONLY:-"plain sample_top_k sample_top_p sample_top_k_p"}
PYTHONPATH=$PWD:/tmp/site timeout 240 python3 lab/probes/filtered_sample_check.py 1 2 2>&1 | grep -v Warning | tail -8
for round in 1 2; do
  for t in old new; do
    root=$PWD; [ $t = old ] && root=$PWD/.ab/old
    echo "== $t round $round"
    PYTHONPATH=$root:/tmp/site timeout 200 python3 "$root/lab/probes/topp_cost.py" --rows 1 32 --iters 100 \
      --scales 1 4 --only $ONLY --out "$OUT/topp_${t}_$round.json" 2>&1 | grep -v Warning
  done
done

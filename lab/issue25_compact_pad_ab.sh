#!/bin/bash
# Issue 25: the compacted top-k candidate set with masked loads of the copy (.ab/a: lab/patches/topk_compact_candidates.diff)
# vs padded, unmasked ones (this tree), and the main before both (.ab/old), top_k 50 (+ top_p 0.9) at [32, 128256].
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache
for t in new a; do root=$PWD; [ $t = a ] && root=$PWD/.ab/a
  echo "== $t"; (cd "$root" && PYTHONPATH=$root:/tmp/site timeout 120 python3 lab/probes/compact_cost.py --rows 32 \
    --caps 16384 1 --settings 50,1.0 50,0.9 2>&1 | grep -v Warn)
done
echo "== old"; (cd .ab/old && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 lab/probes/topp_cost.py --rows 32 --iters 100 \
  --only sample_top_k sample_top_k_p 2>&1 | grep -v Warn)

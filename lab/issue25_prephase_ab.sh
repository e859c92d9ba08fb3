#!/bin/bash
# Issue 25: the filtered sampler of a tree under .ab/old vs this tree, device us per call
# at [1|32, 128256] (lab/probes/topp_cost.py), then the kernel against the XLA loops on the GPU. One device call:
#   mkdir -p .ab/old && git archive <commit> jphoton pallas_kernels lab | tar -x -C .ab/old
#   bash lab/issue25_prephase_ab.sh   (carry .whl and .ab)
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache OUT=${OUT:-/tmp}
ONLY="plain prephase sample_top_k sample_top_p sample_top_k_p sample_one_top_p_row sample_top_p_0.5"
for round in 1 2; do
  for t in old new; do
    root=$PWD; [ $t = old ] && root=$PWD/.ab/old
    echo "== $t round $round"
    PYTHONPATH=$root:/tmp/site timeout 200 python3 "$root/lab/probes/topp_cost.py" --rows 1 32 --iters 100 \
      --only $ONLY --out "$OUT/topp_${t}_$round.json" 2>&1 | grep -v Warning
  done
done
PYTHONPATH=$PWD:/tmp/site timeout 200 python3 lab/probes/filtered_sample_check.py 1 2 2>&1 | grep -v Warning | tail -20

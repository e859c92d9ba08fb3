#!/bin/bash
# Issue 25: a sampler change (the working tree) against main (.ab/main: `git archive` of the commit
# before it), in one device call (carry .whl, .ab): the kernel alone at 1-32 rows, kernel == XLA loops, then the
# engine's decode step by sampling setting (benchmarks/sampling.py) for both trees.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 lab/probes/filtered_sample_check.py 2 > $OUT/check.txt 2>&1
echo "kernel == XLA loops: $(grep -c ' ok' $OUT/check.txt) ok, $(grep mismatches $OUT/check.txt)"
for tree in new main; do
  d=$([ $tree = new ] && echo . || echo .ab/main)
  echo "== $tree kernel"; (cd $d && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 lab/probes/compact_cost.py \
    --rows 1 8 16 32 --settings 50,1.0 50,0.9 0,0.9 1000,1.0 2>&1 | grep -v Warn)
done
for tree in new main; do
  d=$([ $tree = new ] && echo . || echo .ab/main)
  b=$([ $tree = new ] && echo "1 32" || echo 32)
  echo "== $tree engine"; (cd $d && PYTHONPATH=$PWD:/tmp/site timeout 240 python3 benchmarks/sampling.py \
    --model random:llama3.2-1b --batch $b --out $OUT/sampling_$tree.json 2>&1 | grep -v -i "warn\|absl" | tail -25)
done

#!/bin/bash
# Issue 25: benchmarks/constrained.py of trees under .ab/NAME and of this tree ("new"), in ORDER, one device call
# (carry .whl, .ab and benchmarks/assets; each .ab tree gets its own benchmarks/assets/smollm2-tokenizer):
#   mkdir -p .ab/old && git archive <commit> jphoton pallas_kernels server benchmarks lab | tar -x -C .ab/old
#   STREAMS="8 32" ORDER="old new" bash lab/issue25_fill_ab.sh
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache OUT=${OUT:-/tmp}
n=0
for t in ${ORDER:-old new}; do
  root=$PWD; [ "$t" != new ] && root=$PWD/.ab/$t
  n=$((n + 1)); echo "== $t $(date -u +%H:%M:%S)"
  mkdir -p "$OUT/$n-$t"
  (cd "$root" && PYTHONPATH=$root:/tmp/site timeout ${BOX:-280} python3 benchmarks/constrained.py \
    --model random:llama3.2-1b:vocab=49152 --tokenizer benchmarks/assets/smollm2-tokenizer \
    --streams ${STREAMS:-8 32} --requests-per-stream ${RPS:-3} --constraints ${CONSTRAINTS:-schema coords} --out "$OUT/$n-$t" 2>&1 \
    | grep -E "streams:|Error|error" | cut -c1-900)
done

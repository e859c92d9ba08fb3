#!/bin/bash
# Issue 25, one device call: (1) benchmarks/constrained.py with the default engine (device automata on by default),
# schema and coordinates at 8 and 32 streams; (2) 98dc4d0's own constrained benchmark (.ab/base) for its free row, in
# the same call; (3) lab/probes/prephase_variants.py; (4) benchmarks/sampling.py at B=32 in this tree and in .ab/full
# (the prephase before: `git archive` of the commit before).  Carry .whl, .ab, benchmarks/assets. SKIP="1 2" etc. skips parts.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
TOK=$PWD/benchmarks/assets/smollm2-tokenizer
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
if ! skip 1; then
  echo "== 1 main constrained"; PYTHONPATH=$PWD:/tmp/site timeout 200 python3 benchmarks/constrained.py \
    --model random:llama3.2-1b:vocab=49152 --tokenizer $TOK --streams 8 32 --constraints schema coords --paths device \
    --out $OUT 2>&1 | grep -v "compiling step\|Warn" | tail -14
fi
if ! skip 2; then
  echo "== 2 98dc4d0 constrained (free row)"; mkdir -p $OUT/base; (cd .ab/base && PYTHONPATH=$PWD:/tmp/site timeout 170 \
    python3 ../../lab/issue25_base_free.py --model random:llama3.2-1b:vocab=49152 --tokenizer $TOK --streams 8 32 \
    --out $OUT/base 2>&1 | grep -v "compiling\|Warn" | tail -6)
fi
if ! skip 3; then
  echo "== 3 prephase variants"; PYTHONPATH=$PWD:/tmp/site timeout 150 python3 lab/probes/prephase_variants.py \
    --rows ${ROWS:-1 32} --settings ${SETTINGS:-50,1.0 0,0.9 50,0.9} 2>&1 | grep -v -i "warn" | tail -20
fi
if ! skip 4; then
  for tree in ${TREES:-light full}; do
    d=$([ $tree = light ] && echo . || echo .ab/$tree)
    echo "== 4 sampling, $tree"; (cd $d && PYTHONPATH=$PWD:/tmp/site timeout 130 python3 benchmarks/sampling.py \
      --model random:llama3.2-1b --batch 32 --out $OUT/sampling_$tree.json 2>&1 | grep -v -i "warn\|absl" | tail -8)
  done
fi

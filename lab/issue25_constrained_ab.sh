#!/bin/bash
# Issue 25: a constrained-decoding change (the working tree) against the commit before it (.ab/main: `git archive` of
# it), benchmarks/constrained.py JSON schema at 8 and 32 streams, main / new / main / new (RUNS) in one device call (carry .whl, .ab, benchmarks/assets).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
TOK=$PWD/benchmarks/assets/smollm2-tokenizer
for run in ${RUNS:-main new main new}; do
  d=$([ $run = new ] && echo . || echo .ab/main)
  mkdir -p $OUT/$run$SECONDS
  echo "== $run"
  (cd $d && PYTHONPATH=$PWD:/tmp/site timeout ${RUN_TIMEOUT:-200} python3 benchmarks/constrained.py \
    --model random:llama3.2-1b:vocab=49152 --tokenizer $TOK --streams ${STREAMS:-8 32} --constraints schema \
    --out $OUT/$run$SECONDS 2>&1 | grep -v "compiling step\|INFO\|Warn" | tail -12)
done

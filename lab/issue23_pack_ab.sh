#!/bin/bash
# Issue 23: lab/probes/staggered_ticks.py (default engine, C=64) in `.ab/prev` (the commit before the churn-aware
# pack: `git archive`) and this tree, alternated (TREES), one device call; host phases per tick from the engine's
# telemetry. The trees compile the same programs: the second run loads them from the cache. Carry .whl and .ab.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
n=0
for tree in ${TREES:-prev new prev new}; do
  n=$((n + 1)); d=$([ $tree = new ] && echo . || echo .ab/$tree)
  echo "== $n $tree"; (cd $d && PYTHONPATH=$PWD:/tmp/site timeout ${RUN_TIMEOUT:-300} python3 lab/probes/staggered_ticks.py \
    --model random:llama3.2-1b --concurrency ${C:-64} --default-engine --out $OUT/ticks_${n}_$tree.json 2>&1 \
    | grep -v "compiling\|INFO\|Warn" | tail -2 | cut -c1-400)
done

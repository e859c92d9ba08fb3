#!/bin/bash
# Issue 23: step inputs written in place into a ring of pinned host buffers (this tree) against numpy inputs copied by
# each call (`.ab/prev`): greedy tokens of both (lab/probes/greedy_tokens.py, must be equal), then the engine alone's
# static and staggered ticks (lab/probes/staggered_ticks.py), trees alternated (RUNS). Carry .whl and .ab.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
OUT=${OUT:-/tmp/out}
cp -n lab/probes/greedy_tokens.py .ab/prev/lab/probes/ 2>/dev/null
for t in prev new; do
  if [ $t = prev ]; then R=$PWD/.ab/prev; else R=$PWD; fi
  (cd $R && JPHOTON_CACHE_DIR=/tmp/cache-$t PYTHONPATH=$R:/tmp/site timeout 200 python3 lab/probes/greedy_tokens.py \
    --concurrency ${GREEDY_C:-64} 2>&1 | grep -E '^\{|Error|error' | sed "s/^/$t tokens /" | cut -c1-300)
done
for c in ${RUNS:-64 64}; do
  for t in prev new; do
    if [ $t = prev ]; then R=$PWD/.ab/prev; else R=$PWD; fi
    echo "== $t C=$c"
    (cd $R && JPHOTON_CACHE_DIR=/tmp/cache-$t PYTHONUNBUFFERED=1 PYTHONPATH=$R:/tmp/site timeout ${RUN_TIMEOUT:-150} \
      python3 lab/probes/staggered_ticks.py --concurrency $c --out "$OUT/${t}_c${c}_$RANDOM.json" 2>&1 \
      | grep -E '^\{|Error' | grep -o 'Error.*\|"ratio[^{]*\|"static.decode": {[^}]*\|"staggered.decode": {[^}]*' \
      | cut -c1-200)
  done
done

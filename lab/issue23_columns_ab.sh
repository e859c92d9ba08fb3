#!/bin/bash
# Issue 23: decode rows as columns (StepPlan.decode = DecodeRows, sample flags per step) against `.ab/head`, one device
# call: the engine alone (lab/issue23_spin_ab.sh: staggered_ticks.py, RUNS concurrencies, trees alternated; RUNS=""
# skips it), then with SERVE=1 the served benchmark (benchmarks/serving.py, one frontend, C=32 64) in each tree of
# SERVE_TREES (CACHE: one compile cache for both, when the change is host-side only). Carry .whl and .ab.
RUNS=${RUNS-64 32 64 32} bash lab/issue23_spin_ab.sh
OUT=${OUT:-/tmp/out}
if [ -n "$SERVE" ]; then
  for t in ${SERVE_TREES:-new head}; do
    if [ $t = head ]; then R=$PWD/.ab/head; else R=$PWD; fi
    echo "== served, $t, depth ${DEPTH:-2}"
    (cd $R && JPHOTON_CACHE_DIR=${CACHE:-/tmp/cache-$t} PYTHONUNBUFFERED=1 PYTHONPATH=$R:/tmp/site timeout ${SERVE_TIMEOUT:-280} \
      python3 benchmarks/serving.py --model random:llama3.2-1b --concurrency ${SERVE_C:-32 64} --prompt-len 128 \
      --new-tokens 256 --requests-per-client 4 --servers process --frontends 1 --pipeline-depth ${DEPTH:-2} \
      --out "$OUT/serving_$t.json" 2>&1 | grep -E "^C=|error|Error" | cut -c1-300)
  done
fi

#!/bin/bash
# Issue 23: the engine alone under staggered arrivals (lab/probes/staggered_ticks.py, default engine) with Python's GC
# thresholds at their default and raised (GC_HIGH), alternated in one device call, GC passes counted in both:
# `RUNS="64:default 64:high ..." bash $0`. Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}
i=0
for run in ${RUNS:-64:default 64:high 64:default 64:high}; do
  i=$((i + 1)); c=${run%%:*}; v=${run##*:}
  flag=$([ "$v" = high ] && echo "--gc-threshold ${GC_HIGH:-100000 50 1000}" || echo "")
  echo "== run $i: C=$c gc thresholds: $v"
  timeout ${RUN_TIMEOUT:-200} python3 lab/probes/staggered_ticks.py --default-engine --concurrency $c \
    --requests-per-client ${R:-4} $flag --out "$OUT/ticks_${i}_c${c}_$v.json" 2>&1 | grep -E '^\{|Error|error' | cut -c1-400
done

#!/bin/bash
# Issue 23: the engine alone under staggered arrivals (lab/probes/staggered_ticks.py, default engine) with
# `plan_beside_dispatch` on and off, alternated in one device call: `RUNS="64:True 64:False ..." bash $0`. Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}
i=0
for run in ${RUNS:-64:True 64:False 64:True 64:False}; do
  i=$((i + 1)); c=${run%%:*}; on=${run##*:}
  echo "== run $i: C=$c plan_beside_dispatch=$on"
  timeout ${RUN_TIMEOUT:-200} python3 lab/probes/staggered_ticks.py --default-engine --concurrency $c \
    --requests-per-client ${R:-4} --llm-args "plan_beside_dispatch=$on" --out "$OUT/ticks_${i}_c${c}_$on.json" 2>&1 \
    | grep -E '^\{|Error|error' | cut -c1-900
done

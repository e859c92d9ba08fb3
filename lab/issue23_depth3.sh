#!/bin/bash
# Issue 23: the engine alone's static and staggered ticks at pipeline depth 2 and 3, alternated in one process
# (lab/probes/staggered_ticks.py --depths), C=64 then C=32 (CS); SERVE=1: then benchmarks/serving.py (one frontend,
# C=32 64) at depth 3 and 2. Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}
for c in ${CS:-64 32}; do
  echo "== C=$c depths ${DEPTHS:-2 3 2 3}"
  timeout ${RUN_TIMEOUT:-400} python3 lab/probes/staggered_ticks.py --concurrency $c --depths ${DEPTHS:-2 3 2 3} \
    --out "$OUT/depths_c$c.json" 2>&1 | grep -E '^\{|Error' \
    | grep -o 'Error.*\|"depth": [0-9], "ratio[^{]*\|"staggered.decode": {[^}]*' | cut -c1-230
done
if [ -n "$SERVE" ]; then
  for d in ${SERVE_DEPTHS:-3 2}; do
    echo "== served, depth $d"
    timeout ${SERVE_TIMEOUT:-280} python3 benchmarks/serving.py --model random:llama3.2-1b --concurrency ${SERVE_C:-32 64} \
      --prompt-len 128 --new-tokens 256 --requests-per-client 4 --servers process --frontends 1 --pipeline-depth $d \
      --out "$OUT/serving_depth$d.json" 2>&1 | grep -E "^C=|tok/s|TTFT|error|Error" | cut -c1-300
  done
fi

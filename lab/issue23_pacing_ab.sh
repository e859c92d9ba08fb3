#!/bin/bash
# Issue 23: `jphoton serve` (one frontend) with message pacing off (--max-message-rate 0) and at its default, same load
# generator, one device call each (RATES; a part per call keeps each under the 10-minute limit; the second server loads
# its programs from the first's cache): `RATES="0 default 0 default" bash lab/issue23_pacing_ab.sh` (alternated), then
# `bash lab/issue23_base_serving.sh` for wave 1's server. Carry .whl (and .ab for the base).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}
i=0
for rate in ${RATES:-0 default}; do
  i=$((i + 1))
  flag=$([ "$rate" = default ] && echo "" || echo "--max-message-rate $rate")
  echo "== run $i, max message rate: $rate"
  timeout ${RUN_TIMEOUT:-560} python3 benchmarks/serving.py --model ${MODEL:-random:llama3.2-1b} --concurrency ${C:-32 64} \
    --prompt-len 128 --new-tokens 256 --requests-per-client 4 --servers process --frontends 1 $flag \
    --out "$OUT/serving_${i}_rate_$rate.json" 2>&1 | grep -E "^C=|frontends|tok/s|TTFT|error|Error" | cut -c1-300
done

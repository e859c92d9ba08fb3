#!/usr/bin/env bash
# Served request legs and the engine process's ticks (lab/probes/served_legs.py), random Llama-3.2-1B, prompt 128,
# 256 new tokens, R=4, for several server settings in one device call. VARIANTS: "name|extra serving.py args" lines;
# the first runs with the engine-alone baseline, the rest without (they reuse its compile cache).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site JPHOTON_CACHE_DIR=${CACHE:-/tmp/jphoton-cache}
OUT=${OUT:-/tmp/legs}
C=${C-32 64}
VARIANTS=${VARIANTS-"f1d2|--frontends 1
f2d3|--frontends 2 --pipeline-depth 3"}
first=1
while IFS='|' read -r name extra; do
  [ -z "$name" ] && continue
  base=""; [ $first = 1 ] || base="--no-engine-baseline"
  echo "=== $name: $extra $base"
  mkdir -p "$OUT/$name"; timeout ${LIMIT:-240} python3 lab/probes/served_legs.py --model random:llama3.2-1b --concurrency $C --prompt-len 128 \
    --new-tokens 256 --requests-per-client 4 $extra $base --out "$OUT/$name/legs.json" 2>&1 \
    > "$OUT/$name.log"
  grep -E "^(== run|client|compiles)|loop lag|launch-to-launch|server-side TTFT|engine alone" "$OUT/$name.log" | cut -c1-150
  first=0
done <<< "$VARIANTS"

#!/usr/bin/env bash
# One or two gRPC frontends (`jphoton serve --frontends`), alternated, plus wave 1's server (98dc4d0, .ab/base) under
# the same load generator, one device call: random 1B at C=32 64 (--frontends 1 2, then 2 1) and SmolLM2-135M at C=32
# (1 2). Each serving.py run prints the frontend counts side by side.
#   mkdir -p .ab/base && git archive 98dc4d0 jphoton pallas_kernels server benchmarks | tar -x -C .ab/base
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site JPHOTON_CACHE_DIR=${CACHE:-/tmp/jphoton-cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/frontends}
mkdir -p "$OUT"
COMMON="--prompt-len 128 --new-tokens 256 --requests-per-client 4 --servers process"
show() { grep -E "^C=.*(frontends|engine alone)" "$1" | cut -c1-260; }
timeout 240 python3 benchmarks/serving.py --model random:llama3.2-1b --concurrency 32 64 $COMMON --frontends 1 2 \
  --out "$OUT/serving_1b_a.json" > "$OUT/1b_a.log" 2>&1; show "$OUT/1b_a.log"
timeout 130 python3 benchmarks/serving.py --model random:llama3.2-1b --concurrency 32 64 $COMMON --frontends 2 1 \
  --no-engine-baseline --out "$OUT/serving_1b_b.json" > "$OUT/1b_b.log" 2>&1; show "$OUT/1b_b.log"
if [ -d .ab/base ] && [ "${BASE:-1}" = 1 ]; then
  OUT=$OUT timeout ${BASE_LIMIT:-200} bash lab/issue23_base_serving.sh > "$OUT/base.log" 2>&1
  pkill -f serve_tree.py; sleep 2
  grep -E "^C=" "$OUT/base.log" | cut -c1-260
fi
timeout 150 python3 benchmarks/serving.py --model random:smollm2-135m --concurrency 32 $COMMON --frontends 1 2 \
  --out "$OUT/serving_smollm2.json" > "$OUT/smollm2.log" 2>&1; show "$OUT/smollm2.log"

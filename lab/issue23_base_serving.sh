#!/bin/bash
# Issue 23: wave 1's server (98dc4d0, .ab/base) under the same load generator as benchmarks/serving.py, one device call.
#   mkdir -p .ab/base && git archive 98dc4d0 jphoton pallas_kernels server benchmarks | tar -x -C .ab/base   # carry .ab
set -u
OUT=${OUT:-/tmp/jphoton-bench}
MODEL=${MODEL:-random:llama3.2-1b}
C=${C:-32 64}
export PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
PORT=50071
PYTHONPATH=$PWD/.ab/base:/tmp/site python3 lab/serve_tree.py --model "$MODEL" --concurrency $C --port $PORT --baseline \
  > "$OUT/base_server.log" 2>&1 &
SERVER=$!
PYTHONPATH=$PWD:/tmp/site python3 benchmarks/serving.py --connect 127.0.0.1:$PORT --model "$MODEL" --concurrency $C \
  --prompt-len 128 --new-tokens 256 --requests-per-client 4 --out "$OUT/serving_base.json"
kill $SERVER; wait $SERVER
grep "baseline:" "$OUT/base_server.log"; tail -5 "$OUT/base_server.log"

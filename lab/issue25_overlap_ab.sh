#!/bin/bash
# Issue 25: grammar masks filled on a worker thread during the commit (this tree) vs inline (.ab/prev), same device call,
# in the order ORDER (benchmarks/constrained.py, JSON schema and coordinates, 1 / 8 / 32 streams).
#   mkdir -p .ab/prev && git archive <commit> jphoton pallas_kernels server benchmarks | tar -x -C .ab/prev
#   carry .whl .ab benchmarks/assets
set -u
OUT=${OUT:-/tmp/jphoton-bench}
ORDER=${ORDER:-prev this this prev prev this this prev}
export PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T0=$SECONDS
round=0
for tree in $ORDER; do
    round=$((round + 1))
    src=$PWD; [ $tree = prev ] && src=$PWD/.ab/prev
    mkdir -p "$OUT/$tree$round"
    echo "=== run $round, $tree ($((SECONDS - T0)) s)"
    PYTHONPATH=$src:/tmp/site timeout 300 python3 "$src/benchmarks/constrained.py" --model random:llama3.2-1b:vocab=49152 \
      --tokenizer benchmarks/assets/smollm2-tokenizer --streams ${STREAMS:-1 8 32} --out "$OUT/$tree$round" 2>&1 \
      | grep -v "^INFO:absl" > "$OUT/$tree$round.log"
    grep -E "streams:|Error|Traceback|grammar masks:" "$OUT/$tree$round.log" | cut -c1-110
done
echo "=== done after $((SECONDS - T0)) s"

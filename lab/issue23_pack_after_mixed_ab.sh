#!/bin/bash
# Issue 23: a decode step's pack after a mixed step starts from the last decode pack (this tree) vs from scratch (the
# tree in .ab/prev: `mkdir -p .ab/prev && git archive <commit> jphoton pallas_kernels server benchmarks lab | tar -x -C
# .ab/prev`), one device call: the engine alone's staggered ticks at C=64 (lab/probes/staggered_ticks.py), then
# `jphoton serve` under benchmarks/serving.py, trees alternated (this, prev, this). Carry .whl and .ab.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
for tree in this prev; do
  root=$([ $tree = this ] && echo "$PWD" || echo "$PWD/.ab/prev")
  echo "== ticks, $tree"
  PYTHONPATH=$root:/tmp/site timeout $([ $tree = this ] && echo 210 || echo 90) python3 "$root/lab/probes/staggered_ticks.py" --default-engine --concurrency 64 \
    --out "$OUT/ticks_$tree.json" 2>&1 | grep '^{' | python3 -c "
import json, sys
d = json.loads(sys.stdin.read())
for k in ('static.decode', 'staggered.decode', 'staggered.mixed'):
    print(k, {m: v for m, v in d[k].items() if m.endswith('mean')})
print('ratio', round(d['ratio'], 3))"
done
i=0
for tree in this prev this; do
  i=$((i + 1))
  root=$([ $tree = this ] && echo "$PWD" || echo "$PWD/.ab/prev")
  echo "== serving $i, $tree"
  PYTHONPATH=$root:/tmp/site timeout 100 python3 "$root/benchmarks/serving.py" --model random:llama3.2-1b \
    --concurrency 32 64 --prompt-len 128 --new-tokens 256 --requests-per-client 4 --servers process --frontends 1 \
    --out "$OUT/serving_${i}_$tree.json" 2>&1 | grep -E "^C=|rror" | cut -c1-260
done

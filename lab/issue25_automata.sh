#!/bin/bash
# Issue 25, device automata: benchmarks/constrained.py with each constraint served both ways (device automata, host
# masks) beside free decoding, then the decode step by sampling setting for this tree and .ab/main (`git archive` of
# the commit before; the filtered variant now also reads the automaton tables). One device call; carry .whl, .ab,
# benchmarks/assets. CONSTRAINTS, STREAMS, PATHS, SAMPLING_TREES override; COST=1 adds lab/probes/automaton_cost.py.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=/tmp/jphoton-cache PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
PYTHONPATH=$PWD:/tmp/site timeout ${RUN_TIMEOUT:-280} python3 benchmarks/constrained.py \
  --model random:llama3.2-1b:vocab=49152 --tokenizer $PWD/benchmarks/assets/smollm2-tokenizer \
  --streams ${STREAMS:-8 32} --constraints ${CONSTRAINTS:-schema coords} --paths ${PATHS:-device host} --out $OUT 2>&1 \
  | grep -v "compiling step\|Warn" | tail -${TAIL:-30}
for tree in ${SAMPLING_TREES-new main}; do  # (SAMPLING_TREES= : none)
  d=$([ $tree = new ] && echo . || echo .ab/main)
  echo "== $tree engine"; (cd $d && PYTHONPATH=$PWD:/tmp/site timeout 160 python3 benchmarks/sampling.py \
    --model random:llama3.2-1b --batch 32 --out $OUT/sampling_$tree.json 2>&1 | grep -v -i "warn\|absl" | tail -12)
done
if [ -n "$COST" ]; then
  PYTHONPATH=$PWD:/tmp/site timeout 200 python3 lab/probes/automaton_cost.py --rows 32 --rounds 5 2>/dev/null \
    | tail -1 | tee $OUT/automaton_cost.json
fi

#!/bin/bash
# Issue 23: the engine alone under static and staggered arrivals (lab/probes/staggered_ticks.py, buckets narrowed to the
# run), this tree against `.ab/head`, alternated in one device call: `RUNS="64 64 32 32" bash $0`. Carry .whl and .ab.
# HOST_SIM=1: first the engine's Python alone in both trees (lab/probes/host_sim.py, no device: steadier than the live
# runs, whose spread is as large as most host-side changes).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
OUT=${OUT:-/tmp/out}
if [ -n "$HOST_SIM" ]; then
  cp -n lab/probes/host_sim.py .ab/head/lab/probes/ 2>/dev/null
  for t in head new head new; do
    if [ $t = head ]; then R=$PWD/.ab/head; else R=$PWD; fi
    (cd $R && PYTHONPATH=$R:/tmp/site python3 lab/probes/host_sim.py --concurrency 64 --rounds 3 | sed "s/^/$t /")
  done
fi
for c in ${RUNS-64 64 32 32}; do
  for t in head new; do
    if [ $t = head ]; then R=$PWD/.ab/head; else R=$PWD; fi
    echo "== $t C=$c"
    (cd $R && JPHOTON_CACHE_DIR=/tmp/cache-$t PYTHONUNBUFFERED=1 PYTHONPATH=$R:/tmp/site timeout ${RUN_TIMEOUT:-150} \
      python3 lab/probes/staggered_ticks.py --concurrency $c --out "$OUT/${t}_c${c}_$RANDOM.json" 2>&1 \
      | grep -E '^\{|Error' | grep -o 'Error.*\|"ratio[^{]*\|"static.decode": {[^}]*\|"staggered.decode": {[^}]*' \
      | cut -c1-260)
  done
done

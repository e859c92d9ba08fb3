#!/bin/bash
# Issue 23: the host's CPU topology; the engine alone's staggered ticks (lab/probes/staggered_ticks.py, C=64) with the
# process on one hyperthread of each physical core (taskset) against all CPUs, alternated (RUNS); then one more run
# with every thread's CPU use sampled during its timed part (lab/probes/thread_cpu.py). Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|MHz|NUMA node"
ONE=$(python3 -c "
import os
cpus = sorted(os.sched_getaffinity(0)); keep = []
for c in cpus:
    s = open(f'/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list').read().strip().replace('-', ',')
    if c == min(int(x) for x in s.split(',')): keep.append(c)
print(','.join(map(str, keep)))")
echo "one hyperthread per core: $ONE (of $(nproc))"
for c in ${RUNS:-64 64}; do
  for mode in all one; do
    echo "== $mode C=$c"
    pre=$([ $mode = one ] && echo "taskset -c $ONE" || echo "")
    $pre timeout ${RUN_TIMEOUT:-150} python3 lab/probes/staggered_ticks.py --concurrency $c \
      --out "$OUT/${mode}_c${c}_$RANDOM.json" 2>&1 | grep -E '^\{|Error' \
      | grep -o 'Error.*\|"ratio[^{]*\|"staggered.decode": {[^}]*' | cut -c1-260
  done
done
echo "== sampled run (all CPUs), C=64"
rm -f /tmp/mark
python3 lab/probes/staggered_ticks.py --concurrency 64 --mark /tmp/mark --out "$OUT/sampled_c64.json" > /tmp/st.log 2>&1 &
python3 lab/probes/thread_cpu.py $! --start-file /tmp/mark --interval 0.5
grep -o '"ratio[^{]*' /tmp/st.log

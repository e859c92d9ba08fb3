#!/bin/bash
# Issue 23: is the served engine slowed by sharing its core with the frontend and the clients? The same served run
# twice: as is, then with the engine process alone on CPU 0 and its hyperthread sibling (JPHOTON_ENGINE_CPUS) and the
# frontend(s) and client processes on the other CPUs (taskset). One device call.
#   MODEL=random:smollm2-135m C=32 FRONTENDS=1 bash lab/issue23_pinning.sh
set -u
OUT=${OUT:-/tmp/jphoton-bench}
MODEL=${MODEL:-random:smollm2-135m}
C=${C:-32}
FRONTENDS=${FRONTENDS:-1}
ORDER=${ORDER:-plain pinned}
export PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nproc; lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA)"
ENGINE=$(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list)
REST=$(python3 -c "import os,sys; e=set(); [e.update(range(int(a),int(b)+1)) if '-' in p else e.add(int(p)) for p in sys.argv[1].split(',') for a,b in [(p.split('-')+[p])[:2]]]; print(','.join(map(str,sorted(os.sched_getaffinity(0)-e))))" "$ENGINE")
echo "engine CPUs $ENGINE, the rest $REST"
ENGINE=$(python3 -c "import sys; e=[]; [e.extend(range(int(p.split('-')[0]),int(p.split('-')[-1])+1)) for p in sys.argv[1].split(',')]; print(','.join(map(str,e)))" "$ENGINE")
for v in $ORDER; do
  echo "=== $v"
  if [ "$v" = pinned ]; then PRE="env JPHOTON_ENGINE_CPUS=$ENGINE taskset -c $REST"; else PRE=""; fi
  $PRE python3 benchmarks/serving.py --model "$MODEL" --concurrency $C --prompt-len 128 --new-tokens 256 \
    --requests-per-client 4 --frontends $FRONTENDS --out "$OUT/serving_$v.json" 2>&1 \
    | grep -E "decode tok/s|engine alone|EXPERIMENT|pinned|compiles after|Error|error" | cut -c1-400
done

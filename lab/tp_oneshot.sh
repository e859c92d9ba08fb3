#!/usr/bin/env bash
# Issue 29 probe: XLA's one-shot all-reduce kernel (a collective kernel with its own scratch buffers per all-reduce
# per program, allocated outside JAX's pool) on vs off: TP=2 8B step time and GPU memory used as programs are added.
# Run on a 2-GPU host: OUT=$OUT bash lab/tp_oneshot.sh
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
probe() { label=$1; shift; env XLA_PYTHON_CLIENT_PREALLOCATE=false "$@" timeout 170 python3 lab/tp_collectives.py \
  --label "$label" --batches 1 8 32 2>&1 | grep RESULT; }
probe default
probe one-shot-off XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false

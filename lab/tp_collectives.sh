#!/usr/bin/env bash
# Issue 29 probe: TP=2 Llama-3-8B decode step time under all-reduce settings, one process each (lab/tp_collectives.py).
# Run on a 2-GPU host: OUT=$OUT bash lab/tp_collectives.sh
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
probe() { label=$1; shift; env "$@" timeout 150 python3 lab/tp_collectives.py --label "$label" 2>&1 | grep RESULT; }
probe base
probe one-shot XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true
probe cmdbuf-collectives XLA_FLAGS=--xla_gpu_enable_command_buffer=+COLLECTIVES
timeout 150 python3 lab/tp_collectives.py --tp 1 --label tp1 2>&1 | grep RESULT

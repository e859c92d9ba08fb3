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
# 2026-11-26 (H100 x2, 8B, B=1 / 32 ms): base 4.309 / 5.362, one-shot 4.299 / 5.348, cmdbuf-collectives 4.328 / 5.344,
# tp1 5.699 / 6.940: neither flag changes the step
if [ "${1:-}" = flags ]; then
  probe base
  probe one-shot XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true
  probe cmdbuf-collectives XLA_FLAGS=--xla_gpu_enable_command_buffer=+COLLECTIVES
fi
# 2026-11-26, same machine: all-reduce of float32 products 4.289 / 5.329 ms, of bf16 products 4.242 / 4.989 ms, tp1
# 5.703 / 6.936 (commit cef3608's TP_REDUCE_FLOAT32 switch, since removed: bf16 kept, docs/decisions.md)
probe base
timeout 150 python3 lab/tp_collectives.py --tp 1 --label tp1 2>&1 | grep RESULT

#!/bin/bash
# Issue 25: the top-k kernel's launch configs at R = 32 and 1 (lab/probes/topp_cost.py), one device call.
#   CONFIGS="8192,4096,16,1 8192,4096,16,1,2" KINDS="top_k top_p" bash lab/issue25_topk_configs.sh
export PYTHONPATH=$PWD:/tmp/site JPHOTON_CACHE_DIR=/tmp/jphoton-cache
CONFIGS=${CONFIGS:-8192,4096,16,1 8192,4096,16,2 8192,4096,16,3 8192,8192,16,1 8192,4096,32,1 8192,8192,32,1 8192,2048,16,2 16384,8192,32,1}
KINDS=${KINDS:-top_k top_p}
ROWS=${ROWS:-32 1}
ONLY="plain prephase sample_top_k sample_top_p"
for c in $CONFIGS; do
  IFS=, read b cb w s p u <<< "$c"
  [ "${p:-0}" = 0 ] && p=""
  [ "${u:-1}" = 1 ] && u=""
  for k in $KINDS; do ONLY="$ONLY kernel_${k}_b${b}c${cb}w${w}s${s}${p:+p$p}${u:+u$u}"; done
done
timeout 500 python3 lab/probes/topp_cost.py --rows $ROWS --iters 100 --kernel-configs $CONFIGS --only $ONLY \
  --out $OUT/topk_configs.json 2>&1 | grep -v Warning

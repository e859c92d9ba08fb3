#!/bin/bash
# Issue 22: lab/probes/blocking_host.py in wave 1 (.ab/base), the last commit (.ab/head) and this tree, 3 rounds alternated.
#   trees: .ab/base = git archive 98dc4d0, .ab/head = git archive of the commit to compare (jphoton pallas_kernels
#   server benchmarks), carried with .ab
set -u
OUT=${OUT:-/tmp/jphoton-lab}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=/tmp/jphoton-cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for r in 1 2 3; do for t in base head new; do
  d=$PWD/.ab/$t; [ $t = new ] && d=$PWD
  PYTHONPATH=$d:/tmp/site taskset -c 0-7 python3 lab/probes/blocking_host.py --model random:llama3.2-1b --batch 1 32 --out $OUT/bh_${t}_$r.json > $OUT/bh_${t}_$r.log 2>&1 || echo "$t $r failed"
done; done
python3 - $OUT <<'PY'
import json,glob,sys,statistics as st
o=sys.argv[1]
for t in ("base","head","new"):
  for b in ("1","32"):
    rows=[json.load(open(f))["rows"][b] for f in sorted(glob.glob(f"{o}/bh_{t}_*.json"))]
    print(t,b," ".join(f"{k}={st.median(r[k] for r in rows):.3f}" for k in rows[0] if k!="steps"), [round(r["period_ms"],3) for r in rows])
PY

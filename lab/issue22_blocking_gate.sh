#!/bin/bash
# Issue 22's blocking-loop gate: the vs-pytorch jphoton rows (blocking = pipeline_depth 1, pipelined) in this tree and
# in wave 1 (98dc4d0, .ab/base), alternated ROUNDS times in fresh processes pinned to cores 0-7, one device call.
#   mkdir -p .ab/base && git archive 98dc4d0 jphoton pallas_kernels server benchmarks | tar -x -C .ab/base   # carry .ab
set -u
OUT=${OUT:-/tmp/jphoton-bench}
ROUNDS=${ROUNDS:-3}
ROWS=${ROWS:-jphoton-blocking jphoton-pipelined}
RUNS=/tmp/gate_runs; mkdir -p $RUNS  # per-run files stay on the machine; $OUT gets the summary
export PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for r in $(seq "$ROUNDS"); do
  for tree in main base; do
    dir=$PWD; [ "$tree" = base ] && dir=$PWD/.ab/base
    (cd "$dir" && PYTHONPATH=$dir:/tmp/site taskset -c 0-7 python3 benchmarks/vs_pytorch.py --shape 1b \
      --rows $ROWS --batch 1 32 --agree 0 --out "$RUNS/${tree}_$r" --tag "$tree" \
      > "$RUNS/${tree}_$r.log" 2>&1) || echo "$tree round $r failed"
  done
done
python3 - "$RUNS" "$ROUNDS" "$OUT" <<'PY'
import glob, json, statistics, sys
out, rounds, dest = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ms = {}
for tree in ("main", "base"):
    for r in range(1, rounds + 1):
        for f in glob.glob(f"{out}/{tree}_{r}/*.json"):
            for row in json.load(open(f)).get("results", []):
                ms.setdefault((row["row"], row["case"], tree), []).append(row["ms_step"])
summary = {}
for (row, case, tree), v in sorted(ms.items()):
    if tree != "main" or (row, case, "base") not in ms:
        continue
    m, b = statistics.median(v), statistics.median(ms[(row, case, "base")])
    summary[f"{row} {case}"] = {"main_ms": v, "base_ms": ms[(row, case, "base")], "ratio_of_medians": m / b}
    print(f"{row:18s} {case:7s} main {m:.3f} base {b:.3f} ratio {m / b:.3f}   main {v} base {ms[(row, case, 'base')]}")
json.dump(summary, open(f"{dest}/gate.json", "w"), indent=1)
PY

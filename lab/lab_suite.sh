#!/usr/bin/env bash
# Lab probes on the device machine: `bash lab/lab_suite.sh SECTION [SECTION...]` (`list`: the sections).
# Writes $OUT/<section>.{json,log}. Each probe's CPU smoke run is in tests/test_lab.py; lab/README.md says what each is.
set -uo pipefail
cd "$(dirname "$0")/.."
SECTIONS="decode-matmul decode-matmul-e2e glu-sweep staggered-ticks greedy-tokens prefill-cost compact-cost
  leaf-dispatch lower-profile"
if [ "${1:-}" = list ]; then echo $SECTIONS | tr ' ' '\n'; exit 0; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
OUT=${OUT:-/tmp/jphoton-lab}
MODEL=${MODEL:-random:llama3.2-1b}
mkdir -p "$OUT"

run() {
  local name=$1; shift
  echo "=== $name: $*"
  timeout "${SECTION_TIMEOUT:-470}" "$@" 2>&1 | grep -v "^INFO:absl" | tee "$OUT/$name.log"
}

for section in "$@"; do
  case $section in
    decode-matmul) run "$section" python3 lab/decode_matmul.py --max-configs 10 --out "$OUT/$section.json" ;;
    decode-matmul-e2e)
      run "$section" python3 lab/decode_matmul.py --part e2e --batch 2 32 --variants xla-fused fused-fused \
        --out "$OUT/$section.json" ;;
    glu-sweep)
      run "$section" python3 lab/decode_matmul.py --shapes gate_up_glu --m 2 32 --sweep-m 2 32 --max-configs 14 \
        --time-per-config 0.3 --out "$OUT/$section.json" ;;
    staggered-ticks)  # the pipelined loop's phases, static vs staggered arrivals, default engine (~3 min)
      run "$section" python3 lab/probes/staggered_ticks.py --model "$MODEL" --default-engine --concurrency 64 \
        --out "$OUT/$section.json" ;;
    greedy-tokens) run "$section" python3 lab/probes/greedy_tokens.py --model "$MODEL" --concurrency 64 ;;
    prefill-cost) run "$section" python3 lab/probes/prefill_cost.py --model "$MODEL" --out "$OUT/$section.json" ;;
    compact-cost) run "$section" python3 lab/probes/compact_cost.py --caps 0 1 --rows 1 32 ;;
    leaf-dispatch) run "$section" python3 lab/probes/leaf_dispatch.py ;;
    lower-profile)  # where a 1B step shape's Python trace + lowering goes (cProfile; ~25 s)
      run "$section" python3 lab/probes/lower_profile.py "$MODEL" --top 40 ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done

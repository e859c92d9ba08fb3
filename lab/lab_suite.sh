#!/usr/bin/env bash
# Lab probes and sweeps on the device machine: `bash lab/lab_suite.sh SECTION [SECTION...]` (`list`: the sections).
# Writes $OUT/<section>.{json,log}. Not maintained with the engine: see lab/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
SECTIONS="probe-h2d probe-dispatch decode-matmul decode-matmul-e2e glu-sweep sampler-noise stream-headroom mosaic-stream
  sampler-argmax weight-layouts lower-profile compile-contention"
if [ "${1:-}" = list ]; then echo $SECTIONS | tr ' ' '\n'; exit 0; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
OUT=${OUT:-/tmp/jphoton-lab}
mkdir -p "$OUT"

run() {
  local name=$1; shift
  echo "=== $name: $*"
  timeout "${SECTION_TIMEOUT:-470}" "$@" 2>&1 | grep -v "^INFO:absl" | tee "$OUT/$name.log"
}

for section in "$@"; do
  case $section in
    probe-h2d) run "$section" python3 lab/probes/h2d_while_busy.py ;;
    lower-profile)  # where a 1B step shape's Python trace + lowering goes (cProfile; ~25 s)
      run "$section" python3 lab/probes/lower_profile.py random:llama3.2-1b --top 40 ;;
    compile-contention)  # B=1 decode while another thread traces / compiles / loads the CPU (~200 s)
      run "$section" python3 lab/probes/compile_contention.py --shapes 8 --seconds 10 ;;
    probe-dispatch)
      run "$section" python3 lab/probes/dispatch_cost.py --out "$OUT" --tag default
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" run "$section-nographs" \
        python3 lab/probes/dispatch_cost.py --out "$OUT" --tag no-command-buffers ;;
    decode-matmul) run "$section" python3 lab/decode_matmul.py --max-configs 10 --out "$OUT/$section.json" ;;
    decode-matmul-e2e)
      run "$section" python3 lab/decode_matmul.py --part e2e --batch 2 32 --variants xla-fused fused-fused \
        --out "$OUT/$section.json" ;;
    glu-sweep)
      run "$section" python3 lab/decode_matmul.py --shapes gate_up_glu --m 2 32 --sweep-m 2 32 --max-configs 14 \
        --time-per-config 0.3 --out "$OUT/$section.json" ;;
    sampler-noise) run "$section" python3 lab/sampler_noise.py --batch 2 32 128 --vocab 128256 --out "$OUT/$section.json" ;;
    stream-headroom) run "$section" python3 lab/probes/stream_headroom.py --out "$OUT/$section.json" ;;
    mosaic-stream) run "$section" python3 lab/probes/mosaic_stream.py --bench ;;
    sampler-argmax) run "$section" python3 lab/probes/sampler_argmax.py --batch 2 32 128 --vocab 128256 ;;
    weight-layouts)  # issue 22: per-layer vs stacked weights, with and without Triton GEMMs: compile s, step, dispatch
      for v in unrolled unrolled-stacked; do
        for f in "" "--xla_gpu_enable_triton_gemm=false"; do
          XLA_FLAGS="$(echo ${XLA_FLAGS:-} $f)" run "$section-$v${f:+-cublas}" python3 lab/compile_probe.py \
            --model "${MODEL:-random:llama3.2-1b}" --unroll $v --serial 2 --parallel 0 --rows 2 32 \
            --out "$OUT/$section-$v${f:+-cublas}.json"
        done
      done ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done

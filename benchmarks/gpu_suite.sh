#!/usr/bin/env bash
# The product's GPU benchmarks, run on the device machine: `bash benchmarks/gpu_suite.sh SECTION [SECTION...]`;
# `bash benchmarks/gpu_suite.sh list` prints the sections. Each section finishes in under 8 minutes on an H100 with cold
# compile caches and writes $OUT/<section>.json (or the files named below) and $OUT/<section>.log; the numbers go into
# benchmarks/RESULTS.md with the date, device, jax version and this command.
# QUICK=1: every section with fewer batch sizes / tokens / reps through the same code (a check that each starts and
# finishes; all of them in one device call). One-off probes and tuning sweeps live in lab/ (lab/lab_suite.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
SECTIONS="moondream moondream3 moondream-prepare moondream-vs-kestrel startup startup-ready-1b throughput sampling prefix-cache lora pipeline-llama1b pipeline-smollm2 serving serving-smollm2 constrained vs-pytorch-1b-b1-b32 vs-pytorch-1b-b8-b128
  vs-pytorch-8b-b8 vs-pytorch-8b-b32-b128 vs-pytorch-report moe-layer moe-e2e-warp moe-e2e-ec attention kernel-profile
  host-overhead tp-check tp-steps tp-big"
if [ "${1:-}" = list ]; then echo $SECTIONS | tr ' ' '\n'; exit 0; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QUICK=${QUICK:-0}
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
OUT=${OUT:-/tmp/jphoton-bench}
mkdir -p "$OUT"
if [ -d .whl ]; then  # wheels the device image lacks (README.md, Benchmarks)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
Q() { [ "$QUICK" != 0 ]; }  # QUICK=1: shorter time boxes too
BUDGET=$(Q && echo 120 || echo 420)

run() {  # run NAME CMD...: time-boxed, logged
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "${SECTION_TIMEOUT:-470}" "$@" 2>&1 | grep -v "^INFO:absl" | tee "$OUT/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

[ $# -eq 0 ] && { echo "usage: $0 SECTION... | list  (sections: $(echo $SECTIONS))"; exit 2; }
[ "$1" = all ] && set -- $SECTIONS
for section in "$@"; do
  case $section in
    moondream)  # Moondream 2 (random weights, bf16): start-up, text and image rows as moondream-vs-kestrel, plus decode
      # at batch 1 with the text layers' products as XLA dots (default: the Pallas GEMV up to 32 tokens a step)
      run moondream python3 benchmarks/moondream.py --model random:moondream2 --out "$OUT/moondream.jsonl" \
        --variants '{"matmul": "xla"}' ;;
    moondream3)  # Moondream 3 (random bf16 weights, MoE from layer 4): decode at batch 1 and the device step at 1 and 32
      # rows (only the shapes it runs compiled); the --report table puts them beside kestrel's column
      run "$section" python3 benchmarks/moondream.py --model random:moondream3 --only decode --step-rows 1 32 \
        --options '{"warmup": "off"}' --out "$OUT/moondream3_jphoton.jsonl" ;;
    moondream-prepare)  # the random checkpoint, and jphoton's programs compiled into JPHOTON_CACHE_DIR (a cold start:
      # ~5 min on an H100) with its start-up row; then moondream-vs-kestrel fits one call on the same held machine
      [ -f /tmp/kck/model.safetensors ] || python3 .kestrel/make_random_checkpoint.py /tmp/kck | tee "$OUT/checkpoint.log"
      run "$section" python3 benchmarks/moondream.py --model /tmp/kck --only startup --out "$OUT/moondream_cold.jsonl" ;;
    moondream-vs-kestrel)  # jphoton and Photon's engine (kestrel 0.9.2) on one random Moondream 2 checkpoint file
      # (bf16), one after the other: kestrel's own rows (../shared/kestrel: its kit copied to .kestrel/, git-ignored;
      # its wheels stashed on the held machine by `bash .kestrel/run_on_device.sh recv` calls, one part each) and
      # jphoton's (benchmarks/moondream.py); the table: `python3 benchmarks/moondream.py --report DIR`
      K=.kestrel CK=/tmp/kck
      [ -f "$CK/model.safetensors" ] || python3 $K/make_random_checkpoint.py "$CK" | tee "$OUT/checkpoint.log"
      if [ ! -d /tmp/ksite/kestrel ]; then
        cat /tmp/kw/kw.tar.part* > /tmp/kw.tar && mkdir -p /tmp/kwhl && tar -C /tmp/kwhl -xf /tmp/kw.tar && rm /tmp/kw.tar
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ksite /tmp/kwhl/*.whl
      fi
      run moondream-jphoton python3 benchmarks/moondream.py --model "$CK" --out "$OUT/moondream_jphoton.jsonl"
      run moondream-kestrel env PYTHONPATH=/tmp/ksite python3 $K/bench_kestrel.py --ckpt "$CK" --max-batch 64 \
        --concurrency 32,64 --prompt-tokens 128 --out-tokens 256 --budget-s 300 --out "$OUT/moondream_kestrel.jsonl"
      python3 benchmarks/moondream.py --report "$OUT" | tee "$OUT/moondream_vs_kestrel.md" ;;
    startup)  # time to first token of a fresh process, default LLM(), cold then warm caches, three model shapes
      run startup python3 benchmarks/startup.py --models random:smollm2-135m random:llama3.2-1b \
        random:qwen3-30b-a3b:layers=8 --out "$OUT/startup.json" ;;
    startup-ready-1b)  # cold 1B: all default shapes ready, B=1 decode while they compile vs after
      run "$section" python3 benchmarks/startup.py --models random:llama3.2-1b --runs cold --wait-ready \
        --out "$OUT/$section.json" ;;
    throughput)  # engine decode throughput, random Llama-3.2-1B shape, blocking and pipelined, B = 1..128
      run throughput python3 benchmarks/throughput.py --model random:llama3.2-1b --batch 1 8 32 128 \
        --prompt-len 128 --new-tokens 128 --out "$OUT/throughput.json" ;;
    sampling)  # decode step by sampling setting (greedy, temperature, top-p, top-k, both), B=1 and 32, random 1B
      run sampling python3 benchmarks/sampling.py --model random:llama3.2-1b --batch 1 32 --out "$OUT/sampling.json" ;;
    prefix-cache)  # 32 requests sharing a 2,048-token system prompt, cache on vs off; unique prompts' decode on vs off
      run "$section" python3 benchmarks/prefix_cache.py --model random:llama3.2-1b --requests 32 --system-len 2048 \
        --unique-len 64 --batch 32 --out "$OUT/prefix_cache.json" ;;
    lora)  # B=32 decode steps and a served batch with 24 rows on 4 rank-16 adapters vs an engine without LoRA
      run lora python3 benchmarks/lora.py --model random:llama3.2-1b --adapters 4 --rank 16 --batch 32 \
        --out "$OUT/lora.json" ;;
    # blocking vs pipelined, cost model, timeline PNG; one section per model (a cold machine compiles the unrolled
    # steps at ~40 s per shape, so both models in one section would overrun the 8 minutes)
    pipeline-llama1b|pipeline-smollm2)
      m=$([ "$section" = pipeline-llama1b ] && echo llama3.2-1b || echo smollm2-135m)
      run "$section" python3 benchmarks/pipeline.py --models "random:$m" --streams 1 8 32 --out "$OUT" \
        --tag "${section#pipeline-}" ;;
    serving)  # gRPC serving (server/): staggered arrivals at concurrency C vs the same requests as a static batch of C,
      # `jphoton serve` with one gRPC frontend process and with two (--frontends)
      run serving python3 benchmarks/serving.py --model random:llama3.2-1b --concurrency 32 64 --prompt-len 128 \
        --new-tokens 256 --requests-per-client 4 --servers process --frontends 1 2 --out "$OUT/serving.json" ;;
    serving-smollm2)  # the same with the SmolLM2-135M shape at C=32 (host-bound: ~0.9 ms device steps)
      run "$section" python3 benchmarks/serving.py --model random:smollm2-135m --concurrency 32 --prompt-len 128 \
        --new-tokens 256 --requests-per-client 4 --servers process --frontends 1 2 --out "$OUT/serving_smollm2.json" ;;
    constrained)  # JSON-schema vs free decoding, random Llama-3.2-1B resized to SmolLM2's vocabulary and tokenizer
      # (benchmarks/assets/smollm2-tokenizer: git-ignored; the script writes it from the embedded model when that is
      # installed, else write it where it is with `--export-tokenizer` and carry it)
      run constrained python3 benchmarks/constrained.py --model random:llama3.2-1b:vocab=49152 \
        --tokenizer benchmarks/assets/smollm2-tokenizer --streams 1 8 32 --out "$OUT" ;;
    # jphoton vs HF transformers on the same random bf16 weights, same prompts, same GPU, one run (the jphoton rows in
    # a child process). Cases past --time-budget are recorded as skipped. vs-pytorch-report joins the sections' JSON
    # into one table and plot ($OUT/vs_pytorch_all.{json,png}).
    vs-pytorch-1b-b1-b32)  # B=1, context 512 (prompt 384) and B=32: HF static, jphoton blocking and pipelined
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-blocking jphoton-pipelined \
        --batch 1 32 --time-budget "$BUDGET" --out "$OUT" --tag "$section" ;;
    vs-pytorch-1b-b8-b128)  # B=8 and 128, HF static and jphoton pipelined (no agreement check)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-pipelined --batch 8 128 \
        --agree 0 --time-budget "$BUDGET" --out "$OUT" --tag "$section" ;;
    vs-pytorch-8b-b8)  # 8B at B=8 (the 8B compiles need most of a time box)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 8b --rows hf-static jphoton-pipelined --batch 8 \
        --agree 0 --time-budget "$(Q && echo 120 || echo 200)" --out "$OUT" --tag "$section" ;;
    vs-pytorch-8b-b32-b128)  # 8B at B=32 and 128
      run "$section" python3 benchmarks/vs_pytorch.py --shape 8b --rows hf-static jphoton-pipelined --batch 32 128 \
        --agree 0 --time-budget "$(Q && echo 120 || echo 330)" --out "$OUT" --tag "$section" ;;
    vs-pytorch-report)
      run "$section" python3 benchmarks/vs_pytorch.py --merge "$OUT"/vs_pytorch_vs-pytorch-*.json --out "$OUT" \
        --tag all ;;
    moe-layer)  # one MoE layer, Qwen3-30B-A3B shape, B = 1..64: warp decode vs expert-centric vs dense gather,
      # touched-expert bandwidth vs the read bandwidth measured in the same run, error vs float32
      run "$section" python3 benchmarks/moe_decode.py layer --shapes qwen3-30b-a3b --out "$OUT/$section.json" ;;
    # End to end: random:qwen3-30b-a3b with as many layers as fit beside the KV pool (JAX may take 95% of the GPU
    # here), layers scanned, only the shapes a run uses compiled; one section per backend
    moe-e2e-warp|moe-e2e-ec)
      b=$([ "$section" = moe-e2e-warp ] && echo warp_decode || echo expert_centric)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run "$section" python3 benchmarks/moe_decode.py e2e --backends "$b" \
        --batch 1 8 32 --out "$OUT/$section.json" ;;
    attention)  # Pallas paged decode attention vs the plain-JAX static gather vs the jnp reference, Llama-3.2-1B
      # attention shape (16-layer bf16 pool), B = 1..128 x context 512..8192: us per call, KV read GB/s, error
      run attention python3 benchmarks/attention_decode.py --out "$OUT/attention.json" ;;
    kernel-profile)  # device time per XLA op / kernel of the 1B decode step at B = 2 (one request) and 32, context 512
      run kernel-profile python3 benchmarks/kernel_profile.py --model random:llama3.2-1b --rows 2 32 --ctx 512 \
        --out "$OUT/kernel-profile.json" ;;
    # Tensor parallelism (a host with 2+ GPUs, `run` kind nvidia-h100-x2): TP=2 greedy tokens vs TP=1 (float32 and
    # bf16, Pallas kernels per shard); Llama-3-8B shape step time B = 1, 32 and served tok/s, TP=1 vs TP=2; a
    # Llama-3-70B shape (141 GB: no single GPU holds it) on 2 GPUs; JAX may take 93% of each GPU, as it needs it: the
    # rest is CUDA's, NCCL's and the all-reduce kernels' (at 95% they found none; preallocating 92% left the KV pool
    # none); prefill chunks of at most 128 tokens (with 512 a B = 32 run ran out of memory: compiles need some too)
    tp-check)
      run "$section" python3 benchmarks/tensor_parallel.py check --model random:llama3.2-1b:layers=4 --tp 2 \
        --out "$OUT/$section.json" ;;
    tp-steps)
      run "$section" python3 benchmarks/tensor_parallel.py steps --model random:llama3-8b --tp 2 --batches 1 32 \
        --out "$OUT/$section.json" ;;
    tp-big)
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${TP_BIG_MEM_FRACTION:-0.93} run "$section" \
        python3 benchmarks/tensor_parallel.py big --model random:llama3-70b --tp 2 --batches 1 32 --max-model-len 512 \
        --context 256 --prompt-len 64 --new-tokens 64 --max-num-batched-tokens 128 --served-batches ${TP_BIG_SERVED:-1 32} \
        --out "$OUT/$section.json" ;;
    host-overhead)  # the engine's host work per decode step (plan + pack, launch, commit) at B = 1, 32, 128
      run "$section" python3 benchmarks/host_overhead.py --batch 1 32 128 --out "$OUT" ;;
    *) echo "unknown section $section (sections: $(echo $SECTIONS))"; exit 2 ;;
  esac
done

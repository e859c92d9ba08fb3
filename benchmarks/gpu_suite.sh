#!/usr/bin/env bash
# GPU benchmark suite, run on the device machine (device tool): `bash benchmarks/gpu_suite.sh SECTION [SECTION...]`.
# Each section finishes in under 8 minutes and writes $OUT/<section>.json and $OUT/<section>.log; the numbers are then
# copied into benchmarks/RESULTS.md with the date, device, jax version and this command.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
OUT=${OUT:-/tmp/jphoton-bench}
mkdir -p "$OUT"
if [ -d .whl ]; then  # wheels the device image lacks (README.md, Benchmarks)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

run() {  # run NAME CMD...: time-boxed, logged
  local name=$1; shift
  echo "=== $name: $*"
  timeout "${SECTION_TIMEOUT:-470}" "$@" 2>&1 | grep -v "^INFO:absl" | tee "$OUT/$name.log"
}

for section in "$@"; do
  case $section in
    throughput)  # issue 3: engine decode throughput, random Llama-3.2-1B shape, blocking and pipelined
      run throughput python3 benchmarks/throughput.py --model random:llama3.2-1b --batch 1 8 32 128 \
        --prompt-len 128 --new-tokens 128 --out "$OUT/throughput.json" ;;
    # issue 4: blocking vs pipelined, cost model, timeline PNG; one section per model (a fresh machine compiles the
    # unrolled SmolLM2 steps at ~40 s per shape, so both models in one section would overrun the 8 minutes)
    pipeline-smollm2)
      run pipeline-smollm2 python3 benchmarks/pipeline.py --models random:smollm2-135m --streams 1 8 32 \
        --out "$OUT" --tag smollm2 ;;
    pipeline-llama1b)
      run pipeline-llama1b python3 benchmarks/pipeline.py --models random:llama3.2-1b --streams 1 8 32 \
        --out "$OUT" --tag llama1b ;;
    serving)  # gRPC serving (server/): staggered arrivals at mean concurrency C vs the same requests as a static batch of C;
      # the server is a child process with 8 step shapes (decode 32/64 x prefill 1/4 x 128 tokens), so warm-up stays short
      run serving python3 benchmarks/serving.py --model random:llama3.2-1b --concurrency 32 64 --prompt-len 128 \
        --new-tokens 256 --requests-per-client 4 --out "$OUT/serving.json" ;;
    constrained)  # issue 5: JSON-schema vs free decoding, random Llama-3.2-1B resized to SmolLM2's vocabulary and tokenizer
      # (benchmarks/assets/smollm2-tokenizer, written by `benchmarks/constrained.py --export-tokenizer`; carried, not committed)
      if [ ! -f benchmarks/assets/smollm2-tokenizer/tokenizer.json ]; then
        echo "constrained: benchmarks/assets/smollm2-tokenizer is missing: write it where the embedded model is installed" \
          "(python benchmarks/constrained.py --export-tokenizer benchmarks/assets/smollm2-tokenizer) and carry it"
        continue
      fi
      run constrained python3 benchmarks/constrained.py --model random:llama3.2-1b:vocab=49152 \
        --tokenizer benchmarks/assets/smollm2-tokenizer --streams 1 8 32 --out "$OUT" ;;
    # issue 6: MoE decode. Per layer, Qwen3-30B-A3B and moondream3 shapes, B = 1..64: warp decode vs expert-centric vs
    # dense gather, touched-expert bandwidth vs the read bandwidth measured in the same run, error vs float32.
    moe-check)  # correctness first: HF fixture through the engine per backend, kernels at Qwen3 shape vs float32
      run moe-check python3 benchmarks/moe_decode.py check --out "$OUT/moe-check.json" ;;
    # One section per shape (each compiles 4 paths x 7 batch sizes on a fresh machine).
    moe-layer-qwen3)
      run moe-layer-qwen3 python3 benchmarks/moe_decode.py layer --shapes qwen3-30b-a3b --out "$OUT/moe-layer-qwen3.json" ;;
    moe-layer-moondream3)
      run moe-layer-moondream3 python3 benchmarks/moe_decode.py layer --shapes moondream3 \
        --out "$OUT/moe-layer-moondream3.json" ;;
    moe-sweep-b1|moe-sweep-b8|moe-sweep-b32)  # tile configs of the two warp kernels, Qwen3-30B-A3B shape, one batch size
      # per section (one B of the sweep takes most of a time box on a fresh machine)
      run "$section" python3 benchmarks/moe_decode.py layer --sweep --shapes qwen3-30b-a3b --batch "${section#moe-sweep-b}" \
        --paths warp_decode --out "$OUT/$section.json" ;;
    moe-threshold)  # where "auto" should switch from warp decode to expert-centric: both paths at prefill-ish sizes
      run moe-threshold python3 benchmarks/moe_decode.py layer --shapes qwen3-30b-a3b moondream3 --batch 32 64 96 128 192 \
        --paths warp_decode expert_centric --out "$OUT/moe-threshold.json" ;;
    # End to end: random:qwen3-30b-a3b with as many layers as fit beside the KV pool (JAX may take 95% of the GPU
    # here), layers scanned and only the shapes a run uses compiled (compiles stay short), one section per backend.
    # (`--layers N --unroll` trades compile time for no per-layer loop overhead.)
    moe-e2e-warp)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run moe-e2e-warp python3 benchmarks/moe_decode.py e2e \
        --backends warp_decode --batch 1 8 32 --out "$OUT/moe-e2e-warp.json" ;;
    moe-e2e-ec)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run moe-e2e-ec python3 benchmarks/moe_decode.py e2e \
        --backends expert_centric --batch 1 8 32 --out "$OUT/moe-e2e-ec.json" ;;
    probe-h2d)  # host cost of a host->device argument while the GPU is busy, with controls (benchmarks/probes/)
      run probe-h2d python3 benchmarks/probes/h2d_while_busy.py ;;
    probe-dispatch)  # host ms per dispatch of the 1B decode step (host / device / carried input) and of the masked
      # sampler, GPU busy, B = 1 and 32: with XLA's default CUDA-graph (command buffer) setting, then with it off
      run probe-dispatch python3 benchmarks/probes/dispatch_cost.py --out "$OUT" --tag default
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" run probe-dispatch-nographs \
        python3 benchmarks/probes/dispatch_cost.py --out "$OUT" --tag no-command-buffers ;;
    kernel-profile)  # issue 8: device time per XLA op / kernel of the 1B decode step (B=1, 2, 32; 512 tokens of
      # context; one step's kernels in order)
      run kernel-profile python3 benchmarks/kernel_profile.py --model random:llama3.2-1b --shapes 1:0 2:0 32:0 \
        --out "$OUT/kernel-profile.json" ;;
    kernel-profile-quick)  # the same at the engine's decode shapes B = 2 (one request) and 32 only, no loop runs
      run kernel-profile-quick python3 benchmarks/kernel_profile.py --model random:llama3.2-1b --shapes 2:0 32:0 \
        --out "$OUT/kernel-profile-quick.json" ;;
    kernel-profile-fused)  # kernel-profile-quick with matmul "fused" (models/matmul.py)
      run kernel-profile-fused python3 benchmarks/kernel_profile.py --model random:llama3.2-1b --shapes 2:0 32:0 \
        --llm-args "matmul='fused'" --out "$OUT/kernel-profile-fused.json" ;;
    profile)  # where a decode step's time goes (host phases vs device)
      run profile python3 benchmarks/step_profile.py --model random:llama3.2-1b --batch 1 32 128 ;;
    attention)  # issue 8: Pallas paged decode attention vs the plain-JAX static gather vs the jnp reference, Llama-3.2-1B
      # attention shape (16-layer bf16 pool), B = 1..128 x context 512..8192: us per call, KV read GB/s, error
      run attention python3 benchmarks/attention_decode.py --out "$OUT/attention.json" ;;
    attention-sweep)  # the kernel's configs (block, splits, warps, stages) where splits matter most: B = 1, 8 at 8k
      # context, and B=1 at 512 (latency-bound: 11.4 us/layer on 2026-11-23, ~180 us of the 1B step)
      run attention-sweep python3 benchmarks/attention_decode.py --sweep --paths pallas --batch 1 8 --ctx 512 8192 \
        --time-per-path 0.2 --out "$OUT/attention-sweep.json" ;;
    attention-sweep-512)  # the kernel's configs at the engine's decode shapes of the vs-pytorch cases: B = 2 (one
      # request) and 32 at 512 tokens of context (each per-layer call is ~5 / ~17 us: latency, not bandwidth)
      run attention-sweep-512 python3 benchmarks/attention_decode.py --sweep --paths pallas --batch 2 32 --ctx 512 \
        --time-per-path 0.3 --out "$OUT/attention-sweep-512.json" ;;
    decode-matmul-fused-quick)  # the engine's 1B step at B = 2 and 32: "xla" vs "fused", then the "fused" step's kernels
      run decode-matmul-fused-quick python3 benchmarks/decode_matmul.py --part e2e --batch 2 32 \
        --variants xla-fused fused-fused --out "$OUT/decode-matmul-fused-quick.json"
      run kernel-profile-fused python3 benchmarks/kernel_profile.py --model random:llama3.2-1b --shapes 2:0 32:0 \
        --llm-args "matmul='fused'" --out "$OUT/kernel-profile-fused.json" ;;
    attention-in-step)  # Pallas decode attention configs (block x splits [x stages]) inside the default 1B step at
      # B = 2 and 32, 512 tokens of context (outside the step, ~5 us calls time too noisily: RESULTS.md)
      run attention-in-step python3 benchmarks/decode_matmul.py --part e2e --batch 2 32 --variants fused-fused \
        --attn-configs 64x4 64x2 64x8 32x8 32x16 64x4x3 128x2 --out "$OUT/attention-in-step.json" ;;
    attention-in-step-b128)  # Pallas decode attention configs inside the default 1B step at B = 128, 512 tokens of
      # context (the default there: 64 x 1; stages: default 4), block tokens x splits [x stages]
      run attention-in-step-b128 python3 benchmarks/decode_matmul.py --part e2e --batch 128 --variants fused-fused \
        --attn-configs 64x1 64x1x3 128x1 32x1 64x2 128x1x3 64x1x4 --out "$OUT/attention-in-step-b128.json" ;;
    glu-sweep)  # the gate+up GEMV with the SwiGLU epilogue (matmul "fused"): tile / warp / stage configs at M = 2 and 32,
      # 16 layers' weights chained, against XLA's dot + activation
      run glu-sweep python3 benchmarks/decode_matmul.py --shapes gate_up_glu --m 2 32 --sweep-m 2 32 --max-configs 14 \
        --time-per-config 0.3 --out "$OUT/glu-sweep.json" ;;
    decode-matmul-fused)  # the engine's 1B step at B = 2, 8, 16, 32: "xla" vs its GEMV epilogues one at a time (gate+up
      # with SwiGLU; O and down into the add + RMSNorm kernel at any row count) and "fused" (models/matmul.py)
      run decode-matmul-fused python3 benchmarks/decode_matmul.py --part e2e --batch 2 8 16 32 \
        --variants xla-fused xla-glu-fused xla-residual-fused fused-fused --out "$OUT/decode-matmul-fused.json" ;;
    decode-matmul)  # issue 8: Llama-3.2-1B decode matmuls (qkv/o/gate_up/down/lm_head, M = 1 8 32): XLA unfused and fused
      # vs the Pallas GEMV (pallas_kernels/gemv.py) with a config sweep at M = 1 and 32: us, TB/s vs read bandwidth, error
      run decode-matmul python3 benchmarks/decode_matmul.py --max-configs 10 --out "$OUT/decode-matmul.json" ;;
    decode-matmul-e2e)  # the engine's 1B decode step at B = 2 (the engine's one-row bucket), 32, fused params: the
      # default matmul xla vs pallas (GEMV for QKV and O), in one run
      run decode-matmul-e2e python3 benchmarks/decode_matmul.py --part e2e --batch 2 32 \
        --variants xla-fused pallas-fused --out "$OUT/decode-matmul-e2e.json" ;;
    # issue 8 item 3: jphoton vs HF transformers on the same random bf16 weights, same prompts, same GPU, one run (the
    # jphoton rows in a child process of it)
    # (benchmarks/vs_pytorch.py: weights built in torch, handed to jphoton's HF loader in memory). One section per shape x
    # rows x B group: torch.compile compiles once per B, jphoton compiles each step shape a case needs (~30-45 s a shape
    # for the 1B cold, more for the 8B), and each script stops starting cases after --time-budget s. `vs-pytorch-report`
    # joins the sections' JSON into one table and plot ($OUT/vs_pytorch_all.{json,png}).
    vs-pytorch-1b-b1-b32)  # both headline cases (B=1 + context 512, and B=32) with HF static in one run
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-blocking jphoton-pipelined \
        --batch 1 32 --time-budget 420 --out "$OUT" --tag "$section" ;;
    vs-pytorch-1b-ab)  # the headline cases (B=1, context 512, B=32): HF static, jphoton pipelined with matmul "xla" and
      # again with "fused" (same weights, same process)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-pipelined --batch 1 32 \
        --matmul xla --ab-matmul fused --time-budget 420 --out "$OUT" --tag "$section" ;;
    split-finish)  # the GEMVs finished by their last program (QKV + RoPE; O / down + residual + RMSNorm) and the
      # attention's in-kernel split merge: correctness on the GPU (repeat calls bit-identical, counters zero, vs the XLA
      # path), then the 1B step at B = 2, 8, 16 with each on and off (matmul "finish" vs "fused", "/merge")
      run split-finish-check python3 benchmarks/probes/split_finish_check.py --out "$OUT/split-finish-check.json"
      run split-finish python3 benchmarks/decode_matmul.py --part e2e --batch 2 8 16 --variants fused-fused \
        fused/merge-fused finish-fused finish/merge-fused --out "$OUT/split-finish.json" ;;
    kernel-profile-finish)  # kernel-profile-quick with matmul "finish" at B = 2 and 16
      run kernel-profile-finish python3 benchmarks/kernel_profile.py --model random:llama3.2-1b --shapes 2:0 16:0 \
        --llm-args "matmul='finish'" --out "$OUT/kernel-profile-finish.json" ;;
    vs-pytorch-1b-finish)  # the headline cases (B=1, context 512, B=32): HF static, jphoton pipelined with matmul
      # "fused" and again with "finish" (same weights, same process)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-pipelined --batch 1 32 \
        --matmul fused --ab-matmul finish --time-budget 420 --out "$OUT" --tag "$section" ;;
    mlp-decode)  # the whole SwiGLU MLP in one kernel (pallas_kernels/mlp_decode.py) vs the SwiGLU GEMV + XLA down GEMM:
      # per layer (16 layers chained, config sweep) at M = 2, 8, 32, then the 1B step at B = 2, 8, 32 ("mlp" vs "fused")
      run mlp-decode python3 benchmarks/mlp_decode.py --m 2 8 32 --out "$OUT/mlp-decode.json"
      run mlp-decode-e2e python3 benchmarks/decode_matmul.py --part e2e --batch 2 8 32 --variants fused-fused \
        mlp-fused fused-fused mlp-fused --out "$OUT/mlp-decode-e2e.json" ;;
    megakernel-probes)  # what a persistent decode kernel would face (issue 8, RESULTS.md 2026-11-25): a kernel boundary
      # vs an in-kernel grid barrier, a pure read of each 1B matrix vs the engine's kernel, and a persistent Mosaic GPU
      # kernel streaming weights across grid barriers
      run grid-barrier python3 benchmarks/probes/grid_barrier.py --out "$OUT/grid-barrier.json"
      run stream-headroom python3 benchmarks/probes/stream_headroom.py --out "$OUT/stream-headroom.json"
      run mosaic-stream python3 benchmarks/probes/mosaic_stream.py --bench ;;
    sampler-noise)  # the fused sampler alone at the 1B vocabulary, hash noise (the default since c9f4606) vs threefry,
      # alternated in one process: the hash was chosen without a GPU number of its own
      run "$section" python3 benchmarks/sampler_noise.py --batch 2 32 128 --vocab 128256 --out "$OUT/$section.json" ;;
    host-overhead)  # the engine's host work per decode tick without a device (plan + pack, commit) at B = 1, 32, 128
      run "$section" python3 benchmarks/host_overhead.py --batch 1 32 128 --out "$OUT" ;;
    vs-pytorch-1b-host)  # B=32 and 128 pipelined beside the step back to back, then with the dispatcher thread (the
      # large-batch cases, where the host's per-row work grows toward the device step); no HF rows
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows jphoton-pipelined --batch 32 128 --agree 0 \
        --ab-dispatch-thread --time-budget 400 --out "$OUT" --tag "$section" ;;
    vs-pytorch-1b-b8-b128)  # B=8 and 128, HF static and jphoton pipelined in one run (no agreement check)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-pipelined --batch 8 128 \
        --agree 0 --time-budget 420 --out "$OUT" --tag "$section" ;;
    vs-pytorch-1b-b128)  # B=128, HF static and jphoton in one run (no agreement check: the b1 sections have it)
      # (--gc-ab: the pipelined case again with the GC's start-up objects unfrozen, the 726 ms tick's suspect)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-blocking jphoton-pipelined \
        --batch 128 --agree 0 --time-budget 300 --gc-ab --out "$OUT" --tag "$section" ;;
    vs-pytorch-8b-b8)  # 8B at B=8: HF static and jphoton pipelined in one run (the 8B compiles need most of a box)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 8b --rows hf-static jphoton-pipelined --batch 8 \
        --agree 0 --time-budget 200 --out "$OUT" --tag "$section" ;;
    vs-pytorch-8b-b32-b128)  # 8B at B=32 and 128: HF static and jphoton pipelined in one run (cases past the
      # time budget are recorded as skipped)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 8b --rows hf-static jphoton-pipelined --batch 32 128 \
        --agree 0 --time-budget 330 --out "$OUT" --tag "$section" ;;
    vs-pytorch-1b-b1)  # the headline case in one run: HF static vs jphoton at B=1 and context 512, ~2.5 min warm
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows hf-static jphoton-blocking jphoton-pipelined \
        --batch 1 --time-budget 400 --out "$OUT" --tag "$section" ;;
    vs-pytorch-1b-hf-static|vs-pytorch-1b-hf-batch|vs-pytorch-8b-hf-batch)  # B = 1 8 32 128 and the B=1 context-512 case
      s=${section#vs-pytorch-}
      run "$section" python3 benchmarks/vs_pytorch.py --shape "${s%%-*}" --rows "hf-${s#*-hf-}" --batch 1 8 32 128 \
        --time-budget 400 --out "$OUT" --tag "$section" ;;
    vs-pytorch-8b-hf-static-small|vs-pytorch-8b-hf-static-large)  # 8B compiles take longer: B 1, 8 (+ context 512) | 32, 128
      b="1 8"; [ "$section" = vs-pytorch-8b-hf-static-large ] && b="32 128"
      run "$section" python3 benchmarks/vs_pytorch.py --shape 8b --rows hf-static --batch $b --time-budget 400 \
        --out "$OUT" --tag "$section" ;;
    vs-pytorch-1b-jp-small|vs-pytorch-1b-jp-large)  # jphoton blocking + pipelined, and the logits/greedy agreement
      b="1 8"; [ "$section" = vs-pytorch-1b-jp-large ] && b="32 128"
      run "$section" python3 benchmarks/vs_pytorch.py --shape 1b --rows jphoton-blocking jphoton-pipelined --batch $b \
        --time-budget 400 --out "$OUT" --tag "$section" ;;
    vs-pytorch-8b-jp-b1|vs-pytorch-8b-jp-b8|vs-pytorch-8b-jp-b32|vs-pytorch-8b-jp-b128)  # one B per section (b1: + context 512)
      run "$section" python3 benchmarks/vs_pytorch.py --shape 8b --rows jphoton-blocking jphoton-pipelined \
        --batch "${section#vs-pytorch-8b-jp-b}" --time-budget 400 --out "$OUT" --tag "$section" ;;
    vs-pytorch-report)
      run vs-pytorch-report python3 benchmarks/vs_pytorch.py --merge "$OUT"/vs_pytorch_vs-pytorch-*.json --out "$OUT" \
        --tag all ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done

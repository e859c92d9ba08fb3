#!/bin/bash
# `jphoton serve` as a user starts it (default engine, random 1B): its idle engine loop runs each compiled program once
# after warm-up ("every program has run once"); then a small closed loop through gRPC, whose gaps show any first run
# left to a request (an H100 paid up to ~0.4 s for a program's first execution). One device call.
set -u
OUT=${OUT:-/tmp/jphoton-bench}
MODEL=${MODEL:-random:llama3.2-1b}
export PYTHONUNBUFFERED=1 JPHOTON_CACHE_DIR=${JPHOTON_CACHE_DIR:-/tmp/jphoton-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
T0=$(date +%s)
python3 -m jphoton serve --model "$MODEL" --port 50077 -v > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 420); do grep -q "every program has run once" "$OUT/serve.log" && break; sleep 1; done
echo "first runs done $(( $(date +%s) - T0 )) s after start"
grep -E "serving after|all .* ready|every program|ran [0-9]+ programs|first step shapes" "$OUT/serve.log" | cut -c1-220
python3 - <<'PY'
import time, grpc
from server import jphoton_pb2 as pb, jphoton_pb2_grpc as pb_grpc
stub = pb_grpc.EngineStub(grpc.insecure_channel("127.0.0.1:50077"))
for n, (rows, prompt) in enumerate([(1, 128), (1, 128), (4, 100), (4, 100)]):  # the first requests a user sends
    t0 = time.perf_counter()
    calls = [stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[(7 * i + j) % 1000 + 5 for j in range(prompt)]),
             sampling=pb.SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))) for i in range(rows)]
    gaps, ttft = [], []
    for c in calls:
        last = None
        for m in c:
            now = time.perf_counter()
            ttft.append(now - t0) if last is None else gaps.append(now - last)
            last = now
    print(f"request set {n}: {rows} x {prompt}-token prompt, 64 tokens: TTFT max {1e3 * max(ttft):.1f} ms, "
          f"longest gap {1e3 * max(gaps):.1f} ms, total {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)
PY
python3 benchmarks/serving.py --connect 127.0.0.1:50077 --model "$MODEL" --concurrency 8 32 --prompt-len 128 \
  --new-tokens 128 --requests-per-client 2 --out "$OUT/serving_first_runs.json" 2>&1 | grep -E "decode tok/s|compiles"
kill $SERVER; wait $SERVER

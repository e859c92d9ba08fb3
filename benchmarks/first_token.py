"""First-token latency of one short request on an idle engine, by entry point: `LLM.stream` in the caller's thread,
`AsyncLLM.generate`, and `jphoton serve`'s path (gRPC to a server whose engine runs in a process of its own). The same
engine settings and the same prompt for all three, every shape compiled and run once before timing (warmup="full"),
an idle gap between requests; the median of --reps requests each, and each one's ratio to the LLM path.

    python3 benchmarks/first_token.py --model random:llama3.2-1b --out $OUT/first_token.json
    python3 benchmarks/first_token.py --smoke  # CPU: the embedded model, a few requests (checks the plumbing)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, warmup="full", progress=False)


def llm_path(llm, prompt, params, reps: int, gap: float) -> list[float]:
    out = []
    for _ in range(reps):
        time.sleep(gap)
        t0 = time.perf_counter()
        with llm.stream(prompt, params) as stream:
            for delta in stream:
                if delta.token_ids:
                    out.append(time.perf_counter() - t0)
                    break
    return out


def async_path(llm, prompt, params, reps: int, gap: float) -> list[float]:
    from jphoton import AsyncLLM

    engine = AsyncLLM(llm)

    async def one() -> float:
        t0 = time.perf_counter()
        async for out in engine.generate(prompt, params):
            if out.delta.token_ids:
                took = time.perf_counter() - t0
                break
        return took

    async def run() -> list[float]:
        out = []
        for _ in range(reps):
            await asyncio.sleep(gap)
            out.append(await one())
        return out

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def serve_path(model, dtype, prompt_ids, max_tokens: int, reps: int, gap: float) -> tuple[list[float], list[float]]:
    """First-token times through gRPC, and the round trips of a unary call (GetModelInfo) to the same server."""
    import grpc

    from jphoton import LLM
    from jphoton.server import app, jphoton_pb2_grpc
    from jphoton.server import jphoton_pb2 as pb
    from jphoton.server.engine_process import Spawn

    server = app.serve(Spawn(functools.partial(LLM, model, dtype=dtype, **ENGINE)), port=0)
    try:
        stub = jphoton_pb2_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        list(stub.Generate(request, timeout=120))  # the channel's connection, the server's first call
        out, rtt = [], []
        for _ in range(reps):  # the transport alone: a unary call the frontend answers without the engine
            time.sleep(gap)
            t0 = time.perf_counter()
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
            rtt.append(time.perf_counter() - t0)
        for _ in range(reps):
            time.sleep(gap)
            t0 = time.perf_counter()
            call = stub.Generate(request, timeout=120)
            for message in call:
                if message.token_ids:
                    out.append(time.perf_counter() - t0)
                    break
            call.cancel()
        return out, rtt
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--gap", type=float, default=0.05, help="idle seconds before each request")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:  # (fewer shapes to compile, twice: here and in the server's engine process)
        args.reps = min(args.reps, 3)
        ENGINE.update(max_num_seqs=2, max_num_batched_tokens=32, decode_buckets=(1, 2), prefill_buckets=((1, 32),),
                      warmup="off")  # (the shapes one request uses compile on first use: the warm-up request)
    from jphoton import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, **ENGINE)
    ids = [(7 * i + 3) % min(1000, llm.config.vocab_size - 1) + 1 for i in range(args.prompt_len)]
    prompt, params = {"prompt_token_ids": ids}, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                               ignore_eos=True)
    llm_path(llm, prompt, params, 2, 0.0)  # (anything left to warm)
    times = {"LLM": llm_path(llm, prompt, params, args.reps, args.gap),
             "AsyncLLM": async_path(llm, prompt, params, args.reps, args.gap)}
    del llm
    times["jphoton serve"], rtt = serve_path(args.model, args.dtype, ids, args.max_tokens, args.reps, args.gap)
    base = statistics.median(times["LLM"])
    rows = [{"entry": k, "ttft_ms_p50": 1e3 * statistics.median(v), "ttft_ms_min": 1e3 * min(v),
             "ttft_ms_max": 1e3 * max(v), "vs_llm": statistics.median(v) / base, "reps": len(v)}
            for k, v in times.items()]
    grpc_rtt_ms = 1e3 * statistics.median(rtt)
    for r in rows:
        print(f"{r['entry']:>14}: first token p50 {r['ttft_ms_p50']:8.2f} ms (min {r['ttft_ms_min']:.2f}, max "
              f"{r['ttft_ms_max']:.2f}), x{r['vs_llm']:.3f} the LLM path", flush=True)
    print(f"gRPC round trip of a unary call (GetModelInfo, no engine): p50 {grpc_rtt_ms:.2f} ms", flush=True)
    result = {"model": args.model or "embedded", "engine": ENGINE, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "gap_s": args.gap, "rows": rows, "grpc_unary_rtt_ms_p50": grpc_rtt_ms}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

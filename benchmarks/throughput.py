"""Decode throughput of the engine: B requests with a P-token prompt and N new tokens each, all submitted at once.

Reports ms per decode step, tok/s, the fraction of the HBM floor (weight + KV bytes read per step over the read
bandwidth measured in the same run with a large jnp.sum) and compiles after warm-up, for blocking (depth 1) and
pipelined (depth 2) loops.

    python benchmarks/throughput.py --model random:llama3.2-1b --batch 1 8 32 128 --out /tmp/throughput.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import (  # noqa: E402
    QUICK,
    default_llm,
    device_info,
    kv_bytes_read,
    read_bandwidth,
    timed_run,
    weight_bytes,
    write_json,
)
from benchmarks.llm_args import add_llm_args, parse_llm_args  # noqa: E402
from jphoton import SamplingParams  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="throughput.json")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--bandwidth-gib", type=float, default=8.0, help="size of the read-bandwidth probe")
    add_llm_args(ap)
    args = ap.parse_args(argv)
    if QUICK:
        args.batch, args.new_tokens, args.depths = [1, max(args.batch)], min(args.new_tokens, 32), [2]
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jphoton").setLevel(logging.INFO)

    info = device_info()
    bw = read_bandwidth(args.bandwidth_gib)
    print(f"{info}\nread bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    max_b = max(args.batch)
    rows = []
    for depth in args.depths:
        t0 = time.perf_counter()
        llm = default_llm(args.model, max_b, dtype=args.dtype, pipeline_depth=depth, **parse_llm_args(args.llm_args))
        startup = time.perf_counter() - t0
        itemsize = 4 if args.dtype == "float32" else 2
        wbytes = weight_bytes(llm.config, itemsize)
        print(f"depth {depth}: start-up (load + compile every step shape) {startup:.1f}s, "
              f"compiles so far {llm.stats()['num_compiles']}", flush=True)
        rng = np.random.default_rng(0)
        for b in args.batch:
            prompts = [rng.integers(0, llm.config.vocab_size, args.prompt_len).tolist() for _ in range(b)]
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
            timed_run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm caches
            r = timed_run(llm, prompts, params)
            floor_s = (wbytes + kv_bytes_read(llm.config, b, args.prompt_len + args.new_tokens / 2, itemsize)) / bw
            # the device's own time per decode step (launches back to back, no host work), in the engine's K-step
            # launches when it runs them (`decode_steps`): what the tick should match
            k = llm.engine_config.decode_steps
            device_ms = llm.device_step_ms(b, context=args.prompt_len + args.new_tokens // 2, decode_steps=k)
            row = dict(batch=b, depth=depth, decode_ms=r.decode_ms_median, decode_ms_mean=r.decode_ms_mean,
                       decode_tok_s=b / (r.decode_ms_median / 1e3), e2e_tok_s=r.tok_s, wall_s=r.wall_s,
                       ttft_ms=r.ttft_ms_median, floor_ms=floor_s * 1e3,
                       floor_fraction=floor_s * 1e3 / r.decode_ms_median, compiles_during_run=r.compiles_during_run,
                       decode_steps=k, device_step_ms=device_ms, tick_over_device=r.decode_ms_median / device_ms,
                       stats=llm.stats())
            rows.append(row)
            print(f"B={b:4d} depth={depth}: decode {r.decode_ms_median:7.3f} ms/step (mean {r.decode_ms_mean:.3f}), "
                  f"{row['decode_tok_s']:9.0f} tok/s decode, {r.tok_s:9.0f} tok/s end to end, TTFT {r.ttft_ms_median:.1f} ms, "
                  f"floor {row['floor_ms']:.3f} ms ({row['floor_fraction']:.0%} of floor speed), device step "
                  f"{device_ms:.3f} ms (K={k}: tick / device {row['tick_over_device']:.3f}), "
                  f"compiles during run {r.compiles_during_run}", flush=True)
        del llm
    write_json(args.out, {"info": info, "read_bandwidth_Bps": bw, "args": vars(args), "rows": rows,
                          "weight_bytes": wbytes})
    return rows


if __name__ == "__main__":
    main()

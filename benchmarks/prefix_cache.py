"""Prefix caching (issue 27) on the default engine (`LLM(model)`, pipelined), the cache on vs off in one process:

1. shared prefix: N requests = one S-token system prompt + U unique tokens each, all queued at once, a few new tokens
   each; prefill time (until the last request's first token) and TTFT p50, cache on (cold at the start of each run:
   the first request pays the prompt) vs off; hit tokens reported;
2. no shared prefix: B unique prompts decoding T tokens; median decode tick, on vs off, alternated rounds (the cache
   emptied before each run, so nothing hits).
Both arms of a round run the same prompts, and their tokens must be equal.

On vs off flips `llm.engine.pages.prefix_caching` (the flag `LLM(prefix_caching=...)` sets; the pool and scheduler read
nothing else) and empties the cache between runs, so both arms share the compiled steps and the KV pool.

    python benchmarks/prefix_cache.py --model random:llama3.2-1b --out prefix_cache.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import QUICK, default_llm, device_info, timed_run, write_json  # noqa: E402
from benchmarks.llm_args import add_llm_args, parse_llm_args  # noqa: E402
from jphoton import SamplingParams  # noqa: E402


def set_cache(llm, on: bool) -> None:
    llm.reset_prefix_cache()
    llm.engine.pages.prefix_caching = on


def shared_prefix_run(llm, prompts: list[list[int]], on: bool, new_tokens: int) -> dict:
    set_cache(llm, on)
    s0 = llm.stats()
    firsts = {}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    r = timed_run(llm, prompts, params, ttft=firsts)
    s1 = llm.stats()
    ttft = sorted(firsts.values())
    return {"cache": on, "prefill_s": max(ttft), "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "hit_tokens": s1["prefix_hit_tokens"] - s0["prefix_hit_tokens"],
            "query_tokens": s1["prefix_query_tokens"] - s0["prefix_query_tokens"],
            "compiles": r.compiles_during_run, "token_ids": [r.token_ids[k] for k in sorted(r.token_ids)]}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--unique-len", type=int, default=64)
    ap.add_argument("--first-tokens", type=int, default=4, help="new tokens per shared-prefix request")
    ap.add_argument("--batch", type=int, default=32, help="rows of the no-shared-prefix decode runs")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="e.g. float32: the two arms' tokens then match exactly")
    ap.add_argument("--out", default="prefix_cache.json")
    add_llm_args(ap)
    args = ap.parse_args(argv)
    if QUICK:
        args.rounds, args.new_tokens = 1, min(args.new_tokens, 32)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jphoton").setLevel(logging.INFO)
    info = device_info()
    print(info, flush=True)
    llm = default_llm(args.model, max(args.requests, args.batch), **({"dtype": args.dtype} if args.dtype else {}),
                      **parse_llm_args(args.llm_args))
    rng = np.random.default_rng(0)

    shared = []
    vocab = llm.config.vocab_size
    for rnd in range(args.rounds):  # the same prompts for both arms of a round (the cache is emptied in between)
        system = rng.integers(10, vocab, args.system_len).tolist()
        prompts = [system + rng.integers(10, vocab, args.unique_len).tolist() for _ in range(args.requests)]
        for on in ((False, True) if rnd % 2 == 0 else (True, False)):
            row = shared_prefix_run(llm, prompts, on, args.first_tokens)
            row["round"] = rnd
            print({k: v for k, v in row.items() if k != "token_ids"}, flush=True)
            shared.append(row)
        a, b = shared[-2:]
        if a["token_ids"] != b["token_ids"]:
            print(f"round {rnd}: tokens differ with the cache on and off", flush=True)

    def med(rows, key, on):
        return statistics.median(r[key] for r in rows if r["cache"] == on)

    decode = []
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for rnd in range(args.rounds):
        prompts = [rng.integers(10, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
        for on in ((False, True) if rnd % 2 == 0 else (True, False)):
            set_cache(llm, on)
            r = timed_run(llm, prompts, params)
            row = {"cache": on, "round": rnd, "decode_ms": r.decode_ms_median, "tok_s": r.tok_s,
                   "compiles": r.compiles_during_run}
            print(row, flush=True)
            decode.append(row)
    set_cache(llm, True)
    summary = {
        "prefill_s_off": med(shared, "prefill_s", False), "prefill_s_on": med(shared, "prefill_s", True),
        "ttft_p50_ms_off": med(shared, "ttft_p50_ms", False), "ttft_p50_ms_on": med(shared, "ttft_p50_ms", True),
        "hit_tokens_on": med(shared, "hit_tokens", True), "query_tokens_on": med(shared, "query_tokens", True),
        "decode_ms_off": med(decode, "decode_ms", False), "decode_ms_on": med(decode, "decode_ms", True),
        "compiles": sum(r["compiles"] for r in shared + decode),
        "tokens_equal": all(a["token_ids"] == b["token_ids"] for a, b in zip(shared[::2], shared[1::2], strict=True)),
    }
    summary["prefill_speedup"] = summary["prefill_s_off"] / summary["prefill_s_on"]
    summary["ttft_speedup"] = summary["ttft_p50_ms_off"] / summary["ttft_p50_ms_on"]
    summary["decode_on_over_off"] = summary["decode_ms_on"] / summary["decode_ms_off"]
    print(summary, flush=True)
    write_json(args.out, {"device": info, "args": vars(args), "summary": summary,
                          "shared_prefix": [{k: v for k, v in r.items() if k != "token_ids"} for r in shared],
                          "no_shared_prefix": decode})
    return summary, shared


if __name__ == "__main__":
    main()

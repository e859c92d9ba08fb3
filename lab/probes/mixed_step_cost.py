"""What a mixed step (decode rows + one arrival's prefill chunk) costs next to a decode-only step (issue 23: the engine
alone under staggered arrivals delivers 0.82-0.86x of its static batch).

One process, three engines in turn, the buckets narrowed to the run so that it compiles in seconds: depth 1 (the
blocking loop: a tick is host + device, not overlapped, so tick(mixed) - tick(decode) is the device-side difference) and
depth 2 (the default) with mixed steps padded to 2C decode rows, and depth 2 with no padding (one decode bucket, C).
For each: C static rows decoding, then C closed-loop clients with staggered starts (benchmarks/serving.py
engine_staggered); tick medians and means by step kind.

    python3 lab/probes/mixed_step_cost.py --model random:llama3.2-1b --concurrency 32 --out $OUT/mixed.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from benchmarks.common import device_info, timed_run
    from benchmarks.serving import engine_staggered
    from jphoton import LLM, SamplingParams

    c = args.concurrency
    out = {"device": device_info(), "args": vars(args), "runs": {}}
    rng = random.Random(1)
    # (name, depth, decode buckets): the mixed steps' decode part is the largest bucket, so with (c, 2c) a newcomer's
    # prefill rides with 2c decode rows (c of them padding), as in the default engine at C = max_num_seqs / 2.
    for name, depth, buckets in (("depth1-padded", 1, (c, 2 * c)), ("depth2-padded", 2, (c, 2 * c)),
                                 ("depth2-unpadded", 2, (c,))):
        t0 = time.perf_counter()
        llm = LLM(args.model, pipeline_depth=depth, max_model_len=1024, max_num_seqs=buckets[-1],
                  decode_buckets=buckets, prefill_buckets=((1, args.prompt_len), (4, args.prompt_len)),
                  max_num_batched_tokens=2 * c + 4 * args.prompt_len, warmup="full", progress=False)
        vocab = llm.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(c * args.requests_per_client)]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        timed_run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        r = timed_run(llm, prompts[:c], params)
        duration = r.decode_ms_median / 1e3 * args.new_tokens
        st = engine_staggered(llm, prompts, args.new_tokens, c, args.requests_per_client, duration)
        res = {"build_s": time.perf_counter() - t0, "static_decode_ms_median": r.decode_ms_median,
               "static_decode_ms_mean": r.decode_ms_mean, "static_tok_s": c / (r.decode_ms_median / 1e3),
               "staggered": st, "staggered_over_static": st["decode_tok_s"] / (c / (r.decode_ms_median / 1e3)),
               "device_step_ms": {rows: llm.device_step_ms(rows, context=args.prompt_len + args.new_tokens // 2)
                                  for rows in buckets}}
        out["runs"][name] = res
        print(f"{name}: " + json.dumps(res), flush=True)
        del llm
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Serve a model with another source tree's gRPC server, for `benchmarks/serving.py --connect` (the same load generator
against two servers in one device call; issue 23's TTFT/ITL comparison with wave 1).

    mkdir -p .ab/base && git archive 98dc4d0 jphoton pallas_kernels server benchmarks | tar -x -C .ab/base
    PYTHONPATH=.ab/base python3 lab/serve_tree.py --model random:llama3.2-1b --concurrency 32 64 --port 50071 &
    python3 benchmarks/serving.py --connect 127.0.0.1:50071 --concurrency 32 64 --new-tokens 256 ...

The engine is built as that tree's own serving benchmark built it: wave 1's default engine compiles 90 step shapes
(30-40 minutes on an H100), so its benchmark narrowed the buckets to the run (a decode bucket per concurrency, prefill
of one or four prompts, one context bucket); every shape is compiled before the server reports SERVING.
"""

from __future__ import annotations

import argparse
import asyncio


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", required=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--baseline", action="store_true",
                    help="first time the engine alone as that tree's serving benchmark did (prints 'baseline: {...}')")
    args = ap.parse_args()
    from jphoton import LLM  # the tree on PYTHONPATH

    try:
        from jphoton.server.app import run_until_signal  # once the server lives in the package (issue 61)
    except ImportError:
        from jphoton.server.app import run_until_signal

    page = 16
    max_len = -(-(args.prompt_len + args.new_tokens) // page) * page
    rows = max(args.concurrency)
    chunk = -(-args.prompt_len // page) * page
    kwargs = dict(max_model_len=max_len, max_num_seqs=rows, decode_buckets=tuple(sorted(set(args.concurrency))),
                  prefill_buckets=((1, chunk), (4, chunk)), max_num_batched_tokens=rows + 4 * chunk,
                  num_kv_pages=(rows + 8) * (max_len // page), pipeline_depth=2, page_size=page, progress=False)

    def build():
        llm = LLM(args.model, **kwargs)
        if args.baseline:
            from benchmarks.serving import engine_baseline  # that tree's: LLM.generate of a static batch of C

            engine_baseline(llm, {"concurrency": args.concurrency, "prompt_len": args.prompt_len,
                                  "new_tokens": args.new_tokens})
        return llm

    asyncio.run(run_until_signal(build, port=args.port, max_queue=4096, grace=5))


if __name__ == "__main__":
    main()

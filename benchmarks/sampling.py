"""Decode step time by sampling setting (issue 25): greedy, temperature 1, top-p 0.9, top-k 50, both, and one top-p
row among greedy ones, on the default engine (`LLM(model)`, pipelined). The settings alternate within each round, and
each one's figure is the median over rounds of the median decode tick; ratios are to greedy in the same run.

    python benchmarks/sampling.py --model random:llama3.2-1b --batch 1 32 --out sampling.json
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

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "top_k 50 + top_p 0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
    "one top_p 0.9 row": None,  # row 0 top_p 0.9, the others greedy
}


def params_for(name: str, b: int, new_tokens: int) -> list[SamplingParams]:
    def sp(i, **kw):
        return SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=1000 + i, **kw)

    if SETTINGS[name] is None:
        return [sp(0, temperature=1.0, top_p=0.9)] + [sp(i, temperature=0.0) for i in range(1, b)]
    return [sp(i, **SETTINGS[name]) for i in range(b)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--out", default="sampling.json")
    add_llm_args(ap)
    args = ap.parse_args(argv)
    if QUICK:
        args.rounds, args.new_tokens = 1, min(args.new_tokens, 32)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jphoton").setLevel(logging.INFO)
    info = device_info()
    print(info, flush=True)
    llm = default_llm(args.model, max(args.batch), **parse_llm_args(args.llm_args))
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch:
        prompts = [rng.integers(0, llm.config.vocab_size, args.prompt_len).tolist() for _ in range(b)]
        for name in args.settings:  # every sampler variant runs once before anything is timed
            timed_run(llm, prompts[:1], params_for(name, 1, 4)[0], guard=False)
        per = {name: [] for name in args.settings}
        compiles = 0
        for _ in range(args.rounds):
            for name in args.settings:
                r = timed_run(llm, prompts, params_for(name, b, args.new_tokens))
                per[name].append(r.decode_ms_median)
                compiles += r.compiles_during_run
        greedy = statistics.median(per["greedy"]) if "greedy" in per else float("nan")
        for name in args.settings:
            ms = statistics.median(per[name])
            row = dict(batch=b, setting=name, decode_ms=ms, rounds_ms=per[name], vs_greedy=ms / greedy,
                       decode_tok_s=b / (ms / 1e3))
            rows.append(row)
            print(f"B={b:3d} {name:22s} {ms:7.3f} ms/step  {row['vs_greedy']:.3f}x greedy  "
                  f"{row['decode_tok_s']:9.0f} tok/s  (rounds {', '.join(f'{x:.3f}' for x in per[name])})",
                  flush=True)
        print(f"B={b}: compiles while timed: {compiles}", flush=True)
        rows.append(dict(batch=b, compiles_during_runs=compiles))
    write_json(args.out, {"info": info, "args": vars(args), "rows": rows, "stats": llm.stats()})
    return rows


if __name__ == "__main__":
    main()

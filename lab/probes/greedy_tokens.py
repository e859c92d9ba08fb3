"""Greedy tokens of the engine that lab/probes/staggered_ticks.py builds (random weights of a real shape, buckets
narrowed to C rows): a digest and the first tokens, to compare two source trees on the device (a change to how a step's
input reaches it must not change one token).

    python3 lab/probes/greedy_tokens.py --model random:llama3.2-1b --concurrency 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    from benchmarks.llm_args import add_llm_args, parse_llm_args

    add_llm_args(ap)
    args = ap.parse_args()
    from jphoton import LLM, SamplingParams

    c = args.concurrency
    llm = LLM(args.model, **{"max_model_len": 1024, "max_num_seqs": c, "decode_buckets": (c,),
                             "prefill_buckets": ((1, args.prompt_len), (4, args.prompt_len)),
                             "max_num_batched_tokens": c + 4 * args.prompt_len, "warmup": "full", "progress": False,
                             **parse_llm_args(args.llm_args)})
    rng = random.Random(3)
    vocab = llm.config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(8, args.prompt_len))]}
               for _ in range(c)]
    lengths = [rng.randrange(4, args.new_tokens) for _ in range(c)]  # finishes at different steps
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    ids = [o.token_ids for o in outs]
    print(json.dumps({"digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16], "first": ids[0][:8],
                      "tokens": sum(map(len, ids))}))


if __name__ == "__main__":
    main()

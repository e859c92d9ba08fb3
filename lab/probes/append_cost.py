"""Host time of a commit's appends with a real tokenizer (each `Sequence.append` detokenizes and checks stops): R rows
of the embedded model's tokenizer appending T tokens of real text, best of 5, in microseconds a commit. For A/B of the
detokenizer on the CI box (the served benchmarks use random weights without a tokenizer, so they do not see it).

    python lab/probes/append_cost.py [--rows 64] [--tokens 200]
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton import SamplingParams  # noqa: E402
from jphoton.sequence import Sequence  # noqa: E402
from jphoton.weights import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    tok = load_tokenizer(None)  # the embedded model's
    ids = tok.encode("The quick brown fox jumps over the lazy dog, naïve café 日本語. " * 40)
    params = SamplingParams(max_tokens=10 * args.tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(5):
        seqs = [Sequence(i, ids[:16], params, tokenizer=tok, eos_token_ids=(2,), max_model_len=8192, seed=0)
                for i in range(args.rows)]
        t = time.perf_counter()
        for token in ids[16:16 + args.tokens]:
            for s in seqs:
                s.append(token)
        best = min(best, (time.perf_counter() - t) / args.tokens)
    print(f"{best * 1e6:.0f} us a {args.rows}-row commit of appends (detokenizing)")


if __name__ == "__main__":
    main()

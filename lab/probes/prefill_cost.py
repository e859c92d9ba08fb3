"""Time to the first token of one prompt alone, by prompt length (issue 23: prefill attention), through `LLM.generate`
with max_tokens=1 on an idle engine. Runs against any tree (it uses only the public API): copy it into the other tree's
lab/probes/ to compare. Each length: one untimed run (compiles the shapes it needs: warmup="off"), then `--runs`
timed ones, each with a fresh random prompt (no prefix-cache hit); ms median.

    python3 lab/probes/prefill_cost.py --model random:llama3.2-1b [--out $OUT/prefill_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8000])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import numpy as np

    from jphoton import LLM, SamplingParams

    llm = LLM(args.model, warmup="off", max_model_len=8192, progress=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = {"model": args.model, "ms": {}, "shapes_compiled": None}
    for n in args.lengths:
        def run(n=n):
            prompt = rng.integers(0, llm.config.vocab_size, n).tolist()
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params)
            return 1e3 * (time.perf_counter() - t0)

        run()
        out["ms"][n] = round(statistics.median(run() for _ in range(args.runs)), 2)
        print(f"prompt {n:5d} tokens: {out['ms'][n]:8.2f} ms to the first token", flush=True)
    out["shapes_compiled"] = llm.stats().get("shapes_compiled")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

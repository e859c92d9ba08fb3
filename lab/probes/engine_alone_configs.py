"""Issue 23: the engine alone (LLM.generate of a static batch, as benchmarks/serving.py's baseline) under one engine
config, to tell a config's share of a gap from the code's (wave 1's benchmark ran max_model_len = prompt + new tokens;
`jphoton serve` runs the defaults, 8192). Run once per config, each in its own process:

    python3 lab/probes/engine_alone_configs.py --model random:llama3.2-1b [--max-model-len 384] --concurrency 32 64
"""

from __future__ import annotations

import argparse
import json
import random
import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from benchmarks.common import timed_run
    from jphoton import LLM, EngineConfig, SamplingParams

    cfg = EngineConfig() if a.max_model_len is None else EngineConfig(max_model_len=a.max_model_len)
    llm = LLM(a.model, config=cfg)
    llm.wait_until_ready()
    rng = random.Random(1)
    for c in a.concurrency:
        prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(a.prompt_len)] for _ in range(c)]
        params = SamplingParams(max_tokens=a.new_tokens, temperature=0, ignore_eos=True)
        timed_run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        ms = [timed_run(llm, prompts, params).decode_ms_median for _ in range(a.rounds)]
        print("engine alone: " + json.dumps({"max_model_len": llm.max_model_len, "concurrency": c,
                                             "decode_ms": ms, "decode_tok_s": [round(c / (m / 1e3)) for m in ms]}),
              flush=True)


if __name__ == "__main__":
    main()

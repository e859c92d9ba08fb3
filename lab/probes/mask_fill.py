"""What one grammar mask costs outside the engine: llguidance matchers of benchmarks/constrained.py's JSON schema,
walked through three valid documents (SmolLM2 tokenizer, 49,152 tokens), mask time per state with one thread, then
32 matchers at mixed states filled at once by the default executor and by executors of 1, 2, 4, 8 and 16 threads
(issue 25: does the fill scale with threads?). Compare with the `mask` column of benchmarks/constrained.py, which
times the same fill inside the engine.

    python lab/probes/mask_fill.py [--tokenizer benchmarks/assets/smollm2-tokenizer] [--out FILE]
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import llguidance  # noqa: E402
import numpy as np  # noqa: E402
from llguidance.numpy import fill_next_token_bitmask_par  # noqa: E402

from benchmarks.constrained import SCHEMA  # noqa: E402
from jphoton.constrain.compiler import JSON_OPTIONS, mask_words  # noqa: E402
from jphoton.weights import load_tokenizer  # noqa: E402

DOCS = ['{"id":99999,"name":":","tags":["gamma"],"active":false,"address":{"city":":","zip":"99999"}}',
        '{"id":44444,"name":",:","tags":["beta"],"active":true,"address":{"city":",:","zip":"33333"}}',
        '{"id":123,"name":"abc def ghi","tags":["alpha","beta"],"active":true,"address":{"city":"Paris","zip":"75001"}}']
VOCAB = 49152


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", help="a tokenizer directory (default: the embedded model's)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.tokenizer:
        import pathlib

        from jphoton.text.tokenizer import Tokenizer

        tok = Tokenizer.from_hf_dir(pathlib.Path(a.tokenizer))
    else:
        tok = load_tokenizer(None)
    try:
        lltok = llguidance.LLTokenizer(tok.hf_json(), n_vocab=VOCAB, eos_token=[0])
    except TypeError:  # llguidance <= 1.6
        lltok = llguidance.LLTokenizer(tok.hf_json(), n_vocab=VOCAB, eos_token=0)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)
    mask = np.full((64, mask_words(VOCAB)), -1, np.int32)
    one = llguidance.LLExecutor(1)
    docs = [tok.encode(d, add_special_tokens=False) for d in DOCS]
    per_state = []
    for ids in docs:
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        for t in ids:
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fill_next_token_bitmask_par(one, [(m, 0)], mask)
                ts.append(time.perf_counter() - t0)
            per_state.append(1e6 * min(ts))
            assert m.consume_token(t), m.get_error()
    print(f"one mask, {len(per_state)} states: median {np.median(per_state):.1f} us, max {max(per_state):.1f} us")
    matchers = []
    for i in range(32):
        ids = docs[i % len(docs)]
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        for t in ids[: (7 * i) % (len(ids) - 1)]:
            m.consume_token(t)
        matchers.append(m)
    out = {"cpus": os.cpu_count(), "llguidance": getattr(llguidance, "__version__", "?"),
           "one_mask_us_median": float(np.median(per_state)), "fill_32_rows_ms": {}}
    executors = [("default", llguidance.LLExecutor())] + [(f"{n} threads", llguidance.LLExecutor(n))
                                                          for n in (1, 2, 4, 8, 16)]
    for name, ex in executors:
        ts = []
        for _ in range(50):
            t0 = time.perf_counter()
            fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(matchers)], mask)
            ts.append(time.perf_counter() - t0)
        out["fill_32_rows_ms"][name] = round(1e3 * float(np.median(ts)), 3)
        print(f"32 rows, executor {name}: median {1e3 * np.median(ts):.3f} ms, min {1e3 * min(ts):.3f} ms")
    # the rows one after another on this thread, as the lower bound of one core's work
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            fill_next_token_bitmask_par(one, [(m, i)], mask)
        ts.append(time.perf_counter() - t0)
    out["fill_32_rows_ms"]["serial calls"] = round(1e3 * float(np.median(ts)), 3)
    print(f"32 rows one call each (1 thread): median {1e3 * np.median(ts):.3f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""What one grammar mask costs outside the engine: llguidance matchers of benchmarks/constrained.py's JSON schema,
walked through three valid documents (SmolLM2 tokenizer, 49,152 tokens), mask time per state with one thread, then
32 matchers at mixed states filled at once by the default executor, a 1-thread and a 2-thread one. Compare with the
`mask` column of benchmarks/constrained.py, which times the same fill inside the engine.

    python lab/probes/mask_fill.py
"""

import json
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import llguidance  # noqa: E402
import numpy as np  # noqa: E402
from llguidance.numpy import fill_next_token_bitmask_par  # noqa: E402

from benchmarks.constrained import SCHEMA  # noqa: E402
from jphoton.constraints import JSON_OPTIONS, mask_words  # noqa: E402
from jphoton.weights import load_model  # noqa: E402

DOCS = ['{"id":99999,"name":":","tags":["gamma"],"active":false,"address":{"city":":","zip":"99999"}}',
        '{"id":44444,"name":",:","tags":["beta"],"active":true,"address":{"city":",:","zip":"33333"}}',
        '{"id":123,"name":"abc def ghi","tags":["alpha","beta"],"active":true,"address":{"city":"Paris","zip":"75001"}}']
VOCAB = 49152


def main() -> None:
    tok = load_model(None, None).tokenizer
    lltok = llguidance.LLTokenizer(tok.hf_json(), n_vocab=VOCAB, eos_token=[0])
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
    for name, ex in (("default", llguidance.LLExecutor()), ("1 thread", one), ("2 threads", llguidance.LLExecutor(2))):
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(matchers)], mask)
            ts.append(time.perf_counter() - t0)
        print(f"32 rows, executor {name}: median {1e3 * np.median(ts):.3f} ms")


if __name__ == "__main__":
    main()

"""Would checking the unconstrained token first pay? (issue 25: a grammar step fills a mask for every row.)

With a trained model (the embedded SmolLM2-135M-Instruct) asked for the constrained benchmark's JSON schema: how often
the greedy token of the *unconstrained* logits is the constrained greedy token (it is exactly when the grammar allows
it: then no mask is needed for that row and step), and what checking one token costs llguidance against filling a mask
at the same states. Teacher-forced: the unconstrained argmax at each position of a constrained output comes from a
one-token greedy generation on the prompt plus the output so far (prefix caching keeps it cheap).

    python lab/probes/grammar_speculation.py [--requests 6]
    python lab/probes/grammar_speculation.py --model random:smollm2-135m --tokenizer benchmarks/assets/smollm2-tokenizer
"""
import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import llguidance  # noqa: E402
import numpy as np  # noqa: E402
from llguidance.numpy import fill_next_token_bitmask  # noqa: E402

from benchmarks.constrained import SCHEMA  # noqa: E402
from jphoton import LLM, SamplingParams  # noqa: E402
from jphoton.constraints import JSON_OPTIONS, mask_words  # noqa: E402

PEOPLE = ["a baker from Lyon", "a retired pilot in Oslo", "a student in Kyoto", "a nurse from Lima",
          "a chess coach in Riga", "a beekeeper near Graz", "a chemist in Porto", "a DJ from Accra"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--model", default=None, help="default: the embedded model; random:smollm2-135m for random weights")
    ap.add_argument("--tokenizer", default=None, help="e.g. benchmarks/assets/smollm2-tokenizer (random weights)")
    a = ap.parse_args()
    llm = LLM(a.model, tokenizer=a.tokenizer, max_num_seqs=8, decode_buckets=(1, 8),
              prefill_buckets=((1, 64), (8, 64)), max_model_len=512)
    tok = llm.tokenizer
    schema = json.dumps(SCHEMA)
    prompts = [tok.encode_chat([{"role": "user", "content": f"Describe {p} as JSON with fields id, name, tags (alpha, "
                                                         f"beta, gamma, delta), active, address (city, zip)."}])
               for p in PEOPLE[:a.requests]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=160, temperature=0, json_schema=schema))
    prefixes, where = [], []
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        for k in range(len(o.token_ids)):
            prefixes.append({"prompt_token_ids": p + o.token_ids[:k]})
            where.append((i, k))
    free = llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0))
    lltok = llguidance.LLTokenizer(tok.hf_json(), n_vocab=llm.config.vocab_size, eos_token=tok.eos_token_id)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    mask = np.zeros((1, mask_words(llm.config.vocab_size)), np.int32)
    hits, check_us, fill_us, forced, differ = [], [], [], 0, 0
    matchers = {}
    for (i, k), f in zip(where, free, strict=True):
        m = matchers.setdefault(i, llguidance.LLMatcher(lltok, grammar, log_level=0))
        u, c = f.token_ids[0], outs[i].token_ids[k]
        t0 = time.perf_counter()
        ok = m.validate_tokens([u]) == 1
        t1 = time.perf_counter()
        fill_next_token_bitmask(m, mask, 0)
        t2 = time.perf_counter()
        allowed = int(np.unpackbits(mask.view(np.uint8)).sum())
        forced += allowed == 1
        hits.append(ok)  # allowed: the masked argmax too (up to near-ties between the two runs' numerics)
        differ += ok and u != c
        check_us.append(1e6 * (t1 - t0))
        fill_us.append(1e6 * (t2 - t1))
        assert m.consume_token(c)
    n = len(hits)
    print(f"{len(outs)} JSON outputs, {n} constrained steps (all valid: "
          f"{all(o.finish_reason == 'stop' for o in outs)})")
    print(f"unconstrained greedy token allowed by the grammar: {sum(hits)}/{n} = {sum(hits) / n:.1%} (of those, "
          f"{differ} differ from the constrained run's token: near-ties); steps with one allowed token: {forced} "
          f"({forced / n:.1%})")
    print(f"llguidance per row: check one token median {statistics.median(check_us):.1f} us (p90 "
          f"{np.percentile(check_us, 90):.1f}); fill a mask median {statistics.median(fill_us):.1f} us (p90 "
          f"{np.percentile(fill_us, 90):.1f}), on this host")
    for o in outs[:2]:
        print("  sample:", o.text)


if __name__ == "__main__":
    main()

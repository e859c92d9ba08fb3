"""One mask's cost at each state of real constrained outputs (the JSON samples of a benchmarks/constrained.py run),
by tokenizer slices and with/without the schema's string `maxLength` (issue 25: why the in-engine fill is slow).

    python lab/probes/mask_states.py CONSTRAINED_JSON [--tokenizer benchmarks/assets/smollm2-tokenizer]
"""
import argparse
import copy
import json
import pathlib
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import llguidance  # noqa: E402
import numpy as np  # noqa: E402
from llguidance.numpy import fill_next_token_bitmask_par  # noqa: E402

from benchmarks.constrained import SCHEMA  # noqa: E402
from jphoton.constraints import JSON_OPTIONS, mask_words  # noqa: E402
from jphoton.tokenizer import Tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", help="a constrained.json written by benchmarks/constrained.py (its JSON samples)")
    ap.add_argument("--tokenizer", default="benchmarks/assets/smollm2-tokenizer")
    a = ap.parse_args()
    tok = Tokenizer.from_hf_dir(pathlib.Path(a.tokenizer))
    base = llguidance.LLTokenizer(tok.hf_json(), n_vocab=49152, eos_token=[0])
    docs = [d for d in json.load(open(a.results))["samples"] if d.startswith("{")][:3]
    mask = np.full((64, mask_words(49152)), -1, np.int32)
    one = llguidance.LLExecutor(1)
    nomax = copy.deepcopy(SCHEMA)
    nomax["properties"]["name"].pop("maxLength")
    nomax["properties"]["address"]["properties"]["city"].pop("maxLength")
    json_tok = base.with_slices(llguidance.LLTokenizer.json_slices())
    for label, lltok, schema in [("general slices", base, SCHEMA), ("json slices", json_tok, SCHEMA),
                                 ("general, no maxLength", base, nomax), ("json slices, no maxLength", json_tok, nomax)]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        per = []
        for d in docs:
            m = llguidance.LLMatcher(lltok, grammar, log_level=0)
            for t in tok.encode(d, add_special_tokens=False):
                t0 = time.perf_counter()
                fill_next_token_bitmask_par(one, [(m, 0)], mask)
                per.append(1e6 * (time.perf_counter() - t0))
                m.consume_token(t)
        print(f"{label:28s} median {np.median(per):6.1f} us  p90 {np.percentile(per, 90):6.1f}  max {max(per):7.1f}  "
              f"sum {sum(per) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()

"""How long a device-automaton build holds the serving process's GIL (issue 25 follow-up): a thread that sleeps 1 ms in
a loop records its largest gap while a new JSON schema's automaton builds (`GrammarCompiler.compile(...,
wait_automaton=True)`, after a first constraint has initialised llguidance's tokenizer), and the time to unpickle the
child's index as outlines-core's dict of dicts (the transport before 2026-11-28) and as the flat arrays now.
`python3 lab/probes/automaton_gil.py` (CPU is enough: it measures the host)"""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])
sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/tests")

from schemas import PERSON  # noqa: E402

from jphoton import LLM, SamplingParams  # noqa: E402
from jphoton import automaton as A  # noqa: E402
from jphoton.json_regex import schema_to_regex  # noqa: E402


def largest_gap(fn) -> tuple[float, float]:
    gaps, stop = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join()
    return elapsed, max(gaps)


llm = LLM(warmup="off")
g = llm.grammar
g.compile(SamplingParams(regex="ab"), wait_automaton=True)  # llguidance's tokenizer and the vocabulary, once
for title in ("a", "b"):
    schema = json.dumps(dict(PERSON, title=title))
    s, gap = largest_gap(lambda schema=schema: g.compile(SamplingParams(json_schema=schema), wait_automaton=True))
    print(f"build of a new 5-field schema: {s:.2f} s, largest gap of a 1 ms ticker {1e3 * gap:.0f} ms", flush=True)
index = A.regex_index(schema_to_regex(PERSON), g.automata.vocab)
as_dict = {int(st): dict(zip(*(a.tolist() for a in index.edges(int(st))), strict=True)) for st in index.states}
for name, obj in (("dict of dicts", as_dict), ("arrays", (index.initial, index.states, index.offsets, index.tokens,
                                                            index.targets, index.finals))):
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    s, gap = largest_gap(lambda blob=blob: pickle.loads(blob))
    print(f"unpickle the index ({len(index.tokens):,} transitions) as {name}: {1e3 * s:.0f} ms, {len(blob) / 1e6:.1f} "
          f"MB, largest gap {1e3 * gap:.0f} ms", flush=True)

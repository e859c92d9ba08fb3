"""What device automata cost a filtered step that has none: the decode step's filtered variant (top-k / top-p sampler,
plus the automaton tables' mask and next-state gathers since issue 25's device automata) against the same variant of an
engine with automaton_states=0, and the plain step, in one process, rounds alternated. Prints one JSON line.

    python3 lab/probes/automaton_cost.py [--model random:llama3.2-1b] [--rows 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax

from jphoton import LLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    engines = {states: LLM(args.model, warmup="off", max_num_seqs=args.rows, decode_buckets=(args.rows,),
                           automaton_states=states, progress=False) for states in (1024, 0)}
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for states, llm in engines.items():
            for sampler in (None, "filtered"):
                key = f"automata={states} sampler={sampler or 'plain'}"
                times.setdefault(key, []).append(llm.device_step_ms(args.rows, context=512, steps=50, sampler=sampler))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows, "model": args.model,
           "ms": {k: round(statistics.median(v), 4) for k, v in times.items()},
           "rounds": {k: [round(x, 4) for x in v] for k, v in times.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

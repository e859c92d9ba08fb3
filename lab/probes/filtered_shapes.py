"""Device time of every step shape of the default engine, base program against its filtered variant (top-k / top-p
sampler and device automata; since issue 25's automata every shape has one), padding rows dispatched back to back.
Prints one JSON line.

    python3 lab/probes/filtered_shapes.py [--model random:llama3.2-1b:vocab=49152] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from jphoton import LLM


def timed(runner, shape, filtered: bool, steps: int) -> float:
    packed = jax.device_put(runner.layout(shape).empty(runner.static.trash_page)["_buffer"], runner._sharding)

    def run(n):
        for _ in range(n):
            runner._dispatch_into(runner._take_slot(), shape, packed, filtered=filtered)
        jax.block_until_ready(runner.kv)

    run(3)
    t0 = time.perf_counter()
    run(steps)
    return 1e3 * (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b:vocab=49152")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    llm = LLM(args.model, progress=False)
    llm.wait_until_ready()
    runner = llm.engine.runner
    rows = []
    for shape in runner.sched.all_shapes():
        base, filtered = timed(runner, shape, False, args.steps), timed(runner, shape, True, args.steps)
        rows.append(dict(shape=str(shape), base_ms=round(base, 4), filtered_ms=round(filtered, 4),
                         ratio=round(filtered / base, 3)))
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": args.model,
                      "rows": rows}))


if __name__ == "__main__":
    main()

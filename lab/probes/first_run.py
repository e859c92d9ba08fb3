"""A step program's first execution in a process costs more than later ones: how much, and does running each program
once at warm-up (`LLM.run_programs_once`, called by `wait_until_ready`) take it off the first requests?

Default `LLM()`, every shape compiled (`warmup.wait`), then each compiled program run once by hand, timed one by one
(the slowest printed), and a second pass over the same programs (the later cost); then the same free closed loop twice
at each stream count: tok/s and the longest launch-to-launch gaps with the step kind and rows. Before
`run_programs_once` existed, the first loop at 8 streams ran at 0.45x of the second (a 390 ms gap at a 2-row decode
step, 173 ms at the first prefill; H100, 2026-11-27).

    python lab/probes/first_run.py [--model random:llama3.2-1b] [--streams 8 32]
"""

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from benchmarks.common import closed_loop, device_info  # noqa: E402
from jphoton import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    a = ap.parse_args()
    print(device_info(), flush=True)
    t0 = time.perf_counter()
    llm = LLM(a.model)
    llm.warmup.wait()
    print(f"all shapes ready after {time.perf_counter() - t0:.1f} s", flush=True)
    runner = llm.engine.runner
    keys = [k for k in llm.warmup.ready_programs() if k not in runner.first_ran]
    first, second = {}, {}
    for times in (first, second):
        for key in keys:
            t = time.perf_counter()
            runner.first_run(key)
            times[key] = time.perf_counter() - t
    print(f"{len(keys)} programs (+{len(runner.first_ran) - len(keys)} run at start-up): first runs "
          f"{sum(first.values()):.2f} s in all, second runs {sum(second.values()):.3f} s", flush=True)
    for key in sorted(keys, key=first.get, reverse=True)[:8]:
        print(f"  {1e3 * first[key]:8.1f} ms first, {1e3 * second[key]:6.2f} ms second: {key}", flush=True)
    for n in a.streams:
        for attempt in (1, 2):
            r = closed_loop(llm, n, 3, seed=n, prompt_len=64)
            recs = r["timeline"]
            gaps = sorted(((b["t_launch"] - a_["t_launch"]) * 1e3, a_["kind"], a_["rows"], a_["step_id"])
                          for a_, b in zip(recs, recs[1:], strict=False))[::-1][:6]
            print(f"{n} streams, run {attempt}: {r['tok_s']:.0f} tok/s, {r['wall_s']:.3f} s, {len(recs)} steps, "
                  f"median period {r['period_ms']:.3f} ms; longest gaps (ms, kind, rows, step): "
                  f"{[(round(g, 1), k, rows, s) for g, k, rows, s in gaps]}", flush=True)


if __name__ == "__main__":
    main()

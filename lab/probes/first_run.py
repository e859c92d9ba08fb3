"""Does the first run of a step program after warm-up cost more than the later ones? (The constrained benchmark's
first free closed loop ran at 0.2-0.4x of the same loop later in the process, 2026-11-27.) Default `LLM()`, every
shape ready (`wait_until_ready`), then the same free closed loop twice at each stream count; prints tok/s and the
longest launch-to-launch gaps with the step kind and rows.

    python lab/probes/first_run.py [--model random:llama3.2-1b] [--streams 8 32]
"""

import argparse
import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from benchmarks.common import closed_loop, default_llm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    a = ap.parse_args()
    llm = default_llm(a.model, max(a.streams))
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

"""Does a decode step cost more when its rows' contexts are spread out (issue 23)? Under staggered arrivals the engine's
decode periods were 6.6% longer than in a static batch (lab/results/issue23_staggered_ticks_2026-11-26_h100.json:
1.451 vs 1.361 ms at C=32) although the mean context is the same (256 tokens): the paged decode kernel's programs
follow each row's own length, so a batch of unequal rows may leave SMs idle at the tail.

Device ms per decode step back to back (as Runner.time_decode_steps), C rows: every row at `--mean` tokens vs rows
spread evenly over [mean - spread, mean + spread]; for the kernel's default split count and the ones in --splits
(default_config patched before the engine compiles).

    python3 lab/probes/context_spread.py --model random:llama3.2-1b --rows 32 --out $OUT/spread.json
    python3 lab/probes/context_spread.py --model random:smollm2-135m:layers=2:vocab=4096 --rows 4 --steps 3  # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])


def _time(llm, contexts, steps) -> float:
    """Device ms per decode step of len(contexts) rows, row i attending over contexts[i] tokens (pages of its own)."""
    import jax
    import numpy as np

    from jphoton.engine.scheduler import StepShape

    runner = llm.engine.runner
    rows = len(contexts)
    shape = StepShape(rows, 0, 0, 0)
    views = runner.layout(shape).empty(runner.static.trash_page)
    ps = runner.static.page_size
    real = runner.static.trash_page
    base = 0
    for i, ctx in enumerate(contexts):
        pages = -(-ctx // ps)
        views["d_table"][i, :pages] = (base + np.arange(pages)) % real
        base += pages
        views["d_pos"][i] = ctx - 1
    packed = jax.device_put(views["_buffer"], runner.device)

    def run(n):
        for _ in range(n):
            slot = runner._take_slot()
            runner._dispatch_into(slot, shape, packed)
        jax.block_until_ready(runner.kv)

    run(3)
    t0 = time.perf_counter()
    run(steps)
    return 1e3 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--mean", type=int, default=256)
    ap.add_argument("--spread", type=int, default=128)
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import pallas_kernels.paged_decode_attention as pda
    from benchmarks.common import device_info
    from jphoton import LLM

    original = pda.default_config
    c, m, s = args.rows, args.mean, args.spread
    uniform = [m] * c
    spread = [round(m - s + 2 * s * i / max(c - 1, 1)) for i in range(c)]
    out = {"device": device_info(), "args": vars(args), "ms": {}}
    for splits in [None, *args.splits]:
        name = "default" if splits is None else f"splits{splits}"
        if splits is None:
            pda.default_config = original
        else:
            pda.default_config = lambda r, h, t, n=splits: dataclasses.replace(original(r, h, t), splits=n)
        llm = LLM(args.model, max_model_len=1024, max_num_seqs=c, decode_buckets=(c,), prefill_buckets=((1, 128),),
                  max_num_batched_tokens=c + 128, warmup="full", progress=False)
        cfg = pda.default_config(c, llm.config.num_kv_heads, 1024)
        res = {"config": dataclasses.asdict(cfg), "uniform": [], "spread": []}
        for _ in range(args.rounds):
            res["uniform"].append(_time(llm, uniform, args.steps))
            res["spread"].append(_time(llm, spread, args.steps))
        res["uniform_ms"] = statistics.median(res["uniform"])
        res["spread_ms"] = statistics.median(res["spread"])
        res["spread_over_uniform"] = res["spread_ms"] / res["uniform_ms"]
        out["ms"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k not in ("uniform", "spread")}), flush=True)
        del llm
    pda.default_config = original
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

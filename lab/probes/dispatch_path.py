"""Host time of the engine's own dispatch of a decode step (`Runner._dispatch_into`: a fresh host input each call, the
slots alternating, as in serving), with the device busy: for A/B of trees (PYTHONPATH=<tree>) in one device call. Calls
go in groups of 3 then a wait; medians of the 2nd and 3rd calls of each group (the device then still runs the 1st).
Rows attend over --ctx tokens of their own pages.

    python3 lab/probes/dispatch_path.py --rows 64 --rounds 3
    python3 lab/probes/dispatch_path.py --smoke   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton import LLM  # noqa: E402
from jphoton.engine.step import StepShape  # noqa: E402
from lab.common import decode_step_input  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--groups", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.rows, args.ctx, args.groups, args.rounds = "random:llama3.2-1b:layers=2:vocab=512", 2, 32, 3, 1
    pages = -(-args.ctx // 16)
    llm = LLM(args.model, max_model_len=pages * 16 + 16, max_num_seqs=args.rows, decode_buckets=(args.rows,),
              prefill_buckets=((1, 32),), warmup=False, num_kv_pages=args.rows * pages + 8, progress=False)
    runner = llm.engine.runner
    shape = StepShape(args.rows, 0, 0, 0)
    host = jax.device_get(decode_step_input(runner, shape, args.ctx))
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # (this thread only: runs differ by the core they land on)
    rounds = []
    for _ in range(args.rounds):
        busy = []
        for g in range(args.groups + 2):
            for i in range(3):
                packed = host.copy()
                t0 = time.perf_counter()
                runner._dispatch_into(runner._take_slot(), shape, packed)
                if g >= 2 and i:
                    busy.append(time.perf_counter() - t0)
            jax.block_until_ready(runner.kv)
        rounds.append(round(1e3 * statistics.median(busy), 4))
    print(json.dumps({"rows": args.rows, "busy_ms_by_round": rounds, "tree": sys.path[0]}))


if __name__ == "__main__":
    main()

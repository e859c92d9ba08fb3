"""Does the step's host dispatch pay for CUDA-graph updates? (issue 23: under a perfetto trace of the default engine at
64 rows, cuGraphLaunch was 0.3-0.4 ms and command_buffer::update 0.03-0.07 ms of a ~1.1 ms traced dispatch.)

XLA re-records a command buffer whenever a buffer it uses sits at a new address (CommandBufferThunk::ExecuteOnStream),
and the engine moves four every step: the two ping-pong slots' donated outputs (tokens, logits), the carried-over
tokens (the other slot) and the packed input (a fresh host->device buffer). Variants, each dispatching the engine's own
jitted decode step (runner._step, C rows) in groups of 3 calls then a wait, timing each call on the host:

  engine        slots alternate, packed input from the host each call (what the loop does)
  device_input  slots alternate, the same packed device array every call
  one_slot      outputs always slot 0, carried tokens always slot 1's (never written), packed from the host
  stable        one_slot with the same packed device array: no argument moves
  dispatch      the runner's own dispatch (`Runner._dispatch_into`) of a fresh host copy each call: for A/B of
                trees (PYTHONPATH=<tree>, `--variants dispatch --pin`)

Printed: median host ms of the 2nd/3rd calls of each group (the device busy with the 1st), and of the 1st.

    python3 lab/probes/graph_update.py --rows 64 --out $OUT/graph_update.json
    python3 lab/probes/graph_update.py --smoke      # CPU plumbing check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton import LLM  # noqa: E402
from jphoton.engine.step import StepShape  # noqa: E402
from lab.common import decode_step_input  # noqa: E402

VARIANTS = ("engine", "device_input", "one_slot", "stable", "dispatch")


def run(runner, shape, variant: str, dev_packed, host_packed, groups: int) -> dict:
    busy, idle = [], []
    fixed_prev = runner.slots[1].tokens
    for g in range(groups + 2):
        for i in range(3):
            if variant in ("one_slot", "stable"):
                slot, prev = runner.slots[0], fixed_prev
            else:
                slot, prev = runner.slots[runner._next_slot], runner._prev_tokens
            packed = dev_packed if variant in ("device_input", "stable") else host_packed
            if variant == "dispatch":
                packed = host_packed.copy()
                t0 = time.perf_counter()
                runner._dispatch_into(runner._take_slot(), shape, packed)
                if g >= 2:
                    (idle if i == 0 else busy).append(time.perf_counter() - t0)
                continue
            t0 = time.perf_counter()
            slot.tokens, slot.logits, runner.kv = runner._step(shape, runner.params, runner.kv, prev, slot.tokens,
                                                               slot.logits, packed, None, None, None)
            dt = time.perf_counter() - t0
            if variant not in ("one_slot", "stable"):
                runner._prev_tokens = slot.tokens
                runner._next_slot ^= 1
            if g >= 2:  # two warm groups
                (idle if i == 0 else busy).append(dt)
        jax.block_until_ready(runner.kv)
    return {"busy_ms": round(1e3 * statistics.median(busy), 4), "idle_ms": round(1e3 * statistics.median(idle), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--groups", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--pin", action="store_true", help="pin this thread to the last CPU (runs differ by their core)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.rows, args.ctx, args.groups, args.rounds = "random:llama3.2-1b:layers=2:vocab=512", 2, 32, 3, 1
    pages = -(-args.ctx // 16)
    llm = LLM(args.model, max_model_len=pages * 16 + 16, max_num_seqs=args.rows, decode_buckets=(args.rows,),
              prefill_buckets=((1, 32),), warmup=False, num_kv_pages=args.rows * pages + 8, progress=False)
    runner = llm.engine.runner
    shape = StepShape(args.rows, 0, 0, 0)
    dev_packed = decode_step_input(runner, shape, args.ctx)
    host_packed = np.asarray(jax.device_get(dev_packed))
    if args.pin:
        import os

        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows, "ctx": args.ctx,
           "rounds": []}
    for r in range(args.rounds):
        res = {v: run(runner, shape, v, dev_packed, host_packed, args.groups) for v in args.variants}
        print(r, json.dumps(res), flush=True)
        out["rounds"].append(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

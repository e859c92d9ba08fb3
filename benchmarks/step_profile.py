"""Where a step's time goes: host phases from the engine's telemetry, and the device step time measured back to back.

    python benchmarks/step_profile.py --model random:llama3.2-1b --batch 1 32 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import timed_run  # noqa: E402
from jphoton import LLM, SamplingParams  # noqa: E402


def med(xs):
    return 1e3 * statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--unroll", type=int, nargs="+", default=[1], help="1 = layers unrolled, 0 = lax.scan")
    args = ap.parse_args()
    maxb = max(args.batch)
    for depth, unroll in [(d, u) for u in args.unroll for d in args.depths]:
        t0 = time.perf_counter()
        llm = LLM(args.model, max_model_len=256, pipeline_depth=depth,
                  unroll_layers=bool(unroll), progress=False,
                  num_kv_pages=maxb * 16 + 8, max_num_seqs=maxb, decode_buckets=tuple(args.batch),
                  max_num_batched_tokens=1024, prefill_buckets=((8, 128),), context_buckets=(16,))
        print(f"unroll_layers={bool(unroll)} depth {depth}: start-up {time.perf_counter() - t0:.1f}s", flush=True)
        rng = np.random.default_rng(0)
        for b in args.batch:
            prompts = [rng.integers(0, llm.config.vocab_size, 128).tolist() for _ in range(b)]
            llm.engine.telemetry.clear()
            timed_run(llm, prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
            recs = [r for r in llm.engine.telemetry.records if r.kind == "decode"][4:]
            plan = [r.t_launch - r.t_plan for r in recs]
            dispatch = [r.t_launched - r.t_launch for r in recs]
            parts = {k: med([getattr(r, b) - getattr(r, a) for r in recs]) for k, a, b in (
                ("pack", "t_launch", "t_packed"), ("put", "t_packed", "t_put"), ("call", "t_put", "t_dispatched"),
                ("d2h", "t_dispatched", "t_launched"))}
            wait = [r.t_ready - r.t_commit for r in recs]
            commit = [r.t_committed - r.t_ready for r in recs]
            period = [b2.t_launch - a.t_launch for a, b2 in zip(recs, recs[1:], strict=False)]
            print(f"depth {depth} B={b}: plan+pack {med(plan):.3f} ms, dispatch {med(dispatch):.3f} ms, "
                  f"wait {med(wait):.3f} ms, commit {med(commit):.3f} ms, launch period {med(period):.3f} ms; launch "
                  + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()),
                  flush=True)
            # device-only: the same decode step dispatched back to back, no host work in between
            runner = llm.engine.runner
            shape = next(s for s in runner._layouts
                         if s.decode_rows == b and s.prefill_rows == 0 and s.ctx_pages <= 16)
            packed = runner.layout(shape).empty(runner.static.trash_page)["_buffer"]
            packed_dev = jax.device_put(packed, runner.device)
            for n in (3, 20):
                t0 = time.perf_counter()
                for _ in range(n):
                    slot = runner.slots[runner._next_slot]
                    slot.tokens, slot.logits, runner.kv = runner._step(
                        shape, runner.params, runner.kv, runner._prev_tokens, slot.tokens, slot.logits, packed_dev)
                    runner._prev_tokens = slot.tokens
                    runner._next_slot ^= 1
                jax.block_until_ready(runner.kv)
            print(f"   device step back to back (padding rows, short context): "
                  f"{1e3 * (time.perf_counter() - t0) / n:.3f} ms", flush=True)
        del llm


if __name__ == "__main__":
    main()

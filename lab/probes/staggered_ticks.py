"""Where the pipelined loop loses time under staggered arrivals (issue 23): the engine alone at depth 2 delivered
0.79-0.82x of its static batch at C=32 while the mixed steps' device time predicts ~0.88 (docs/decisions.md).

One engine (buckets narrowed to the run, or --default-engine), C static rows, then C closed-loop clients with
staggered starts (benchmarks/serving.py engine_staggered). For each step in the measured window, from the engine's
telemetry: host phases (plan, launch, commit work after the tokens landed), the commit's wait for the device, and the
launch-to-launch period; summarised by step kind and, under staggered arrivals, by whether a request arrived or
finished in the period (`EventClock`; with the period's time outside `Engine.step`). A tick whose
commit did not wait (wait < 20 us) found the device already done: the device idled for part of that tick.

    python3 lab/probes/staggered_ticks.py --model random:llama3.2-1b --concurrency 32 --out $OUT/ticks.json
    python3 lab/probes/staggered_ticks.py --model random:smollm2-135m:layers=2:vocab=4096 --concurrency 4 \
        --new-tokens 16 --prompt-len 32   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton.engine.measure import BubbleClock, EventClock, GcClock  # noqa: E402

NO_WAIT_S = 20e-6


def summarise(records, lo: float, hi: float, events: EventClock | None = None) -> dict:
    recs = sorted((r for r in records if lo <= r.t_launch <= hi), key=lambda r: r.t_launch)
    out: dict = {}
    for prev, r in zip(recs, recs[1:], strict=False):
        phases = {"period": r.t_launched - prev.t_launched, "plan": r.t_planned - r.t_plan,
                  "launch": r.t_launched - r.t_launch, "wait": r.t_ready - r.t_commit,
                  "commit_work": r.t_committed - r.t_ready}
        groups = [r.kind, "all"]
        if events is not None:  # (the events of the period that ends at this step's launch)
            tag, phases["outside_step"] = events.tag(prev.t_launched, r.t_launched)
            groups.append(f"{r.kind}.{tag}")
        for g in groups:
            d = out.setdefault(g, {k: [] for k in phases} | {"no_wait": 0, "n": 0, "rows": {}})
            d["rows"][r.rows] = d["rows"].get(r.rows, 0) + 1
            for k, v in phases.items():
                d[k].append(1e3 * v)
            d["n"] += 1
            d["no_wait"] += phases["wait"] < NO_WAIT_S
    return {g: {"n": d["n"], "no_wait": d["no_wait"], "rows": dict(sorted(d["rows"].items())),
                **{f"{k}_ms_mean": statistics.fmean(v) for k, v in d.items() if isinstance(v, list) and v},
                **{f"{k}_ms_p50": statistics.median(v) for k, v in d.items() if isinstance(v, list) and v},
                **{f"{k}_ms_p90": sorted(v)[int(0.9 * (len(v) - 1))] for k, v in d.items() if isinstance(v, list) and v}}
            for g, d in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--depths", type=int, nargs="+", default=[2])
    ap.add_argument("--default-engine", action="store_true",
                    help="the default engine (all buckets, as benchmarks/serving.py builds it) instead of narrowed ones")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pin", type=int, default=None, help="pin the engine thread to this CPU once the LLM is built")
    ap.add_argument("--mark", default=None, help="create this file when the timed runs start (lab/probes/thread_cpu.py)")
    ap.add_argument("--gc-threshold", type=int, nargs=3, default=None, help="gc.set_threshold for the timed runs")
    from benchmarks.llm_args import add_llm_args, parse_llm_args
    add_llm_args(ap)
    args = ap.parse_args()
    extra = parse_llm_args(args.llm_args)
    from benchmarks.common import default_llm, device_info, timed_run
    from benchmarks.serving import engine_staggered
    from jphoton import LLM, SamplingParams

    c = args.concurrency
    out = {"device": device_info(), "args": vars(args), "runs": {}}
    rng = random.Random(1)
    for depth in args.depths:
        if args.default_engine:
            llm = default_llm(args.model, pipeline_depth=depth, progress=False, **extra)
        else:
            llm = LLM(args.model, **{"pipeline_depth": depth, "max_model_len": 1024, "max_num_seqs": c,
                                     "decode_buckets": (c,), "prefill_buckets": ((1, args.prompt_len), (4, args.prompt_len)),
                                     "max_num_batched_tokens": c + 4 * args.prompt_len, "warmup": "full",
                                     "progress": False, **extra})
        if args.pin is not None:  # (threads jax started already keep every CPU)
            import os

            os.sched_setaffinity(0, {args.pin})
        vocab = llm.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(c * args.requests_per_client)]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        timed_run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        llm.telemetry.clear()
        if args.mark:
            open(args.mark, "w").close()
        if args.gc_threshold:
            import gc

            gc.set_threshold(*args.gc_threshold)
        clock = GcClock()
        bubbles = BubbleClock(llm.engine)
        t0 = time.perf_counter()
        r = timed_run(llm, prompts[:c], params)
        static = summarise(llm.telemetry.records, t0, time.perf_counter())
        static["bubbles"] = bubbles.summary(t0, time.perf_counter())
        gc_static = clock.take()
        duration = r.decode_ms_median / 1e3 * args.new_tokens
        events = EventClock(llm.engine)
        st = engine_staggered(llm, prompts, args.new_tokens, c, args.requests_per_client, duration)
        gc_staggered = clock.take()
        recs = list(llm.telemetry.records)
        # engine_staggered's window: from the last start to the first client running out (its own numbers)
        lo = recs[0].t_launch + duration * (c - 1) / c
        staggered = summarise(recs, lo, lo + st["window_s"], events)
        staggered["bubbles"] = bubbles.summary(lo, lo + st["window_s"])
        res = {"static_tok_s": c / (r.decode_ms_median / 1e3), "staggered_tok_s": st["decode_tok_s"],
               "ratio": st["decode_tok_s"] / (c / (r.decode_ms_median / 1e3)), "static": static,
               "staggered": staggered, "device_step_ms": llm.device_step_ms(c, context=args.prompt_len + 128),
               "gc_static": gc_static, "gc_staggered": gc_staggered}
        out["runs"][f"depth{depth}"] = res
        print(json.dumps({"depth": depth, "bubbles": {"static": static["bubbles"], "staggered": staggered["bubbles"]},
                          "ratio": res["ratio"], "static_tok_s": res["static_tok_s"],
                          "staggered_tok_s": res["staggered_tok_s"], "gc_static": gc_static,
                          "gc_staggered": gc_staggered, "device_step_ms": res["device_step_ms"],
                          **{f"{w}.{k}": {m: round(v[m], 3) for m in ("period_ms_mean", "plan_ms_mean",
                                                                      "launch_ms_mean", "wait_ms_mean",
                                                                      "commit_work_ms_mean", "outside_step_ms_mean")
                                          if m in v} | {"n": v["n"],
                                                                                                  "no_wait": v["no_wait"],
                                                                                                  "rows": v["rows"]}
                             for w, s in (("static", static), ("staggered", staggered)) for k, v in s.items()
                             if k != "bubbles"}}),
              flush=True)
        del llm
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

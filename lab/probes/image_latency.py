"""Where an image query's latency goes: the host's decode and crops, then each engine step of the request (planned,
launched, its tokens on the host) from the telemetry, then the device kernels of one query under jax.profiler.

    python lab/probes/image_latency.py --model random:moondream2 --runs 4
    python lab/probes/image_latency.py --smoke     # tiny random checkpoint on the CPU: the plumbing, not the numbers
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from benchmarks.moondream import jpeg, tiny_checkpoint  # noqa: E402


def one_query(llm, image: bytes, question: str, params) -> dict:
    """Prepare (decode + crops) and run one query to its end; the request's steps from the telemetry, in ms since
    the request was queued."""
    t0 = time.perf_counter()
    seq = llm.prepare_skill("query", image, question, params)
    t1 = time.perf_counter()
    llm.add_request(seq)
    first = None
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.delta.token_ids and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    ms = lambda t: round(1e3 * (t - t1), 2) if t else None  # noqa: E731
    steps = [dict(kind=r.kind, rows=r.rows, tokens=r.tokens, plan=ms(r.t_plan), launch=ms(r.t_launch),
                  launched=ms(r.t_launched), ready=ms(r.t_ready), committed=ms(r.t_committed))
             for r in llm.engine.telemetry.records if r.t_plan >= t1]
    return dict(prepare_ms=round(1e3 * (t1 - t0), 2), first_token_ms=ms(first), end_ms=ms(end), steps=steps[:4],
                n_steps=len(steps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:moondream2")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--size", type=int, default=378)
    ap.add_argument("--options", default="{}", help="LLM(...) keywords as JSON")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--vision-attention", default=None, help="force models/moondream_vision.py vision_attention (xla, cudnn)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    options = json.loads(args.options)
    if args.smoke:
        args.model, args.runs, args.tokens, args.size = tiny_checkpoint(), 1, 3, 200
        options = {"max_num_seqs": 2, "max_num_batched_tokens": 1024, "dtype": "float32", "warmup": "off", **options}

    import jax

    from benchmarks.kernel_profile import device_events
    from jphoton import LLM, SamplingParams

    if args.vision_attention:
        import jphoton.api as api

        family = api.moondream_family
        api.moondream_family = lambda *a, **k: family(*a, **{**k, "vision_attention": args.vision_attention})
    llm = LLM(args.model, progress=False, **options)
    llm.wait_until_ready()
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    question = "what is in this picture and why is it there"
    one_query(llm, jpeg(100, args.size), question, params)  # (warm)
    for i in range(args.runs):
        print(json.dumps(dict(run=i, **one_query(llm, jpeg(200 + i, args.size), question, params))), flush=True)
    print(json.dumps(dict(run="repeat", **one_query(llm, jpeg(200, args.size), "and what else", params))), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        q = one_query(llm, jpeg(300, args.size), question, params)
        jax.profiler.stop_trace()
        totals, _, events = device_events(tmp)
    kernels = totals["kernels"]
    busy = sum(kernels.values()) / 1e6
    span = (events[-1][0] + events[-1][1] - events[0][0]) / 1e6 if events else 0.0
    print(json.dumps(dict(run="profiled", first_token_ms=q["first_token_ms"], end_ms=q["end_ms"],
                          device_busy_ms=round(busy, 2), device_span_ms=round(span, 2), kernels=len(events))))
    for name, ns in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {ns / 1e6:8.3f} ms  {name[:120]}")
    # the device's busy stretches (kernels less than 0.1 ms apart): the vision step, the prefill, the decode steps
    bursts, t_end = [], None
    for start, dur, name in events:
        if t_end is None or start - t_end > 100_000:
            bursts.append([start, 0, 0, collections.Counter()])
        bursts[-1][1] += dur
        bursts[-1][2] = start + dur - bursts[-1][0]
        bursts[-1][3][name] += dur
        t_end = start + dur if t_end is None else max(t_end, start + dur)
    t0 = events[0][0] if events else 0
    print(json.dumps([dict(at_ms=round((b[0] - t0) / 1e6, 2), busy_ms=round(b[1] / 1e6, 3), span_ms=round(b[2] / 1e6, 3))
                      for b in bursts[:12]]))
    for b in sorted(bursts, key=lambda b: -b[1])[:2]:  # the two longest: the vision step and the image's prefill
        print(f"burst at {(b[0] - t0) / 1e6:.2f} ms, {b[1] / 1e6:.3f} ms busy in {sum(1 for _ in b[3])} names:")
        for name, ns in b[3].most_common(args.top):
            print(f"  {ns / 1e6:8.3f} ms  {name[:120]}")
    return 0


if __name__ == "__main__":
    main()

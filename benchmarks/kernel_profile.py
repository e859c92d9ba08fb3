"""Where the device time of one engine decode step goes, kernel by kernel (issue 8: "profile the decode step").

Runs the engine's own decode step (the serving path, same buckets and options) back to back through
`LLM.device_step_ms` under `jax.profiler`, reads the trace back with `jax.profiler.ProfileData` (no TensorBoard needed)
and sums the device events per kernel name, per step; and prints one step's kernels in order with the gaps between.

    python benchmarks/kernel_profile.py --model random:llama3.2-1b --rows 2 32 --ctx 512 --out /tmp/prof.json
    python benchmarks/kernel_profile.py --smoke        # tiny model on the CPU: checks the plumbing, not the numbers
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

import jax

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import QUICK, device_info, write_json  # noqa: E402
from benchmarks.llm_args import parse_llm_args  # noqa: E402
from jphoton import LLM  # noqa: E402


def device_events(trace_dir: str, plane_prefix: str = "/device:GPU"
                  ) -> tuple[dict[str, dict[str, float]], list[str], list[tuple[int, int, str]]]:
    """Nanoseconds per name, summed over the trace: {"ops": XLA op spans, "kernels": stream events} on GPU planes (on
    the CPU, the XLA client thread's events under both keys, enough to test the plumbing), the line names seen, and
    every kernel event as (start ns, duration ns, name) in time order. plane_prefix: which GPUs' planes (a
    tensor-parallel step runs on several: "/device:GPU:0" keeps the first one's)."""
    from jax.profiler import ProfileData

    [path] = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(path)
    totals: dict[str, dict[str, float]] = {"ops": collections.defaultdict(float),
                                           "kernels": collections.defaultdict(float)}
    lines_seen, kernel_events = [], []
    for plane in data.planes:
        gpu = plane.name.startswith(plane_prefix)
        if not (gpu or plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            lines_seen.append(f"{plane.name}:{line.name}")
            if gpu:
                kinds = ["ops"] if line.name == "XLA Ops" else ["kernels"] if "Stream" in line.name else []
            else:
                kinds = ["ops", "kernels"] if line.name.startswith("tf_XLAPjRtCpuClient") else []
            for ev in line.events:
                if ev.duration_ns <= 0 or "ThreadpoolListener" in ev.name:
                    continue
                for kind in kinds:
                    totals[kind][ev.name] += ev.duration_ns
                if "kernels" in kinds:
                    kernel_events.append((int(ev.start_ns), int(ev.duration_ns), ev.name))
    return totals, lines_seen, sorted(kernel_events)


def one_step_timeline(events: list[tuple[int, int, str]], steps: int) -> list[dict]:
    """The kernels of one step (from `steps` back-to-back steps), in order, with the idle gap before each: where launch
    latency and tiny kernels sit, which sums per name hide. Steps are cut at the occurrences of the earliest kernel
    name that occurs exactly `steps` times (a trace also holds copies and other events, so the event count need not
    split evenly); the middle cut is returned."""
    counts = collections.Counter(name for _, _, name in events)
    anchor = next((name for _, _, name in events if counts[name] == steps), None)
    if anchor is None or steps < 2:
        return []
    cuts = [i for i, (_, _, name) in enumerate(events) if name == anchor]
    k = len(cuts) // 2 - 1
    step = events[cuts[k]:cuts[k + 1]]
    out, prev_end = [], step[0][0]
    for start, dur, name in step:
        out.append(dict(name=name, us=dur / 1e3, gap_us=max(0, start - prev_end) / 1e3))
        prev_end = max(prev_end, start + dur)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 32], help="decode rows of the profiled steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512, help="tokens of context per decode row")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeline", type=int, default=60, help="kernels of one step printed in order")
    ap.add_argument("--llm-args", default="", help="extra LLM keyword arguments as k=v,k=v (python literals)")
    ap.add_argument("--lora-rows", type=int, default=0,
                    help="rows on LoRA slots (the LoRA variant; pass max_loras / max_lora_rank in --llm-args)")
    ap.add_argument("--plane", default="/device:GPU", help="GPU planes read (/device:GPU:0: the first GPU only)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.rows, args.steps, args.ctx = "random:smollm2-135m:layers=2", [2], 3, 64
    if QUICK:
        args.rows, args.steps = args.rows[:1], 5
    extra = parse_llm_args(args.llm_args)
    info = device_info()
    print(info, flush=True)
    pages = -(-max(args.ctx, 256) // 16)
    rows_max = max(args.rows)
    llm = LLM(args.model, **{**dict(max_model_len=pages * 16, pipeline_depth=2, max_num_seqs=rows_max,
                                    decode_buckets=tuple(sorted(set(args.rows))), prefill_buckets=((1, 16),),
                                    max_num_batched_tokens=rows_max + 16, num_kv_pages=rows_max * pages + 8,
                                    progress=False, warmup=False), **extra})
    rows = []
    for d in args.rows:
        lora = min(args.lora_rows, d)
        llm.device_step_ms(d, context=args.ctx, steps=3, lora_rows=lora)  # compile + warm
        ms = llm.device_step_ms(d, context=args.ctx, steps=args.steps, lora_rows=lora)
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp)
            llm.device_step_ms(d, context=args.ctx, steps=args.steps, lora_rows=lora)
            jax.profiler.stop_trace()
            totals, lines, events = device_events(tmp, args.plane)
        row = dict(decode_rows=d, context=args.ctx, ms_per_step=ms)
        print(f"\n== decode rows {d}, context {args.ctx}: {ms:.3f} ms/step back to back", flush=True)
        for kind in ("ops", "kernels"):
            per_step = {k: v / args.steps / 1e3 for k, v in totals[kind].items()}  # us per step
            busy = sum(per_step.values())
            top = sorted(per_step.items(), key=lambda kv: -kv[1])[:args.top]
            print(f"  {kind}: {busy / 1e3:.3f} ms/step in {len(per_step)} names", flush=True)
            if not per_step:
                print("   none found; trace lines:", lines[:20])
            for name, us in top:
                print(f"   {us:9.1f} us  {us / busy:6.1%}  {name[:110]}")
            # every kernel is kept in the JSON (the printout shows --top): the tail is where launch overhead hides
            row[kind] = dict(busy_us=busy, count=len(per_step), top=dict(top),
                             all=dict(sorted(per_step.items(), key=lambda kv: -kv[1])))
        timeline = one_step_timeline(events, args.steps)
        row["timeline"] = timeline
        if timeline:
            span = sum(e["us"] + e["gap_us"] for e in timeline)
            print(f"  one step: {len(timeline)} kernels, {sum(e['us'] for e in timeline):.1f} us busy, "
                  f"{sum(e['gap_us'] for e in timeline):.1f} us of gaps, {span:.1f} us span; the first "
                  f"{args.timeline} in order (gap before, duration):")
            for e in timeline[:args.timeline]:
                print(f"   +{e['gap_us']:5.1f} {e['us']:7.1f} us  {e['name'][:100]}")
        else:
            print(f"  one step: no kernel name occurs once per step in {len(events)} events")
        rows.append(row)
    if args.out:
        write_json(args.out, {"info": info, "model": args.model, "llm_args": extra, "rows": rows})
    return rows


if __name__ == "__main__":
    main()

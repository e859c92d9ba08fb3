"""Where the device time of one engine step goes, kernel by kernel (issue 8: "profile the decode step").

Runs the engine's own jitted step (the serving path, same buckets and options) back to back under `jax.profiler`,
reads the trace back with `jax.profiler.ProfileData` (no TensorBoard needed) and sums the device events per kernel
name, per step. Several step shapes in one run, so a decode step and a mixed decode+prefill step can be compared.

    python benchmarks/kernel_profile.py --model random:llama3.2-1b --shapes 1:0 32:0 32:64 --out /tmp/prof.json
    python benchmarks/kernel_profile.py --smoke        # tiny model on the CPU: checks the plumbing, not the numbers

A shape is DECODE_ROWS:PREFILL_TOKENS (one prefill row of that many tokens; 0 = a pure decode step).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

import jax

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import decode_step_input, device_info, steps_back_to_back, write_json  # noqa: E402
from jphoton import LLM  # noqa: E402
from jphoton.engine.step import StepShape  # noqa: E402


def run_steps(runner, shape: StepShape, n: int, context: int) -> float:
    """n steps of `shape` back to back, decode rows attending over `context` tokens each; seconds per step."""
    return steps_back_to_back(runner, shape, decode_step_input(runner, shape, context if not shape.prefill_rows else 0), n)


def compiled_text(runner, shape: StepShape) -> str:
    """The optimized HLO of the step that `run_steps` runs (same arguments, so the same executable)."""
    packed = decode_step_input(runner, shape)
    slot = runner.slots[runner._next_slot]
    return runner._step.lower(shape, runner.params, runner.kv, runner._prev_tokens, slot.tokens, slot.logits,
                              packed).compile().as_text()


def device_events(trace_dir: str) -> tuple[dict[str, dict[str, float]], list[str], list[tuple[int, int, str]]]:
    """Nanoseconds per name, summed over the trace: {"ops": XLA op spans, "kernels": stream events} on GPU planes (on
    the CPU, the XLA client thread's events under both keys, enough to test the plumbing), the line names seen, and
    every kernel event as (start ns, duration ns, name) in time order."""
    from jax.profiler import ProfileData

    [path] = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(path)
    totals: dict[str, dict[str, float]] = {"ops": collections.defaultdict(float),
                                           "kernels": collections.defaultdict(float)}
    lines_seen, kernel_events = [], []
    for plane in data.planes:
        gpu = plane.name.startswith("/device:GPU")
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


def fusion_bodies(hlo: str, names: list[str], max_lines: int = 12) -> dict[str, str]:
    """For each kernel name (an XLA fusion's instruction name with '.' written '_'), the fusion's instruction line and
    the first lines of the computation it calls: what a kernel called `input_reduce_fusion_35` actually computes."""
    out = {}
    for name in names:
        m = re.search(r"^\s*(?:ROOT )?%?(" + re.escape(name).replace("_", "[._]") + r") = (.*)$", hlo, re.M)
        if not m:
            continue
        text = m.group(0).strip()[:600]
        called = re.search(r"calls=%?([\w.\-]+)", m.group(2))
        if called:
            body = re.search(r"^%?" + re.escape(called.group(1)) + r" .*?\{\n(.*?)^\}", hlo, re.M | re.S)
            if body:
                text += "\n" + "\n".join(line[:300] for line in body.group(1).splitlines()[:max_lines])
        out[name] = text
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--shapes", nargs="+", default=["1:0", "32:0", "32:64"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512, help="tokens of context per decode row (pure decode shapes)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeline", type=int, default=60, help="kernels of one step printed in order")
    ap.add_argument("--llm-args", default="", help="extra LLM keyword arguments as k=v,k=v (python literals)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.shapes, args.steps, args.ctx = "random:smollm2-135m:layers=2", ["2:0", "2:16"], 3, 64
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes]
    decode = tuple(sorted({d for d, _ in shapes if d}))
    prefill = tuple(sorted({(1, t) for _, t in shapes if t})) or ((1, 16),)
    extra = {}
    for kv in filter(None, args.llm_args.split(",")):
        k, v = kv.split("=", 1)
        extra[k] = eval(v, {})  # noqa: S307 - a benchmark's own command line
    info = device_info()
    print(info, flush=True)
    pages = -(-max(args.ctx, 256) // 16)
    llm = LLM(args.model, max_model_len=pages * 16, pipeline_depth=2, max_num_seqs=max(decode or (1,)),
              decode_buckets=decode or (1,), prefill_buckets=prefill,
              max_num_batched_tokens=max(decode or (1,)) + max(t for _, t in prefill),
              num_kv_pages=max(decode or (1,)) * pages + 8, progress=False, **extra)
    runner = llm.engine.runner
    rows = []
    for d, t in shapes:
        shape = next((s for s in runner._layouts if s.decode_rows == d and s.prefill_tokens == t
                      and s.prefill_rows == (1 if t else 0)), None)
        if shape is None:  # a decode shape below the engine's smallest bucket (e.g. B=1 where the matmul wants 2 rows)
            shape = StepShape(d, 0, 0, 0 if runner.static.pallas_decode else pages)
            runner.layout(shape)
        run_steps(runner, shape, 3, args.ctx)
        hlo = compiled_text(runner, shape)
        wall = run_steps(runner, shape, args.steps, args.ctx)
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp)
            run_steps(runner, shape, args.steps, args.ctx)
            jax.profiler.stop_trace()
            totals, lines, events = device_events(tmp)
        row = dict(decode_rows=d, prefill_tokens=t, ms_per_step=1e3 * wall)
        print(f"\n== decode rows {d}, prefill tokens {t} ({shape}): {1e3 * wall:.3f} ms/step back to back", flush=True)
        for kind in ("ops", "kernels"):
            per_step = {k: v / args.steps / 1e3 for k, v in totals[kind].items()}  # µs per step
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
        kernels = list(row["kernels"]["all"])[:args.top]
        kernels += [e["name"] for e in timeline[:args.timeline] if e["name"] not in kernels]
        row["fusions"] = fusion_bodies(hlo, kernels)
        for name in kernels[:6]:
            print(f"\n  -- {name}:\n" + row["fusions"].get(name, "(not found in the compiled HLO)"), flush=True)
        rows.append(row)
    if args.out:
        write_json(args.out, {"info": info, "model": args.model, "attention": llm.attention, "rows": rows})


if __name__ == "__main__":
    main()

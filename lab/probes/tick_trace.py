"""Where a pipelined tick's host time goes, below Python (issue 23: at 64 rows under staggered arrivals the loop is
host-bound on the H200 host: plan 0.48-0.53, launch 0.65-0.70, commit 0.20 ms against a 1.39 ms device step, and the
leaf-count probe explains only ~0.15 ms of the launch).

The default engine (or narrowed buckets), a static batch of C and then C staggered closed-loop clients
(benchmarks/serving.py engine_staggered), each under `jax.profiler.trace(..., create_perfetto_trace=True)`. The engine's
host phases are wrapped in `jax.profiler.TraceAnnotation`s (plan, pack, launch, dispatch, copy_to_host, commit, fetch),
so that the trace holds them beside PjRt's own host events (argument parsing, input handling, host->device copies,
output allocation, ...) and the GPU's activity. Printed per scenario: how busy the GPU was between the first and the
last launch (its idle gaps per launch), each phase's median and mean ms per call, and for the phases `--inside` the
self time of the events nested in them (same thread; Python functions too, unless --python-tracer 0), by ms per call
of the phase. The profiler slows every event a little:
compare the parts with each other and static with staggered, not with untraced timings.

    python3 lab/probes/tick_trace.py --default-engine --concurrency 64 --out $OUT/tick_trace.json
    python3 lab/probes/tick_trace.py --model random:smollm2-135m:layers=2:vocab=4096 --concurrency 4 --new-tokens 16 \
        --prompt-len 32   # CPU smoke
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import glob
import gzip
import json
import statistics
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from lab.common import add_staggered_args, staggered_setup  # noqa: E402

PHASES = {  # annotation name: (object path on the LLM, method name)
    "plan": ("engine", "_plan"),
    "pack": ("engine.runner", "pack"),
    "launch": ("engine", "_launch"),
    "dispatch": ("engine.runner", "_dispatch_into"),
    "copy_to_host": ("engine.runner", "_copy_to_host"),
    "commit": ("engine", "_commit"),
    "fetch": ("engine.runner", "fetch"),
}


def annotate(llm) -> None:
    import jax

    for name, (path, method) in PHASES.items():
        obj = functools.reduce(getattr, path.split("."), llm)
        fn = getattr(obj, method)

        def wrapped(*a, _fn=fn, _name=name, **k):
            with jax.profiler.TraceAnnotation(_name):
                return _fn(*a, **k)

        setattr(obj, method, wrapped)


def events(trace_dir: str) -> tuple[list[dict], list[dict]]:
    """(host events, device events): complete events, split by their process's name (a GPU's lanes)."""
    path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        d = json.load(f)
    evs = d["traceEvents"] if isinstance(d, dict) else d
    gpu = {e["pid"] for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    done = [e for e in evs if e.get("ph") == "X" and "dur" in e]
    return [e for e in done if e["pid"] not in gpu], [e for e in done if e["pid"] in gpu]


def device_idle(host: list[dict], device: list[dict]) -> dict:
    """How busy the GPU was between the first and the last step launch: the union of its activity's intervals, and the
    gaps in it (idle stretches over 5 us) per launch."""
    launches = sorted(e["ts"] for e in host if e["name"] == "launch")
    if len(launches) < 2 or not device:
        return {}
    lo, hi = launches[0], launches[-1]
    spans = sorted((max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in device if e["ts"] + e["dur"] > lo
                   and e["ts"] < hi)
    busy, gaps, end = 0.0, [], lo
    for a, b in spans:
        if a > end:
            if a - end > 5:
                gaps.append(a - end)
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    n = len(launches) - 1
    return {"window_ms": (hi - lo) / 1e3, "busy_fraction": busy / (hi - lo), "ms_per_launch": (hi - lo) / 1e3 / n,
            "idle_ms_per_launch": sum(gaps) / 1e3 / n, "gaps_over_5us_per_launch": len(gaps) / n,
            "gap_us_p50": statistics.median(gaps) if gaps else 0.0, "gap_us_p90": sorted(gaps)[int(0.9 * (len(gaps) - 1))]
            if gaps else 0.0}


def self_times(evs: list[dict]) -> list[tuple[dict, float]]:
    """Each event with its self time in ms (its duration less its direct children's, on its thread)."""
    out = []
    per_tid = collections.defaultdict(list)
    for e in evs:
        per_tid[e["tid"]].append(e)
    for tid_evs in per_tid.values():
        tid_evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, children's time]
        for e in tid_evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                done, kids = stack.pop()
                out.append((done, (done["dur"] - kids) / 1e3))
            if stack:
                stack[-1][1] += e["dur"]
            stack.append([e, 0.0])
        out += [(done, (done["dur"] - kids) / 1e3) for done, kids in stack]
    return out


def summarise(evs: list[dict], inside: list[str], top: int) -> dict:
    """Per phase: calls, median and mean ms; for the phases in `inside`, the self time of every event nested in them
    (Python functions and PjRt's host events alike), by name, in ms per call of the phase."""
    by_name = collections.defaultdict(list)
    for e in evs:
        by_name[e["name"]].append(e)
    out = {}
    for name in PHASES:
        ds = [e["dur"] / 1e3 for e in by_name.get(name, [])]
        if ds:
            out[name] = {"calls": len(ds), "ms_median": statistics.median(ds), "ms_mean": statistics.fmean(ds)}
    selfs = self_times(evs)
    for outer in inside:
        spans = sorted(by_name.get(outer, []), key=lambda e: e["ts"])
        if not spans:
            continue
        starts = [e["ts"] for e in spans]
        total = collections.Counter()
        for e, ms in selfs:
            i = bisect.bisect_right(starts, e["ts"]) - 1
            if i >= 0 and e["tid"] == spans[i]["tid"] and e["ts"] + e["dur"] <= spans[i]["ts"] + spans[i]["dur"]:
                total[e["name"]] += ms
        out[outer]["self_ms_per_call"] = {k: round(v / len(spans), 4) for k, v in total.most_common(top)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_staggered_args(ap)
    ap.add_argument("--inside", nargs="+", default=["dispatch", "launch", "fetch", "plan"])
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--python-tracer", type=int, default=1, help="0: PjRt's host events and the phases only")
    args = ap.parse_args()
    import jax

    from benchmarks.common import device_info, timed_run
    from benchmarks.serving import engine_staggered

    c = args.concurrency
    llm, prompts, params, duration = staggered_setup(args)  # (every path run once)
    engine_staggered(llm, prompts, args.new_tokens, c, args.requests_per_client, duration)
    annotate(llm)
    result = {"device": device_info(), "args": vars(args), "scenarios": {}}
    for scenario in ("static", "staggered"):
        with tempfile.TemporaryDirectory() as d:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = args.python_tracer
            with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=options):
                if scenario == "static":
                    timed_run(llm, prompts[:c], params)
                else:
                    engine_staggered(llm, prompts, args.new_tokens, c, args.requests_per_client, duration)
            host, device = events(d)
            result["scenarios"][scenario] = summarise(host, args.inside, args.top)
            result["scenarios"][scenario]["device"] = device_idle(host, device)
    for scenario, s in result["scenarios"].items():
        print(f"== {scenario}")
        print(f"  device: {json.dumps({k: round(v, 4) for k, v in s.pop('device').items()})}")
        for name, v in s.items():
            print(f"  {name:13s} {v['calls']:5d} calls  median {v['ms_median']:.3f} ms  mean {v['ms_mean']:.3f} ms")
            for k, ms in v.get("self_ms_per_call", {}).items():
                print(f"      {ms:8.4f} ms  {k[:110]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

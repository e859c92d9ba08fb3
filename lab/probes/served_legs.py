"""Where a served request's first token spends its time, and how the engine process ticks while it serves (issue 23:
TTFT p50 at 64 staggered streams 12-31 ms against wave 1's 9-14; served staggered 0.91x the engine alone's staggered).

Runs benchmarks/serving.py unchanged (same load generator, same server child), except that the server child patches
itself first: the frontend stamps each call's handler entry, its submit, its first events' arrival on the event loop and
its first message; the engine process (spawned with a traced `child_main`) stamps each request's receipt (the drain of
its command), admission, first token out of the commit and the flush of the events that carry it, and keeps the
engine's step telemetry (plan / launch / commit per step). Both write JSON beside --out (`*.frontend.json`,
`*.engine.json`); perf_counter is CLOCK_MONOTONIC, one clock for every process on the host. The summary joins the
legs per request (server id) for each run (static, staggered) and prints their percentiles, and the engine's tick
periods and phases in each staggered window, next to the client-side TTFT.

    python3 lab/probes/served_legs.py --model random:llama3.2-1b --concurrency 64 --new-tokens 256 --out $OUT/legs.json
    python3 lab/probes/served_legs.py --model random:smollm2-135m:layers=2 --concurrency 4 --requests-per-client 2 \
        --prompt-len 32 --new-tokens 16 --out /tmp/legs.json     # CPU
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import json
import os
import pathlib
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT_ENV = "JPHOTON_LEGS_OUT"  # path prefix both processes write to


def _dump(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


# ---- the engine process ----------------------------------------------------------------------------------------------
def traced_child_main(build, links, levels) -> None:
    import dataclasses

    from server import engine_loop

    stamps: dict[str, dict] = {"recv": {}, "admit": {}, "first_out": {}, "first_sent": {}, "done_out": {}, "cpu": {}}
    pending_sent: list[int] = []
    drain_at = [0.0]
    Loop = engine_loop.EngineLoop
    orig_run, orig_drain, orig_admit, orig_output, orig_flush = (Loop.run, Loop._drain, Loop._admit, Loop._output,
                                                                  Loop._flush)

    def _drain(self, i):
        drain_at[0] = time.perf_counter()
        return orig_drain(self, i)

    def _admit(self, rid, seq, cancelled):
        now = time.perf_counter()
        stamps["recv"].setdefault(rid, drain_at[0])
        stamps["admit"][rid] = now
        return orig_admit(self, rid, seq, cancelled)

    def _output(self, o, rid=None):
        key = rid if rid is not None else self.front_id.get(o.request_id)
        if key is not None:
            now = time.perf_counter()
            if o.delta.token_ids and key not in stamps["first_out"]:
                stamps["first_out"][key] = now
                pending_sent.append(key)
            if o.delta.finish_reason is not None:
                stamps["done_out"][key] = now
        return orig_output(self, o, rid)

    def _flush(self):
        now = time.perf_counter()  # (before the send: the frontend may run before we do after it)
        for key in pending_sent:
            stamps["first_sent"][key] = now
        pending_sent.clear()
        return orig_flush(self)

    def run(self):
        self.llm.telemetry.clear()  # the engine-alone baseline's steps are not the served ones

        def dump():
            recs = [dataclasses.asdict(r) for r in self.llm.telemetry.records]
            _dump(os.environ[OUT_ENV] + ".engine.json",
                  {k: {str(a): b for a, b in v.items()} for k, v in stamps.items()} | {"steps": recs})

        stop = threading.Event()

        def every():  # the process may be killed before run() returns: keep a recent copy on disk
            while not stop.wait(0.25):
                stamps["cpu"][time.perf_counter()] = time.process_time()
                if len(stamps["cpu"]) % 8:
                    continue
                try:
                    dump()
                except Exception:  # noqa: BLE001 - a dict changed size under us: next time
                    pass

        threading.Thread(target=every, daemon=True).start()
        try:
            return orig_run(self)
        finally:
            stop.set()
            dump()

    Loop.run, Loop._drain, Loop._admit, Loop._output, Loop._flush = run, _drain, _admit, _output, _flush
    return engine_loop.child_main(build, links, levels)


# ---- the server process (frontend) -----------------------------------------------------------------------------------
def patch_frontend() -> None:
    import server.engine_process as ep
    from lab.probes import served_legs as me  # pickled by module name for the spawned engine process
    from server import service

    ep.child_main = me.traced_child_main
    stamps: dict[str, dict] = {"entry": {}, "submit": {}, "first_dispatch": {}, "first_yield": {}}
    entry = contextvars.ContextVar("entry", default=0.0)
    rid_of = contextvars.ContextVar("rid", default=None)
    orig_generate, orig_submit, orig_dispatch = (service.EngineServicer.Generate, ep.EngineProcess.submit,
                                                 ep.EngineProcess._dispatch)

    async def Generate(self, request, context):
        entry.set(time.perf_counter())
        first = True
        async for msg in orig_generate(self, request, context):
            if first and rid_of.get() is not None:
                stamps["first_yield"][rid_of.get()] = time.perf_counter()
            first = False
            yield msg

    def submit(self, prompt, params=None, name=None):
        rid, outputs = orig_submit(self, prompt, params, name)
        stamps["submit"][rid] = time.perf_counter()
        stamps["entry"][rid] = entry.get()
        rid_of.set(rid)
        return rid, outputs

    def _dispatch(self, events):
        now = time.perf_counter()
        for ev in events:
            if ev[0] == "out" and ev[2] and ev[1] not in stamps["first_dispatch"]:
                stamps["first_dispatch"][ev[1]] = now
        return orig_dispatch(self, events)

    lag: list = []  # (t, ms late) of a 1 ms sleep on the event loop: how far behind the loop runs
    cpu: list = []  # (t, process CPU s): this frontend process's CPU use over time

    async def lag_probe():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lag.append((t, 1e3 * (time.perf_counter() - t) - 1.0))

    orig_init = ep.EngineProcess.attach

    def attach(self, loop):
        loop.call_soon_threadsafe(lambda: loop.create_task(lag_probe()))
        return orig_init(self, loop)

    ep.EngineProcess.attach = attach
    stamps["lag"], stamps["cpu"] = lag, cpu
    service.EngineServicer.Generate = Generate
    ep.EngineProcess.submit = submit
    ep.EngineProcess._dispatch = _dispatch

    def dump():
        _dump(os.environ[OUT_ENV] + ".frontend.json",
              {k: (list(v) if isinstance(v, list) else {str(a): b for a, b in v.items()}) for k, v in stamps.items()})

    def every():
        while True:
            time.sleep(0.25)
            cpu.append((time.perf_counter(), time.process_time()))
            if len(cpu) % 8:
                continue
            try:
                dump()
            except Exception:  # noqa: BLE001
                pass

    threading.Thread(target=every, daemon=True).start()
    atexit.register(dump)
    if os.environ.get("JPHOTON_LEGS_PROFILE"):  # cProfile of the event loop's thread (this one), printed at exit
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()

        def report():
            prof.disable()
            with open(os.environ[OUT_ENV] + ".frontend.prof.txt", "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(45)

        atexit.register(report)


# ---- the summary -----------------------------------------------------------------------------------------------------
def pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"n": len(xs), "p10": xs[int(0.1 * len(xs))], "p50": xs[len(xs) // 2], "p90": xs[int(0.9 * len(xs))],
            "mean": statistics.fmean(xs)}


LEGS = [("entry", "submit", "frontend: handler entry -> submitted"),
        ("submit", "recv", "submitted -> drained by the engine loop"),
        ("recv", "admit", "drained -> admitted"),
        ("admit", "first_out", "admitted -> first token out of a commit"),
        ("first_out", "first_sent", "first token -> its tick's events sent"),
        ("first_sent", "first_dispatch", "sent -> dispatched on the frontend's loop"),
        ("first_dispatch", "first_yield", "dispatched -> first message yielded"),
        ("entry", "first_yield", "handler entry -> first message (server-side TTFT)")]


def summarize(prefix: str, result: dict) -> dict:
    with open(prefix + ".engine.json") as f:
        eng = json.load(f)
    with open(prefix + ".frontend.json") as f:
        fe = json.load(f)
    st = {**{k: {int(a): b for a, b in v.items()} for k, v in eng.items() if k not in ("steps", "cpu")},
          **{k: {int(a): b for a, b in v.items()} for k, v in fe.items() if k not in ("lag", "cpu")}}
    eng_cpu = sorted((float(a), b) for a, b in eng["cpu"].items())

    def cpu_fraction(samples, lo, hi):
        xs = [(t, c) for t, c in samples if lo <= t <= hi]
        return (xs[-1][1] - xs[0][1]) / (xs[-1][0] - xs[0][0]) if len(xs) > 1 and xs[-1][0] > xs[0][0] else None
    # runs: the load generator's scenarios are separated by idle gaps; cluster the submits by them
    rids = sorted(st["submit"], key=st["submit"].get)
    runs, cur, cur_done = [], [], 0.0
    for rid in rids:  # a new run: every request before it had finished when it was submitted
        if cur and st["submit"][rid] > cur_done:
            runs.append(cur)
            cur, cur_done = [], 0.0
        cur.append(rid)
        cur_done = max(cur_done, st["done_out"].get(rid, float("inf")))
    if cur:
        runs.append(cur)
    steps = eng["steps"]
    out = {"runs": []}
    rows = [r for r in result.get("rows", [])]
    for i, run in enumerate(runs):
        label = f"run {i}: {len(run)} requests"
        legs = {}
        for a, b, name in LEGS:
            xs = [1e3 * (st[b][r] - st[a][r]) for r in run if r in st[a] and r in st[b]]
            legs[name] = pct(xs)
        t_lo, t_hi = st["submit"][run[0]], max(st["done_out"].get(r, 0.0) for r in run)
        in_run = [s for s in steps if t_lo <= s["t_launch"] <= t_hi and s["t_launch"] > 0]
        periods = [1e3 * (b["t_launch"] - a["t_launch"]) for a, b in zip(in_run, in_run[1:], strict=False)]
        phases = {}
        for name, a, b in (("plan", "t_plan", "t_planned"), ("launch", "t_launch", "t_launched"),
                           ("wait", "t_commit", "t_ready"), ("commit", "t_ready", "t_committed")):
            xs = [1e3 * (s[b] - s[a]) for s in in_run if s[a] > 0 and s[b] > 0]
            phases[name] = statistics.fmean(xs) if xs else None
        kinds = {}
        for s in in_run:
            kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
        rows_mean = statistics.fmean(s["rows"] for s in in_run) if in_run else None
        lag = pct([ms for t, ms in fe["lag"] if t_lo <= t <= t_hi])
        cpus = {"frontend": cpu_fraction(fe["cpu"], t_lo, t_hi), "engine": cpu_fraction(eng_cpu, t_lo, t_hi)}
        out["runs"].append({"label": label, "legs": legs, "steps": len(in_run), "kinds": kinds,
                            "period_ms": pct(periods), "phases_ms_mean": phases, "rows_mean": rows_mean,
                            "loop_lag_ms": lag, "cpu_cores": cpus})
        if lag:
            print(f"   frontend loop lag (a 1 ms sleep, ms late): p50 {lag['p50']:.2f} p90 {lag['p90']:.2f} mean "
                  f"{lag['mean']:.2f}; CPU cores: " + ", ".join(f"{k} {v:.2f}" for k, v in cpus.items() if v), flush=True)
        print(f"== {label}; {len(in_run)} steps {kinds}, rows mean {rows_mean}", flush=True)
        if periods:
            p = pct(periods)
            print(f"   launch-to-launch ms: p50 {p['p50']:.3f} mean {p['mean']:.3f} p90 {p['p90']:.3f}; phases mean "
                  + ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if v is not None), flush=True)
        for name, p in legs.items():
            if p:
                print(f"   {name:52s} p10 {p['p10']:7.2f}  p50 {p['p50']:7.2f}  p90 {p['p90']:7.2f}  mean "
                      f"{p['mean']:7.2f} ms (n={p['n']})", flush=True)
    for r in rows:
        print(f"client {r['mode']:9s} C={r['concurrency']}: TTFT p50 {r['ttft_ms'].get('p50', 0):.2f} p90 "
              f"{r['ttft_ms'].get('p90', 0):.2f} ms, {r['decode_tok_s']:.0f} tok/s, TPOT p50 "
              f"{r['tpot_ms'].get('p50', 0):.3f} ms", flush=True)
    return out


def main() -> None:
    if "--serve" in sys.argv:
        patch_frontend()
        from benchmarks import serving

        serving.main(sys.argv[1:])
        return
    out = next((sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--out"), None)
    if out is None:
        sys.exit("--out PATH is needed (the legs are written beside it)")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.environ[OUT_ENV] = out
    from benchmarks import serving

    serving.__file__ = __file__  # the server child is this script (patched), then serving.main's --serve path
    result = serving.main(sys.argv[1:])
    time.sleep(0.5)
    summary = summarize(out, result)
    with open(out + ".legs.json", "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()

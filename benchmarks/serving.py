"""Serving benchmark: an async gRPC load generator against `jphoton.v1.Engine`.

For each concurrency C it runs the same kind of request (a P-token random prompt, N new tokens, greedy, ignore_eos):
  static     C requests sent at once: the engine's best case, one full batch decoding in lockstep
  staggered  C closed-loop clients, each sending R requests back to back, their starts spread over one request's
             duration, so arrivals (and their prefills) are spread evenly while C requests are in flight
  poisson    (--arrival poisson) R*C requests arriving as a Poisson process at rate C / (request duration), which holds
             a mean of C in flight (Little's law)
and reports TTFT, TPOT (time per output token after the first), ITL (gap between tokens) p50/p90/p99, aggregate decode
tok/s in the steady-state window (tokens received in it / its length), the staggered/static ratio, and the XLA
compiles the server did after warm-up (GetStats; should be 0).

The server runs in a child process (this script with --serve), built as `jphoton serve` builds it (the default
engine) with every step shape compiled before it serves; --connect HOST:PORT measures a server that is already running
instead. The load comes from --client-procs processes (default 8), each with its own event loop and
--channels-per-proc connections (default 4, chains dealt over them: a server with several frontends sees its
connections spread as by many clients), each reporting its CPU use (a client at 100% of a core would be measuring
itself); tokens per message are reported too. --frontends 1 2 starts one server of each frontend count in turn, same
load, same call.

    python benchmarks/serving.py --concurrency 4 --requests-per-client 2 --prompt-len 32 --new-tokens 16   # CPU
    python3 benchmarks/serving.py --model random:llama3.2-1b --concurrency 32 64 --out /tmp/serving.json    # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from benchmarks.llm_args import add_llm_args, parse_llm_args  # noqa: E402
from jphoton.server import jphoton_pb2 as pb  # noqa: E402
from jphoton.server import jphoton_pb2_grpc as pb_grpc  # noqa: E402


@dataclasses.dataclass
class Trace:
    """One request as the client saw it: send time, then (arrival time, tokens) per message."""

    sent: float
    messages: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    finish_reason: str = ""

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.messages)

    @property
    def first(self) -> float:
        return next(t for t, n in self.messages if n)

    @property
    def last(self) -> float:
        return self.messages[-1][0]


async def one_request(stub, prompt: list[int], new_tokens: int, sent_at: float | None = None) -> Trace:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    trace = Trace(sent=time.perf_counter() if sent_at is None else sent_at)
    async for msg in stub.Generate(request, timeout=600):
        trace.messages.append((time.perf_counter(), len(msg.token_ids)))
        if msg.finish_reason:
            trace.finish_reason = msg.finish_reason
    if trace.finish_reason != "length" or trace.tokens != new_tokens:
        raise RuntimeError(f"request ended with {trace.finish_reason!r} after {trace.tokens}/{new_tokens} tokens")
    return trace


# ---- the load generator: client processes ----------------------------------------------------------------------------
# A chain is (start offset s, [prompts]): its requests are sent one after another from t0 + s. Static = C chains of one
# at 0; staggered = C chains of R; Poisson = one chain per arrival. Chains are dealt round-robin to K processes, each
# with its own channel and event loop, so the client's Python is never the bottleneck (each reports its CPU use); their
# timestamps share one clock (perf_counter is CLOCK_MONOTONIC, system-wide).
Chain = tuple[float, list[list[int]]]


async def _run_chains(address: str, t0: float, chains: list[Chain], new_tokens: int, channels: int
                      ) -> list[list[Trace]]:
    # a local subchannel pool each: channels of one process to one address would otherwise share one connection
    options = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.use_local_subchannel_pool", 1)]
    chs = [grpc.aio.insecure_channel(address, options=options) for _ in range(max(1, min(channels, len(chains))))]
    stubs = [pb_grpc.EngineStub(ch) for ch in chs]

    async def chain(stub, offset: float, prompts: list[list[int]]) -> list[Trace]:
        start = t0 + offset
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        traces = [await one_request(stub, prompts[0], new_tokens, sent_at=start)]
        for prompt in prompts[1:]:
            traces.append(await one_request(stub, prompt, new_tokens))
        return traces

    try:
        return list(await asyncio.gather(*(chain(stubs[i % len(stubs)], o, ps) for i, (o, ps) in enumerate(chains))))
    finally:
        for ch in chs:
            await ch.close()


def _client_main(address: str, conn, channels: int) -> None:
    """A client process: run each batch of chains the parent sends; answer (traces, cpu s, wall s) or an error."""
    while (task := conn.recv()) is not None:
        t0, chains, new_tokens = task
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            traces = asyncio.run(_run_chains(address, t0, chains, new_tokens, channels))
            conn.send(([[dataclasses.astuple(t) for t in ts] for ts in traces], time.process_time() - cpu0,
                       time.perf_counter() - wall0))
        except Exception as e:  # noqa: BLE001 -- reported to the parent, which raises it
            conn.send(RuntimeError(f"client process: {e!r}"))


class ClientPool:
    """K load-generator processes (spawned, not forked: no gRPC state is inherited)."""

    def __init__(self, address: str, processes: int, channels: int = 1):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(address, child, channels), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, chains: list[Chain], new_tokens: int, lead: float = 0.5) -> tuple[list[list[Trace]], dict]:
        """Run the chains (in their order) across the processes, all starting `lead` s from now. Returns each chain's
        traces and the client processes' CPU use (each as a fraction of one core over its run)."""
        k = min(len(self.conns), len(chains))
        t0 = time.perf_counter() + lead
        for i in range(k):
            self.conns[i].send((t0, chains[i::k], new_tokens))
        out: list[list[Trace]] = [[] for _ in chains]
        cpu = []
        for i in range(k):
            reply = self.conns[i].recv()
            if isinstance(reply, Exception):
                raise reply
            traces, cpu_s, wall_s = reply
            for j, ts in zip(range(i, len(chains), k), traces, strict=True):
                out[j] = [Trace(sent, [tuple(m) for m in msgs], reason) for sent, msgs, reason in ts]
            cpu.append(cpu_s / wall_s if wall_s > 0 else 0.0)
        return out, {"processes": k, "core_fraction": cpu, "max_core_fraction": max(cpu)}

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(10)


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": pick(0.5) * 1e3, "p90": pick(0.9) * 1e3, "p99": pick(0.99) * 1e3, "mean": statistics.fmean(xs) * 1e3}


def summarize(traces: list[Trace], window: tuple[float, float], mode: str, concurrency: int) -> dict:
    """Latency percentiles over every request; throughput and mean concurrency over the steady-state window."""
    lo, hi = window
    in_window = sum(n for t in traces for ts, n in t.messages if lo < ts <= hi)
    busy = sum(max(0.0, min(t.last, hi) - max(t.sent, lo)) for t in traces)
    itl, gaps = [], []  # per token (a message's gap over its tokens), and per message
    for t in traces:
        prev = t.first
        for ts, n in t.messages:
            if n and ts > prev:
                itl += [(ts - prev) / n] * n
                gaps.append(ts - prev)
                prev = ts
    start, end = min(t.sent for t in traces), max(t.last for t in traces)
    return {
        "mode": mode, "concurrency": concurrency, "requests": len(traces),
        "decode_tok_s": in_window / (hi - lo) if hi > lo else float("nan"),
        "window_s": hi - lo, "mean_concurrency": busy / (hi - lo) if hi > lo else float("nan"),
        "end_to_end_tok_s": sum(t.tokens for t in traces) / (end - start), "wall_s": end - start,
        "ttft_ms": percentiles([t.first - t.sent for t in traces]),
        "tpot_ms": percentiles([(t.last - t.first) / (t.tokens - 1) for t in traces if t.tokens > 1]),
        "itl_ms": percentiles(itl),
        "message_gap_ms": percentiles(gaps),
        "request_s_mean": statistics.fmean(t.last - t.sent for t in traces),
        "tokens_per_message": sum(t.tokens for t in traces) / max(1, sum(1 for t in traces for _, n in t.messages if n)),
    }


def run_static(pool: ClientPool, prompts, new_tokens: int, c: int) -> dict:
    per, cpu = pool.run([(0.0, [prompts[i]]) for i in range(c)], new_tokens)
    traces = [ts[0] for ts in per]
    # Decode phase: every request has its first token, none has finished (the batch decodes in lockstep).
    return summarize(traces, (max(t.first for t in traces), min(t.last for t in traces)), "static", c) | {"client": cpu}


def run_staggered(pool: ClientPool, prompts, new_tokens: int, c: int, per_client: int, duration: float) -> dict:
    chains = [(w * duration / c, [prompts[(w * per_client + k) % len(prompts)] for k in range(per_client)])
              for w in range(c)]
    per, cpu = pool.run(chains, new_tokens)
    traces = [t for ts in per for t in ts]
    # Steady state: from the last client's first request to the first client's finishing its last one.
    window = (max(ts[0].sent for ts in per), min(ts[-1].last for ts in per))
    return summarize(traces, window, "staggered", c) | {"client": cpu}


def run_poisson(pool: ClientPool, prompts, new_tokens: int, c: int, n: int, duration: float, seed: int) -> dict:
    rng = random.Random(seed)
    t, chains = 0.0, []
    for i in range(n):
        chains.append((t, [prompts[i % len(prompts)]]))
        t += rng.expovariate(c / duration)
    per, cpu = pool.run(chains, new_tokens)
    traces = [ts[0] for ts in per]
    sent = sorted(t.sent for t in traces)
    return summarize(traces, (sent[min(c, n - 1)], sent[-1]), "poisson", c) | {"client": cpu}


async def bench(args, address: str) -> dict:
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * 2**20)]) as ch:
        stub = pb_grpc.EngineStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 900
        while True:  # a server that was just started may still be compiling
            try:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server never became SERVING")
            await asyncio.sleep(1)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        rng = random.Random(args.seed)
        n_prompts = max(args.concurrency) * args.requests_per_client
        prompts = [[rng.randrange(info.vocab_size) for _ in range(args.prompt_len)] for _ in range(n_prompts)]
        compiles_warm = (await stub.GetStats(pb.GetStatsRequest())).num_compiles
        pool = ClientPool(address, min(args.client_procs, max(args.concurrency)), args.channels_per_proc)
        try:
            rows = await asyncio.to_thread(_scenarios, args, pool, prompts)
        finally:
            pool.close()
        stats = await stub.GetStats(pb.GetStatsRequest())
        compiles = stats.num_compiles - compiles_warm
        print(f"compiles after warm-up: {compiles}; preemptions: {stats.preemptions}", flush=True)
        return {"model": {"name": info.name, "architecture": info.architecture, "dtype": info.dtype,
                          "max_context": info.max_context},
                "rows": rows, "compiles_after_warmup": compiles, "preemptions": stats.preemptions}


def _scenarios(args, pool: ClientPool, prompts) -> list[dict]:
    run_static(pool, prompts, 4, min(args.concurrency))  # first requests through every code path
    rows = []
    for c in args.concurrency:
        static = run_static(pool, prompts, args.new_tokens, c)
        print(_line(static), flush=True)
        if args.arrival == "poisson":
            moving = run_poisson(pool, prompts, args.new_tokens, c, c * args.requests_per_client,
                                 static["request_s_mean"], args.seed)
        else:
            moving = run_staggered(pool, prompts, args.new_tokens, c, args.requests_per_client,
                                   static["request_s_mean"])
        moving["ratio_vs_static"] = moving["decode_tok_s"] / static["decode_tok_s"]
        print(_line(moving) + f", ratio vs static {moving['ratio_vs_static']:.3f}", flush=True)
        if c in BASELINE:
            static["engine_only"] = BASELINE[c]
            static["ratio_vs_engine_only"] = static["decode_tok_s"] / BASELINE[c]["decode_tok_s"]
            print(f"C={c:3d} engine alone: {BASELINE[c]['decode_tok_s']:9.1f} decode tok/s "
                  f"({BASELINE[c]['decode_ms']:.3f} ms/step); served static batch / engine alone "
                  f"{static['ratio_vs_engine_only']:.3f}", flush=True)
            st = BASELINE[c].get("staggered")
            if st:
                moving["engine_only"] = st
                print(f"C={c:3d} engine alone, staggered: {st['decode_tok_s']:9.1f} decode tok/s "
                      f"({st['decode_tok_s'] / BASELINE[c]['decode_tok_s']:.3f}x its static); tick ms by step kind "
                      + ", ".join(f"{k} {v:.3f} (x{st['ticks'][k]})" for k, v in st["tick_ms_median"].items())
                      + f"; served staggered / engine alone staggered {moving['decode_tok_s'] / st['decode_tok_s']:.3f}",
                      flush=True)
        rows += [static, moving]
    return rows


def _line(r: dict) -> str:
    cpu = r["client"]
    return (f"C={r['concurrency']:3d} {r['mode']:9s}: {r['decode_tok_s']:9.1f} decode tok/s "
            f"(window {r['window_s']:.2f} s, mean concurrency {r['mean_concurrency']:.1f}), "
            f"TTFT p50/p90/p99 {_p(r['ttft_ms'])} ms, TPOT {_p(r['tpot_ms'])} ms, ITL {_p(r['itl_ms'])} ms, "
            f"message gap {_p(r['message_gap_ms'])} ms, "
            f"{r['tokens_per_message']:.2f} tokens/message; {cpu['processes']} client processes, busiest at "
            f"{100 * cpu['max_core_fraction']:.0f}% of a core")


def _p(d: dict) -> str:
    return "/".join(f"{d[k]:.1f}" for k in ("p50", "p90", "p99")) if d else "-"


# ---- the server child ------------------------------------------------------------------------------------------------
def engine_kwargs(args) -> dict:
    """What `jphoton serve` builds: the default engine (step shapes, KV pool, context), more rows only if a run needs
    more than the default 64 at once."""
    return dict(pipeline_depth=args.pipeline_depth, max_rows=max(args.concurrency), **parse_llm_args(args.llm_args))


def serve_child(spec: dict) -> None:
    """`jphoton serve`'s path: the engine in a process of its own (spec["server"] == "process",
    jphoton/server/engine_process.py) or in a thread of the server process ("thread", `jphoton serve --in-process`)."""
    import functools

    from jphoton.server.app import run_until_signal
    from jphoton.server.engine_process import Spawn

    build = functools.partial(build_engine, spec)
    model = Spawn(build) if spec["server"] == "process" else build
    frontends = spec["frontends"] or 1
    print(f"frontends: {frontends}", flush=True)
    asyncio.run(run_until_signal(model, port=0, max_queue=4096, grace=5, switch_interval=spec["switch_interval"],
                                 frontends=frontends, **({} if spec["max_message_rate"] is None else
                                                         {"max_message_rate": spec["max_message_rate"]})))


def build_engine(spec: dict):
    """Runs where the engine will run (the engine process, or the server's loader thread)."""
    from benchmarks.common import default_llm, device_info

    print("device: " + json.dumps(device_info()), flush=True)
    llm = default_llm(spec["model"], dtype=spec["dtype"], progress=False, **spec["engine"])  # all shapes ready
    if spec["baseline"]:
        engine_baseline(llm, spec)
    return llm


def engine_baseline(llm, spec: dict) -> None:
    """The engine alone (no gRPC), before the server goes SERVING: a static batch of C through LLM's own loop, as
    benchmarks/throughput.py measures it. What the server's static run is compared with."""
    from benchmarks.common import timed_run
    from jphoton import SamplingParams

    rng = random.Random(1)
    for c in spec["concurrency"]:
        prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(spec["prompt_len"])] for _ in range(c)]
        timed_run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        r = timed_run(llm, prompts, SamplingParams(max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True))
        row = {"concurrency": c, "decode_ms": r.decode_ms_median, "decode_tok_s": c / (r.decode_ms_median / 1e3),
               "end_to_end_tok_s": r.tok_s, "compiles_during_run": r.compiles_during_run}
        duration = r.decode_ms_median / 1e3 * spec["new_tokens"]
        row["staggered"] = engine_staggered(llm, prompts, spec["new_tokens"], c, spec["requests_per_client"], duration)
        print("baseline: " + json.dumps(row), flush=True)


def engine_staggered(llm, prompts, new_tokens: int, c: int, per_client: int, duration: float) -> dict:
    """The staggered scenario through the engine alone: C closed-loop clients with no think time, their starts spread
    over one request's `duration`; decode tok/s in the window where all C are in flight, and the engine's tick time
    by step kind there (a mixed step carries a newcomer's prefill beside the decode rows)."""
    from benchmarks.common import tick_kinds
    from jphoton import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    queue = [[prompts[(i * per_client + k) % len(prompts)] for k in range(per_client)] for i in range(c)]
    owner, ticks, tokens = {}, [], []
    llm.telemetry.clear()
    t0 = time.perf_counter()
    starts = [t0 + i * duration / c for i in range(c)]
    started, first_done = 0, None
    while started < c or llm.has_unfinished_requests():
        now = time.perf_counter()
        while started < c and starts[started] <= now:
            owner[llm.add_request({"prompt_token_ids": queue[started].pop()}, params)] = started
            started += 1
        a = time.perf_counter()
        outs = llm.step() if llm.has_unfinished_requests() else []
        b = time.perf_counter()
        ticks.append((a, b))
        tokens.append((b, sum(len(o.delta.token_ids) for o in outs)))
        for o in outs:
            if o.finished:
                i = owner.pop(o.request_id)
                if queue[i]:
                    owner[llm.add_request({"prompt_token_ids": queue[i].pop()}, params)] = i
                elif first_done is None:
                    first_done = b  # the first client is out of requests: the window ends
    lo, hi = starts[-1], first_done or ticks[-1][1]
    n = sum(k for t, k in tokens if lo <= t <= hi)
    kinds = tick_kinds(ticks, llm.telemetry.records)
    by_kind = {}
    for (a, b), k in zip(ticks, kinds, strict=True):
        if lo <= a and b <= hi and k is not None:
            by_kind.setdefault(k, []).append(1e3 * (b - a))
    return {"decode_tok_s": n / max(hi - lo, 1e-9), "window_s": hi - lo,
            "tick_ms_median": {k: statistics.median(v) for k, v in by_kind.items()},
            "tick_ms_mean": {k: statistics.fmean(v) for k, v in by_kind.items()},
            "ticks": {k: len(v) for k, v in by_kind.items()}}


def start_server(args, server: str, frontends: int | None = None) -> tuple[subprocess.Popen, str, dict]:
    spec = {"server": server, "frontends": frontends, "model": args.model, "dtype": args.dtype, "engine": engine_kwargs(args),
            "switch_interval": args.switch_interval, "baseline": args.engine_baseline,
            "max_message_rate": args.max_message_rate,
            "concurrency": args.concurrency, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "requests_per_client": args.requests_per_client}
    print(f"server: {spec}", flush=True)
    child = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(spec)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent)
    for line in child.stdout:  # "jphoton: gRPC on HOST:PORT ..."
        sys.stdout.write("server: " + line)
        if "gRPC on" in line:
            address = line.split("gRPC on ", 1)[1].split()[0]
            threading.Thread(target=_forward, args=(child.stdout,), daemon=True).start()  # never let its pipe fill
            return child, address
    raise RuntimeError(f"server exited with {child.wait()}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when this process dies, however it dies (a time-boxed run that is killed
    must not leave a server holding the accelerator)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


BASELINE: dict[int, dict] = {}  # concurrency -> the engine alone, as the server child reported it


DEVICE: dict = {}  # the device as the engine's process reported it (this process never touches the accelerator)


def _forward(stream) -> None:
    for line in stream:
        sys.stdout.write("server: " + line)
        if line.startswith("device: "):
            DEVICE.update(json.loads(line[len("device: "):]))
        if line.startswith("baseline: "):
            row = json.loads(line[len("baseline: "):])
            BASELINE[row["concurrency"]] = row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--connect", default=None, help="HOST:PORT of a running server (default: start one)")
    ap.add_argument("--servers", nargs="+", default=["process"], choices=("process", "thread"),
                    help="start a server of each kind in turn, same load: the engine in its own process (what `jphoton "
                         "serve` runs) or in a thread of the server process (`jphoton serve --in-process`)")
    ap.add_argument("--frontends", type=int, nargs="+", default=[0],
                    help="the server's frontend processes (`jphoton serve --frontends`; 0: as it picks, 2 on a host "
                         "with 8 or more CPUs, else 1); several values: one server each, in turn, same load")
    ap.add_argument("--channels-per-proc", type=int, default=4,
                    help="connections per load-generator process (requests dealt over them)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4])
    ap.add_argument("--requests-per-client", type=int, default=4, help="R: staggered requests per client")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--arrival", choices=("staggered", "poisson"), default="staggered")
    ap.add_argument("--client-procs", type=int, default=8,
                    help="load-generator processes (at most one per concurrent stream), each with its own channel")
    ap.add_argument("--pipeline-depth", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-message-rate", type=float, default=None,
                    help="the server's tokens a second per frontend before streams' tokens are paced (0: never; "
                         "default: `jphoton serve`'s)")
    ap.add_argument("--switch-interval", type=float, default=0.001,
                    help="the server process's GIL switch interval, s (what `jphoton serve` uses; Python's default 0.005)")
    ap.add_argument("--no-engine-baseline", dest="engine_baseline", action="store_false",
                    help="skip timing the engine alone (no gRPC) in the server process before it serves")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    add_llm_args(ap)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # internal: run as the server child
    args = ap.parse_args(argv)
    from benchmarks.common import QUICK

    if QUICK:
        args.concurrency, args.requests_per_client = args.concurrency[:1], 2
        args.new_tokens = min(args.new_tokens, 64)
    if args.serve is not None:
        serve_child(json.loads(args.serve))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below when `timeout` stops us
    from jphoton.server.engine_process import default_frontends  # (jphoton, jax: not in the spawned client processes)

    t0 = time.perf_counter()
    runs = []
    combos = ([(None, None)] if args.connect else
              [(s, f or default_frontends()) for s in args.servers for f in (args.frontends if s == "process" else [1])])
    for server, frontends in combos:
        child = None
        BASELINE.clear()
        if server is None:
            address = args.connect
        else:
            print(f"=== server: engine in a {server}" + (f", {frontends} frontends" if frontends else ""), flush=True)
            child, address = start_server(args, server, frontends)
        try:
            run = asyncio.run(bench(args, address))
        finally:
            if child is not None:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()
        for row in run["rows"]:
            row["server"] = server or "connected"
            row["frontends"] = frontends
        runs.append(run)
    result = {**runs[0], "rows": [r for run in runs for r in run["rows"]],
              "compiles_after_warmup": sum(run["compiles_after_warmup"] for run in runs)}
    if len(args.frontends) > 1:  # frontend counts, same load, same call
        for c in args.concurrency:
            for mode in ("static", "staggered", "poisson"):
                rate = {r["frontends"]: r for r in result["rows"] if r["concurrency"] == c and r["mode"] == mode}
                if rate:
                    print(f"C={c:3d} {mode:9s}: " + ", ".join(
                        f"{k} frontends {v['decode_tok_s']:.0f} tok/s (TTFT p50 {v['ttft_ms'].get('p50', 0):.1f} ms, "
                        f"ITL p50 {v['itl_ms'].get('p50', 0):.1f} ms, {v['tokens_per_message']:.2f} tok/msg"
                        + (f", {v['ratio_vs_engine_only']:.3f}x engine alone" if "ratio_vs_engine_only" in v else "")
                        + ")" for k, v in rate.items()), flush=True)
    if len(args.servers) > 1:  # process vs thread, same load, same call
        for c in args.concurrency:
            rate = {r["server"]: r["decode_tok_s"] for r in result["rows"] if r["concurrency"] == c and r["mode"] == "static"}
            print(f"C={c:3d} static: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in rate.items())
                  + (f"; process / thread {rate['process'] / rate['thread']:.3f}" if len(rate) == 2 else ""), flush=True)
    result["args"] = vars(args)
    result["engine"] = None if args.connect else engine_kwargs(args)
    result["total_s"] = time.perf_counter() - t0
    result["info"] = dict(DEVICE)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"done in {result['total_s']:.0f} s" + (f"; wrote {args.out}" if args.out else ""), flush=True)
    return result


if __name__ == "__main__":
    main()

"""What the serving path (engine process loop, pipes, one gRPC frontend, clients) delivers when the engine costs
nothing but its step time (issue 23): a stand-in LLM in the engine process sleeps `--tick-ms` a step (as the engine
thread waits on the device) and emits one token per live request. Runs anywhere (CPU box included): the gap between
C / tick and the served tok/s, the tokens per message and the TTFT are the serving path's alone.

    python3 lab/probes/frontend_capacity.py --concurrency 64 --tick-ms 1.8 --new-tokens 256
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from jphoton.sequence import Delta, RequestOutput  # noqa: E402


@dataclasses.dataclass
class _Seq:
    request_id: int
    prompt_tokens: int
    max_tokens: int
    done: int = 0

    def finish(self, reason: str) -> str:
        return reason

    def output(self, reason: str) -> RequestOutput:
        return RequestOutput(self.request_id, Delta([], "", reason), None, self.prompt_tokens, self.done)


class StandInLLM:
    """What server/engine_loop.py uses of an LLM; step() sleeps the tick and gives each live request one token."""

    def __init__(self, tick_s: float):
        self.tick_s = tick_s
        self.live: dict[int, _Seq] = {}
        self.next_id = 0
        self.steps = 0
        self.ticking_s = 0.0  # step to step, over steps that followed one within 50 ms: the engine loop's period
        self.last_end = 0.0
        self.tokenizer = None
        self.model = type("M", (), {"name": "stand-in", "params": {}})()
        self.config = type("C", (), {"name": "stand-in", "architecture": "none", "vocab_size": 32000})()
        self.max_model_len = 4096
        self.grammar = type("G", (), {"warm": lambda self: None})()
        self.warmup = type("W", (), {"all_ready": True})()

    def prepare_request(self, prompt, params, request_id=None) -> _Seq:
        seq = _Seq(self.next_id, len(prompt["prompt_token_ids"]), params.max_tokens)
        seq.stamps = [time.perf_counter()]  # prepared; then added, then its first step's end (--trace)
        self.next_id += 1
        return seq

    def add_request(self, seq: _Seq) -> None:
        seq.stamps.append(time.perf_counter())
        self.live[seq.request_id] = seq

    def abort(self, request_id: int):
        seq = self.live.pop(request_id, None)
        return None if seq is None else seq.output("abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def run_programs_once(self, limit=None) -> int:
        return 0

    def step(self) -> list[RequestOutput]:
        time.sleep(self.tick_s)
        self.steps += 1
        now = time.perf_counter()
        if now - self.last_end < 0.05:
            self.ticking_s += now - self.last_end
        self.last_end = now
        outs = []
        for rid, seq in list(self.live.items()):
            seq.done += 1
            reason = "length" if seq.done >= seq.max_tokens else None
            if reason:
                del self.live[rid]
            text = " tok" if seq.done > 1 else " ".join(f"{t:.6f}" for t in [*seq.stamps, time.perf_counter()])
            outs.append(RequestOutput(rid, Delta([seq.done % 1000 + 10], text, reason), None, seq.prompt_tokens,
                                      seq.done))
        return outs

    def text_limits(self) -> dict:
        return {"max_prompt_bytes": 2**20, "bytes_per_token": 64, "max_model_len": self.max_model_len}

    def stats(self) -> dict:
        return {"num_compiles": 0, "shapes_compiled": 1, "shapes_total": 1, "all_shapes_ready": True,
                "kv_pages_free": 1, "kv_pages_total": 1, "programs_run_once": 0, "running": len(self.live),
                "waiting": 0, "max_queue": 1024, "steps": self.steps, "ticking_s": self.ticking_s}


def _trace_client(port: int, n: int, conn) -> None:
    """A client process: n requests one at a time; sends back (sent, received, prepared, added, stepped) for each."""
    import grpc

    from server import jphoton_pb2 as pb
    from server import jphoton_pb2_grpc as pb_grpc

    stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    out = []
    for _ in range(n):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 16), sampling=pb.SamplingParams(max_tokens=2))
        t0 = time.perf_counter()
        first = next(iter(stub.Generate(request, timeout=30)))
        out.append((t0, time.perf_counter(), *map(float, first.text.split()[:3])))
        time.sleep(0.05)
    conn.send(out)


def trace(port: int, n: int) -> None:
    """Requests one at a time from a client process: where the time to the first token goes (all clocks
    CLOCK_MONOTONIC, system-wide)."""
    import multiprocessing
    import statistics

    from server.engine_process import EngineProcess

    submitted = []  # when the frontend's servicer handed each request to the engine process
    plain_submit = EngineProcess.submit
    EngineProcess.submit = lambda self, *a, **k: submitted.append(time.perf_counter()) or plain_submit(self, *a, **k)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    client = ctx.Process(target=_trace_client, args=(port, n, theirs), daemon=True)
    client.start()
    stamps = mine.recv()
    client.join()
    EngineProcess.submit = plain_submit
    legs = [(sub - t0, prepared - sub, added - prepared, stepped - added, got - stepped)
            for (t0, got, prepared, added, stepped), sub in zip(stamps, submitted[-n:], strict=True)]
    for name, xs in zip(("send -> submitted", "submitted -> prepared", "prepared -> added", "added -> step end",
                         "step end -> client"), zip(*legs, strict=True), strict=True):
        print(f"{name:22s} median {statistics.median(xs) * 1e3:6.2f} ms  max {max(xs) * 1e3:6.2f}")


def main() -> None:
    from benchmarks.serving import ClientPool, run_staggered, run_static
    from server.app import serve
    from server.engine_process import Spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument("--tick-ms", type=float, default=1.8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--client-processes", type=int, default=2)
    ap.add_argument("--channels-per-proc", type=int, default=4)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--max-message-rate", type=float, help="the server's (default: its default)")
    ap.add_argument("--trace", type=int, default=0, help="first: N requests one at a time, each one's path timed")
    ap.add_argument("--trace-load", type=int, default=0, help="... beside this many long streams")
    args = ap.parse_args()

    sys.setswitchinterval(0.001)  # as `jphoton serve` sets its frontend's (server/app.py run_until_signal)
    handle = serve(Spawn(functools.partial(StandInLLM, args.tick_ms / 1e3)), port=0, max_queue=1024,
                   **({} if args.max_message_rate is None else {"max_message_rate": args.max_message_rate}))
    if args.trace:
        background = None
        if args.trace_load:
            import threading

            load = ClientPool(f"127.0.0.1:{handle.port}", args.client_processes, args.channels_per_proc)
            steps = int((args.trace * 0.08 + 2) / (args.tick_ms / 1e3))
            background = threading.Thread(target=lambda: load.run([(0.0, [[7] * 16])] * args.trace_load, steps))
            background.start()
            time.sleep(1.5)
        trace(handle.port, args.trace)
        if background is not None:
            background.join()
            load.close()
    pool = ClientPool(f"127.0.0.1:{handle.port}", args.client_processes, args.channels_per_proc)
    rows = []
    try:
        prompts = [[1 + i % 100] * 16 for i in range(max(args.concurrency) * (args.requests_per_client + 1))]
        for c in args.concurrency:
            ideal = c / (args.tick_ms / 1e3)
            engine = handle.server._engine_process
            duration = args.new_tokens * args.tick_ms / 1e3
            runs = []
            for run in (functools.partial(run_static, pool, prompts, args.new_tokens, c),
                        functools.partial(run_staggered, pool, prompts, args.new_tokens, c, args.requests_per_client,
                                          duration)):
                s0 = dict(engine.last_stats)
                r = run()
                time.sleep(0.6)  # the engine process sends stats every 0.25 s while busy, and once idle
                s1 = engine.last_stats
                r["engine_tick_ms"] = (s1["ticking_s"] - s0["ticking_s"]) / max(1, s1["steps"] - s0["steps"]) * 1e3
                runs.append(r)
            for r in runs:
                r["ideal_tok_s"] = ideal
                rows.append(r)
                print(f"C={c:3d} {r['mode']:9s} {r['decode_tok_s']:9.0f} tok/s ({r['decode_tok_s'] / ideal:.3f} of C/tick)"
                      f"  TTFT p50/p99 {r['ttft_ms']['p50']:6.1f}/{r['ttft_ms']['p99']:6.1f} ms"
                      f"  tokens/message {r['tokens_per_message']:.2f}"
                      f"  mean concurrency {r['mean_concurrency']:.1f}  engine tick {r['engine_tick_ms']:.2f} ms"
                      f"  clients' max core {r['client']['max_core_fraction']:.2f}", flush=True)
    finally:
        pool.close()
        handle.stop(grace=2)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""The gRPC serving path alone (issue 23): a stand-in engine emits one token per stream every `--tick-ms` (as the engine
process's per-tick events arrive), C streams of N tokens each, clients in another process. Reports tokens and messages
per second that reach the clients, tokens per message, and the server loop's CPU per message; --profile prints the
server thread's hottest functions. Run on the machine whose host is in question.

    python lab/probes/server_path.py --streams 64 --tokens 256 --tick-ms 2 [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import pstats
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])


class TickEngine:
    """Stands in for the engine process's client (EngineProcess): every tick, one output per live stream."""

    info = {"name": "tick"}

    def __init__(self, tokens: int, tick_s: float):
        self.tokens, self.tick_s = tokens, tick_s
        self.live: dict[int, list] = {}
        self.next_id = 0
        self.task = None

    def submit(self, prompt, params):
        q = asyncio.Queue()
        self.live[self.next_id] = [q, 0]
        self.next_id += 1
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._ticks())
        return self.next_id - 1, q

    async def _ticks(self):
        from jphoton.sequence import Delta, RequestOutput

        while True:
            await asyncio.sleep(self.tick_s)
            for rid, st in list(self.live.items()):
                st[1] += 1
                done = st[1] >= self.tokens
                st[0].put_nowait(RequestOutput(rid, Delta([st[1] % 1000], " tok", "length" if done else None), None,
                                               128, st[1]))
                if done:
                    del self.live[rid]

    def abort(self, request_id):
        self.live.pop(request_id, None)

    def stats(self):
        return {"num_compiles": 0, "shapes_compiled": 0, "shapes_total": 0}

    def has_unfinished_requests(self):
        return bool(self.live)

    def shutdown(self):
        pass


def client(port: int, streams: int, out):
    import grpc

    from server import jphoton_pb2 as pb
    from server import jphoton_pb2_grpc as pb_grpc

    async def one(stub, counts):
        async for m in stub.Generate(pb.GenerateRequest(text="hi")):
            counts[0] += len(m.token_ids)
            counts[1] += 1

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.EngineStub(ch)
            counts = [0, 0]
            t0 = time.perf_counter()
            c0 = time.process_time()
            await asyncio.gather(*(one(stub, counts) for _ in range(streams)))
            out.put({"tokens": counts[0], "messages": counts[1], "wall_s": time.perf_counter() - t0,
                     "client_cpu_s": time.process_time() - c0})

    asyncio.run(main())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--tick-ms", type=float, default=2.0)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from server.app import Server, ServerThread

    server = Server(port=0)
    engine = TickEngine(args.tokens, args.tick_ms / 1e3)
    server.servicer.attach = lambda llm: setattr(server.servicer, "engine", engine)
    handle = ServerThread(server).start(object())
    handle.wait_ready(30)
    prof = cProfile.Profile() if args.profile else None
    cpu = {}

    async def begin():
        cpu["t0"] = time.thread_time()
        if prof:
            prof.enable()

    async def end():
        if prof:
            prof.disable()
        cpu["s"] = time.thread_time() - cpu["t0"]
        if engine.task is not None:
            engine.task.cancel()

    handle.call(begin())
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=client, args=(handle.port, args.streams, q))
    p.start()
    r = q.get(timeout=600)
    p.join()
    handle.call(end())
    handle.stop(grace=1)
    ideal = args.streams / (args.tick_ms / 1e3)
    r.update(tok_s=r["tokens"] / r["wall_s"], ideal_tok_s=ideal, tokens_per_message=r["tokens"] / r["messages"],
             server_loop_cpu_s=cpu["s"], server_us_per_message=cpu["s"] / r["messages"] * 1e6,
             streams=args.streams, tick_ms=args.tick_ms)
    print("RESULT", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

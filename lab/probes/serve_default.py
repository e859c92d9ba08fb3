"""`jphoton serve` with default arguments, as an operator starts it: time to SERVING, a greedy stream every second while
the step shapes compile (in the compile worker on a GPU), all shapes ready, then compiles after ready (must stay 0), and
what the server logged about its background compiles.
    python3 lab/probes/serve_default.py [--model random:llama3.2-1b] [--timeout 400]"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import grpc

from server import jphoton_pb2 as pb
from server import jphoton_pb2_grpc

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="random:llama3.2-1b")
ap.add_argument("--port", type=int, default=50071)
ap.add_argument("--timeout", type=float, default=400)
args = ap.parse_args()
log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
t0 = time.perf_counter()
server = subprocess.Popen([sys.executable, "-m", "jphoton", "serve", "-v", "--model", args.model, "--port", str(args.port)],
                          stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
stub = jphoton_pb2_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{args.port}"))
request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 129))),
                             sampling=pb.SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))


def stats():
    try:
        return stub.GetStats(pb.GetStatsRequest(), timeout=2)
    except grpc.RpcError:
        return None


def stream_rate():
    t = time.perf_counter()
    n = sum(len(m.token_ids) for m in stub.Generate(request, timeout=60))
    return n / (time.perf_counter() - t)


try:
    while (s := stats()) is None:
        if server.poll() is not None or time.perf_counter() - t0 > args.timeout:
            raise SystemExit("the server did not come up:\n" + open(log.name).read()[-3000:])
        time.sleep(0.5)
    serving_s = time.perf_counter() - t0
    during, tokens = [], None
    while not s.all_shapes_ready and time.perf_counter() - t0 < args.timeout:
        during.append(stream_rate())
        s = stats()
    ready_s = time.perf_counter() - t0
    compiles = stats().num_compiles
    after = [stream_rate() for _ in range(10)]
    s = stats()
    log.flush()
    lines = [ln.strip() for ln in open(log.name) if re.search(r"compile worker|background|all \d+ step shapes", ln)]
    print(f"serving after {serving_s:.1f} s; all shapes ready after {ready_s:.1f} s ({s.shapes_compiled}/"
          f"{s.shapes_total}); {len(during)} streams during at {sum(during) / max(len(during), 1):.0f} tok/s mean, "
          f"after {sum(after) / len(after):.0f} tok/s; compiles after ready {s.num_compiles - compiles}")
    print("\n".join(lines[-6:]))
finally:
    server.terminate()
    server.wait(timeout=60)

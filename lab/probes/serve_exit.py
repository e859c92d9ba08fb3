"""How long `jphoton serve` takes to exit on SIGTERM after serving, with 1 and 2 frontends (issue 23: on the H200 the
serving benchmark's server logged "the engine process did not exit in 30 s"). Prints each run's log lines after the
signal, stamped with seconds since it.

    python3 lab/probes/serve_exit.py --model random:llama3.2-1b --frontends 1 2 --wait-ready 240
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

import grpc

from server import jphoton_pb2 as pb
from server import jphoton_pb2_grpc as pb_grpc


def run(model: str, frontends: int, port: int, wait_ready: float, requests: int) -> None:
    cmd = [sys.executable, "-m", "jphoton", "serve", "--model", model, "--port", str(port), "--frontends",
           str(frontends), "-v", "--grace", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    serving = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip()))
            if "jphoton: SERVING" in line:
                serving.set()

    threading.Thread(target=read, daemon=True).start()
    t0 = time.monotonic()
    if not serving.wait(600):
        print("never SERVING", lines[-20:])
        proc.kill()
        return
    print(f"frontends {frontends}: SERVING after {time.monotonic() - t0:.1f} s", flush=True)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.EngineStub(ch)
    deadline = time.monotonic() + wait_ready
    while time.monotonic() < deadline and not stub.GetStats(pb.GetStatsRequest()).all_shapes_ready:
        time.sleep(2)
    print(f"  all shapes ready: {stub.GetStats(pb.GetStatsRequest()).all_shapes_ready} after "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    for i in range(requests):
        n = sum(len(m.token_ids) for m in stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[1 + i, 2, 3, 4] * 8),
            sampling=pb.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)), timeout=60))
        assert n == 32
    ch.close()
    t_sig = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed after 90 s"
    print(f"  exit {code} {time.monotonic() - t_sig:.1f} s after SIGTERM; log after the signal:", flush=True)
    for t, line in lines:
        if t >= t_sig - 0.05:
            print(f"  +{t - t_sig:6.2f} {line[:220]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--frontends", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--port", type=int, default=50093)
    ap.add_argument("--wait-ready", type=float, default=240.0, help="wait this long for every shape before the requests")
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()
    for f in args.frontends:
        run(args.model, f, args.port + f, args.wait_ready, args.requests)


if __name__ == "__main__":
    main()

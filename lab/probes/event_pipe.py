"""The engine -> frontend event pipe under a busy frontend (issue 23): does the engine block sending its per-tick
event lists when the frontend's event loop keeps the GIL busy? A sender process pickles one list of C output tuples
every --tick-ms (the engine loop's `_flush`) and reports the time it spent blocked in the send; the receiver process
runs the frontend's reader thread (recv, unpickle, call_soon_threadsafe) beside an asyncio loop that burns --busy of
its time in Python (the gRPC writes). --reader bulk reads every framed list waiting in the pipe with one os.read.

    python lab/probes/event_pipe.py --streams 32 --tick-ms 1 --busy 0.8 --reader conn bulk
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import pickle
import struct
import sys
import threading
import time

_HEADER = struct.Struct("!I")


def sender(conn, fd: int, framing: str, streams: int, tick_s: float, seconds: float, result) -> None:
    out = [("out", i, [7], " tok", None, None, 128, 5, None, None) for i in range(streams)]
    blocked, ticks, t_end = 0.0, 0, time.perf_counter() + seconds
    next_tick = time.perf_counter()
    while (now := time.perf_counter()) < t_end:
        if now < next_tick:  # the device step (GIL released in the engine too)
            time.sleep(next_tick - now)
        next_tick += tick_s
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.perf_counter()
        if framing == "conn":
            conn.send_bytes(data)
        else:
            view = memoryview(_HEADER.pack(len(data)) + data)
            while view:
                view = view[os.write(fd, view):]
        blocked += time.perf_counter() - t0
        ticks += 1
    conn.send_bytes(b"") if framing == "conn" else os.write(fd, _HEADER.pack(0))
    result.put((ticks, blocked))


def receiver(conn, fd: int, framing: str, busy: float, result) -> None:
    sys.setswitchinterval(0.001)
    loop = asyncio.new_event_loop()
    got = {"lists": 0, "wakes": 0, "done": False}

    def dispatch(lists):
        got["lists"] += len(lists)
        got["wakes"] += 1

    def read_conn():
        while True:
            data = conn.recv_bytes()
            if not data:
                break
            loop.call_soon_threadsafe(dispatch, [pickle.loads(data)])
        loop.call_soon_threadsafe(loop.stop)

    def read_bulk():
        buf = b""
        while True:
            chunk = os.read(fd, 1 << 20)
            buf += chunk
            lists, i, end = [], 0, False
            while len(buf) - i >= 4:
                n = _HEADER.unpack_from(buf, i)[0]
                if n == 0:
                    end = True
                    break
                if len(buf) - i - 4 < n:
                    break
                lists.append(pickle.loads(buf[i + 4:i + 4 + n]))
                i += 4 + n
            buf = buf[i:]
            if lists:
                loop.call_soon_threadsafe(dispatch, lists)
            if end:
                break
        loop.call_soon_threadsafe(loop.stop)

    async def burn():  # the event loop's own work: `busy` of each ms in Python, then a yield
        while True:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < busy * 1e-3:
                pass
            await asyncio.sleep((1 - busy) * 1e-3)

    threading.Thread(target=read_conn if framing == "conn" else read_bulk, daemon=True).start()
    loop.create_task(burn())
    loop.run_forever()
    result.put((got["lists"], got["wakes"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tick-ms", type=float, default=1.0)
    ap.add_argument("--busy", type=float, nargs="+", default=[0.0, 0.5, 0.8, 0.95])
    ap.add_argument("--reader", nargs="+", default=["conn", "bulk"], choices=("conn", "bulk"))
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for busy in args.busy:
        for framing in args.reader:
            r, w = ctx.Pipe(duplex=False)
            res = ctx.Queue()
            rx = ctx.Process(target=receiver, args=(r, r.fileno(), framing, busy, res))
            tx = ctx.Process(target=sender, args=(w, w.fileno(), framing, args.streams, args.tick_ms * 1e-3,
                                                  args.seconds, res))
            rx.start()
            tx.start()
            a, b = res.get(), res.get()
            tx.join()
            rx.join()
            (ticks, blocked), (lists, wakes) = (a, b) if isinstance(a[1], float) else (b, a)
            print(f"busy {busy:.2f} reader {framing:4s}: {ticks / args.seconds:7.0f} lists/s sent (target "
                  f"{1e3 / args.tick_ms:.0f}), sender blocked {1e3 * blocked / ticks:.3f} ms a list, "
                  f"{lists / max(wakes, 1):.2f} lists a wake-up", flush=True)


if __name__ == "__main__":
    main()

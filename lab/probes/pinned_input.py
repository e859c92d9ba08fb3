"""A step's packed input three ways (issue 23: the launch's host time): as a numpy array (copied to the device by the
call, as the runner does), as a pinned-host jax array written in place through its buffer pointer (the program copies
it to the device itself), and already on the device (the floor). Host time per call, with ~76 other argument leaves
and a queued matmul keeping the device busy, as in the pipelined loop; and whether the program reads what the host
wrote last (the in-place writes must reach it).

    python3 lab/probes/pinned_input.py [--words 20000] [--leaves 76] [--calls 2000]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=20000)
    ap.add_argument("--leaves", type=int, default=76)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--big", type=int, default=4096, help="side of the busy-keeping matmul")
    args = ap.parse_args()
    dev = jax.devices()[0]
    kinds = [m.kind for m in dev.addressable_memories()]
    host_kind = "pinned_host" if "pinned_host" in kinds and dev.platform != "cpu" else None
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    pinned = on_dev.with_memory_kind(host_kind) if host_kind else on_dev
    leaves = [jax.device_put(jnp.full((256, 256), i, jnp.bfloat16), on_dev) for i in range(args.leaves)]
    big = jax.device_put(jnp.ones((args.big, args.big), jnp.bfloat16), on_dev)

    def body(leaves, big, x):
        if host_kind:
            x = jax.device_put(x, on_dev)  # (inside the program: a DMA the device runs, no host staging)
        acc = sum(leaf[0, 0].astype(jnp.float32) for leaf in leaves)
        y = (big @ big)[0, 0].astype(jnp.float32)  # keeps the device busy a little
        return x.sum() + acc + y, x[:4]

    f_np = jax.jit(lambda leaves, big, x: body(leaves, big, x) if not host_kind else body(leaves, big, x))
    f_host = jax.jit(body, in_shardings=(None, None, pinned)) if host_kind else jax.jit(body)
    f_dev = jax.jit(lambda leaves, big, x: (x.sum() + sum(leaf[0, 0].astype(jnp.float32) for leaf in leaves)
                                           + (big @ big)[0, 0].astype(jnp.float32), x[:4]))

    # ring of 4 pinned buffers and their writable numpy views
    ring = [jax.device_put(np.zeros(args.words, np.int32), pinned) for _ in range(4)]
    views = [np.ctypeslib.as_array((ctypes.c_int32 * args.words).from_address(b.unsafe_buffer_pointer()))
             for b in ring]
    src = np.arange(args.words, dtype=np.int32)
    on_device = jax.device_put(src, on_dev)

    def run(name):
        ts, wrong = [], 0
        out = None
        for i in range(args.calls):
            k = i % 4
            if name == "numpy":
                buf = src.copy()
                buf[:4] = i
                t = time.perf_counter()
                out = f_np(leaves, big, buf)
            elif name == "pinned":
                views[k][:] = src
                views[k][:4] = i
                t = time.perf_counter()
                out = f_host(leaves, big, ring[k])
            else:
                t = time.perf_counter()
                out = f_dev(leaves, big, on_device)
            ts.append(time.perf_counter() - t)
            if i % 3 == 0:  # the pipelined loop waits for a step two calls back; check what it read
                got = np.asarray(out[1])
                wrong += name != "on_device" and int(got[0]) != i
        jax.block_until_ready(out)
        return {"host_us_p50": round(statistics.median(ts) * 1e6, 1), "host_us_mean": round(statistics.fmean(ts) * 1e6, 1),
                "wrong_reads": wrong}

    res = {"jax": jax.__version__, "device": dev.device_kind, "host_memory": host_kind, "words": args.words,
           "leaves": args.leaves}
    for name in ("numpy", "pinned", "on_device", "numpy", "pinned", "on_device"):
        run(name)  # warm
        res.setdefault(name, []).append(run(name))
    print(json.dumps(res))


if __name__ == "__main__":
    main()

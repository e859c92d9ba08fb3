"""Host cost of one jitted call against the number of array arguments, by call path (issues 22, 23, 25: per-layer
weights give the engine's step ~6 argument leaves a layer). Each call's body reads one element of every argument, so
none is pruned; the GPU is kept busy by a queued kernel, as in the pipelined loop. Prints one JSON line.

    python3 lab/probes/leaf_dispatch.py [--leaves 8 104 200] [--calls 3000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp


def timed(fn, args, calls):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        out = fn(*args)
        ts.append(time.perf_counter() - t)
        if len(ts) % 200 == 0:
            jax.block_until_ready(out)  # bounded queue
    jax.block_until_ready(out)
    return round(statistics.median(ts) * 1e6, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, nargs="+", default=[8, 104, 200])
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    dev = jax.devices()[0]
    out = {"device": dev.device_kind, "jax": jax.__version__}
    for n in args.leaves:
        params = [jax.device_put(jnp.full((256, 256), i, jnp.bfloat16), dev) for i in range(n)]
        x = jax.device_put(jnp.zeros((64,), jnp.int32), dev)

        def body(p, x):
            return x + sum(a[0, 0].astype(jnp.int32) for a in p)

        s = jax.sharding.SingleDeviceSharding(dev)
        plain = jax.jit(body)
        pinned = jax.jit(body, in_shardings=s, out_shardings=s)
        compiled = pinned.lower(params, x).compile()
        out[n] = {"jit": timed(plain, (params, x), args.calls), "jit_pinned": timed(pinned, (params, x), args.calls),
                  "compiled": timed(compiled, (params, x), args.calls)}
        print(n, out[n], flush=True)
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

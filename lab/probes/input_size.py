"""Host cost of a jitted call's host (numpy) int32 input by its length, against the same input already on the device
(issue 23: the engine's step input is 36,140 words at the default 1B engine, 32,768 of them the decode rows' page
tables, and `lab/probes/graph_update.py` measured the host input at ~0.1-0.15 ms of a 0.35 ms dispatch). The call has
`--leaves` other device arguments, as the step has its weights; the GPU is kept busy by the earlier calls of a group.
Also `jax.device_put` of the same arrays alone. Prints one JSON line.

    python3 lab/probes/input_size.py [--sizes 1024 4096 36140] [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn, calls: int) -> float:
    ts = []
    out = None
    for i in range(calls):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
        if i % 4 == 3:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return round(statistics.median(ts) * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384, 36140])
    ap.add_argument("--leaves", type=int, default=150)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    dev = jax.devices()[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    params = [jax.device_put(jnp.full((512, 512), i, jnp.bfloat16), dev) for i in range(args.leaves)]
    big = jax.device_put(jnp.ones((2048, 2048), jnp.float32), dev)
    out = {"device": dev.device_kind, "jax": jax.__version__, "leaves": args.leaves}
    for n in args.sizes:
        @jax.jit
        def body(p, x, big):  # some device work (a 2k matmul) so that the queue stays busy
            y = big @ big
            return x[:64] + sum(a[0, 0].astype(jnp.int32) for a in p) + y[0, :64].astype(jnp.int32)

        f = jax.jit(body, in_shardings=s, out_shardings=s)
        host = np.arange(n, dtype=np.int32)
        on_dev = jax.device_put(host, dev)
        f(params, host, big).block_until_ready()
        out[n] = {"host_input_us": timed(lambda f=f, x=host: f(params, x, big), args.calls),
                  "device_input_us": timed(lambda f=f, x=on_dev: f(params, x, big), args.calls),
                  "device_put_us": timed(lambda x=host: jax.device_put(x, dev), args.calls)}
        print(n, out[n], flush=True)
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

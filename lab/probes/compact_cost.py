"""Device us per call of the filtered sampler's kernel (pallas_kernels/filtered_sample.py) by top-k / top-p setting,
rows and its top-k candidate compaction cap (issue 25; `--caps 4096 1`: 1 never compacts, the extra loops' cost alone),
on flat rows of `--vocab`. Each call runs `--iters` times inside one jitted fori_loop (each iteration's logits depend on
the last one's tokens, so XLA cannot hoist the call): device time, not dispatch; best of 3.

    python3 lab/probes/compact_cost.py [--caps 0 4096 1] [--rows 1 32] [--block 2048]
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jphoton.engine import sampling  # noqa: E402
from pallas_kernels.filtered_sample import filtered_sample  # noqa: E402


def device_us_per_call(fn, logits: jax.Array, iters: int) -> float:
    """Device microseconds per call of fn(logits [R, V], i) -> int32 [R], best of 3 runs of one jitted loop."""
    R = logits.shape[0]

    @jax.jit
    def loop(lg0):
        def body(i, carry):
            lg, acc = carry
            tok = fn(lg, i)
            return lg + (tok[:, None] < -5).astype(jnp.float32), acc + tok
        return jax.lax.fori_loop(0, iters, body, (lg0, jnp.zeros(R, jnp.int32)))[1]

    loop(logits).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        loop(logits).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", type=int, nargs="*", default=[0], help="compact_cap values (0: the kernel's default)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--block", type=int, default=None, help="the sweeps' block (default: filtered_sample's)")
    ap.add_argument("--settings", nargs="+", default=["50,1.0", "50,0.9", "0,0.9", "1000,1.0"], help="top_k,top_p")
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    for R in a.rows:
        rng = np.random.default_rng(0)
        lg0 = jnp.asarray(rng.normal(size=(R, a.vocab)).astype(np.float32))
        key = jnp.asarray(rng.integers(0, 2**31, (R, 2)).astype(np.uint32))
        for k, p in (map(float, x.split(",")) for x in a.settings):
            k = int(k)
            for cap in a.caps:

                def fn(lg, i, k=k, p=p, cap=cap, R=R, key=key):
                    noisy = lg + sampling._gumbel(lg, key, jnp.full(R, i, jnp.int32))  # the noise tests use too
                    return filtered_sample(lg, noisy, jnp.full(R, k, jnp.int32), jnp.full(R, p, jnp.float32),
                                           **({"block": a.block} if a.block else {}),
                                           **({"compact_cap": cap} if cap else {}))
                us = device_us_per_call(fn, lg0, a.iters)
                print(f"R={R:2d} top_k {k:4d} top_p {p}: cap {cap:5d} {us:7.1f} us", flush=True)


if __name__ == "__main__":
    main()

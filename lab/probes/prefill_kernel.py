"""The paged prefill attention kernel on the GPU (issue 23): its error against the float32 reference and its time per
call against the engine's plain-JAX static attention (a gather of the context bucket), at Llama-3.2-1B shapes.

Each case: R rows, a T-token chunk per row starting at `start` (so it attends over start + T keys), pages of 16 tokens
at shuffled places in a pool of `--layers` layers; the static path attends over the smallest bucket of 8 * 4^k pages
that holds them (what the engine's scheduler picked). Timed: one jitted call that runs the attention of every layer in
turn (unrolled, each layer's output feeding the next one's queries, so the calls are chained and the KV comes from
HBM), microseconds per layer, median of 3 rounds.

    python3 lab/probes/prefill_kernel.py [--config 128,64,4,2] [--out $OUT/prefill_kernel.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

CASES = [  # (R, T, start)
    (1, 128, 0), (4, 128, 0), (1, 32, 96), (1, 512, 0), (1, 512, 1536), (1, 512, 7680), (4, 128, 3968),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs=3, default=(32, 8, 64), help="Hq Hkv head_dim")
    ap.add_argument("--calls", type=int, default=20, help="chained calls of all layers per round")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--config", default=None, help="tile_rows,block_kv,num_warps,num_stages (default: the kernel's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import device_info
    from jphoton.engine.attention import paged_attention_static
    from pallas_kernels.paged_prefill_attention import (
        PagedPrefillConfig,
        paged_prefill_attention,
        paged_prefill_attention_reference,
    )

    cfg = PagedPrefillConfig(*map(int, args.config.split(","))) if args.config else None

    def chained(fn, layers):
        def all_layers(q, k, v, t, s, n):
            for i in range(layers):  # unrolled (an XLA while loop would sync the host each iteration)
                q = fn(q, k, v, t, s, n, i)
            return q
        return jax.jit(all_layers)

    Hq, Hkv, hd = args.heads
    ps, P = 16, 512
    out = {"device": device_info(), "heads": [Hq, Hkv, hd], "config": args.config, "cases": []}
    print(json.dumps(out["device"]), flush=True)
    rng = np.random.default_rng(0)
    for R, T, start in CASES:
        n_pages = -(-(start + T) // ps)
        total = R * n_pages + 1
        L = args.layers
        k = jnp.asarray(rng.standard_normal((L, total * ps, Hkv, hd)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((L, total * ps, Hkv, hd)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((R, T, Hq, hd)), jnp.bfloat16)
        table = np.full((R, P), total - 1, np.int32)
        perm = rng.permutation(total - 1)
        for r in range(R):
            table[r, :n_pages] = perm[r * n_pages:(r + 1) * n_pages]
        table = jnp.asarray(table)
        s = jnp.full((R,), start, jnp.int32)
        n = jnp.full((R,), T, jnp.int32)
        bucket = next(b for b in (8, 32, 128, 512) if b >= n_pages)

        def kern(q, k, v, t, s, n, layer=0):
            return paged_prefill_attention(q, k, v, layer, t, s, n, page_size=ps, config=cfg)

        def stat(q, k, v, t, s, n, layer=0, T=T, bucket=bucket):
            return paged_attention_static(q, k, v, layer, t, s[:, None] + jnp.arange(T)[None, :], s + n,
                                          page_size=ps, num_pages=bucket)

        got = np.asarray(jax.jit(kern)(q, k, v, table, s, n), np.float32)
        ref = np.asarray(paged_prefill_attention_reference(q, k, v, 0, table, s, n, page_size=ps))
        st = np.asarray(jax.jit(stat)(q, k, v, table, s, n), np.float32)
        row = {"R": R, "T": T, "start": start, "bucket_pages": bucket,
               "kernel_max_err": float(np.abs(got - ref).max()), "static_max_err": float(np.abs(st - ref).max())}
        for name, fn in (("kernel_us", chained(kern, L)), ("static_us", chained(stat, L))):
            fn(q, k, v, table, s, n).block_until_ready()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                x = q
                for _ in range(args.calls):
                    x = fn(x, k, v, table, s, n)
                x.block_until_ready()
                times.append(1e6 * (time.perf_counter() - t0) / (args.calls * L))
            row[name] = round(sorted(times)[1], 1)
        out["cases"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

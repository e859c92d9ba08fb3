"""Device cost of top-k/top-p sampling variants on [R, V] float32 logits (issue 25): the sort-based sampler, lax.top_k
for bounded k, and threshold searches over the ordered float keys with N thresholds a pass.

    python3 lab/probes/topp_cost.py [--vocab 128256] [--rows 1 32] [--out FILE]

Each variant runs `--iters` times inside one jitted fori_loop (each iteration's logits depend on the last one's tokens,
so nothing is hoisted); the figure is device-side microseconds per call."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jphoton import sampling
from lab.common import device_us_per_call


def keys_of(x):
    """float32 -> uint32 keys in the same order (NaN-free input)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type(b ^ ((b >> 31) & 0x7FFFFFFF), jnp.uint32) ^ jnp.uint32(0x80000000)


def search(keys, weights, target, lo, hi, n, passes):
    """Largest key t in [lo, hi] with sum(weights[keys >= t]) >= target, by `passes` rounds of n thresholds."""
    for _ in range(passes):
        width = hi - lo
        j = jnp.arange(1, n + 1, dtype=jnp.uint32)
        step = width // jnp.uint32(n + 1) + 1
        t = lo[:, None] + jnp.minimum(step[:, None] * j[None, :], width[:, None])  # [R, n]
        mass = jnp.sum(jnp.where(keys[:, :, None] >= t[:, None, :], weights[:, :, None], 0), axis=1)  # [R, n]
        ok = mass >= target[:, None]
        new_lo = jnp.max(jnp.where(ok, t, lo[:, None]), axis=1)
        new_hi = jnp.min(jnp.where(ok, hi[:, None], t - 1), axis=1)
        lo, hi = new_lo, jnp.maximum(new_hi, new_lo)
    return lo


def filt_search(scaled, top_p, n, passes):
    m = jnp.max(scaled, axis=-1, keepdims=True)
    e = jnp.exp(scaled - m)
    z = jnp.sum(e, axis=-1)
    keys = keys_of(scaled)
    lo = keys_of(m[:, 0] - 40.0)
    hi = keys_of(m[:, 0])
    t = search(keys, e, top_p * z, lo, hi, n, passes)
    return jnp.where(keys >= t[:, None], scaled, -jnp.inf)


KERNEL_CONFIGS = ((4096, 1024, 8, 1), (4096, 4096, 8, 1), (4096, 2048, 16, 1), (8192, 4096, 16, 1), (4096, 1024, 8, 3),
                  (4096, 512, 4, 1))


def variants(V, kernel_configs=KERNEL_CONFIGS):
    def plain(lg, temp, key, idx):
        return sampling.sample_plain(lg, temp, key, idx)

    def sort_p(lg, temp, key, idx):
        R = lg.shape[0]
        return sampling.sample_reference(lg, temp, jnp.zeros(R, jnp.int32), jnp.full(R, 0.9), key, idx)

    def sort_k(lg, temp, key, idx):
        R = lg.shape[0]
        return sampling.sample_reference(lg, temp, jnp.full(R, 50, jnp.int32), jnp.ones(R), key, idx)

    out = {"plain": plain, "sort_top_p": sort_p, "sort_top_k": sort_k}
    for kind, k, p in (("top_p", 0, 0.9), ("top_k", 50, 1.0), ("top_k_p", 50, 0.9), ("none", 0, 1.0),
                       ("top_p_0.5", 0, 0.5), ("one_top_p_row", -1, 0.9)):
        def new(lg, temp, key, idx, k=k, p=p):
            R = lg.shape[0]
            if k == -1:  # one row of the bucket asks for top-p, the others for nothing
                kk, pp = jnp.zeros(R, jnp.int32), jnp.ones(R).at[0].set(p)
            else:
                kk, pp = jnp.full(R, k, jnp.int32), jnp.full(R, p)
            return sampling.sample(lg, temp, kk, pp, key, idx)
        out[f"sample_{kind}"] = new
    from pallas_kernels.filtered_sample import filtered_sample, filtered_sample_xla
    for kind, k, p in (("top_p", 0, 0.9), ("top_k", 50, 1.0), ("top_k_p", 50, 0.9), ("none", 0, 1.0),
                       ("top_p_0.5", 0, 0.5)):
        for block, cb, warps, stages, *more in kernel_configs:
            programs = more[0] if more and more[0] else None
            unroll = more[1] if len(more) > 1 else 1

            def kern(lg, temp, key, idx, k=k, p=p, block=block, cb=cb, warps=warps, stages=stages,
                     programs=programs, unroll=unroll):
                R = lg.shape[0]
                noisy = lg + sampling._gumbel(lg, key, idx)
                return filtered_sample(lg, noisy, jnp.full(R, k, jnp.int32), jnp.full(R, p), block=block,
                                       count_block=cb, num_warps=warps, num_stages=stages, programs=programs,
                                       unroll=unroll)
            tag = (f"p{programs}" if programs else "") + (f"u{unroll}" if unroll > 1 else "")
            out[f"kernel_{kind}_b{block}c{cb}w{warps}s{stages}{tag}"] = kern
        def xla(lg, temp, key, idx, k=k, p=p):
            R = lg.shape[0]
            noisy = lg + sampling._gumbel(lg, key, idx)
            return filtered_sample_xla(lg, noisy, jnp.full(R, k, jnp.int32), jnp.full(R, p))
        out[f"xla_loop_{kind}"] = xla
    from pallas_kernels.filtered_sample import prephase

    def prephase_only(lg, temp, key, idx):  # the XLA reductions every filtered step runs before the kernel
        R = lg.shape[0]
        noisy = lg + sampling._gumbel(lg, key, idx)
        m, m_low, (lo, hi, cand, done, target) = prephase(lg, noisy, jnp.full(R, 0.9))
        return cand + (m > m_low).astype(jnp.int32) + (lo > hi) + done + (target > 0)
    out["prephase"] = prephase_only
    for k in (16, 64, 256):
        def topk(lg, temp, key, idx, k=k):
            v, i = jax.lax.top_k(lg, k)
            return i[:, 0] + (v[:, -1] > 1e30).astype(jnp.int32)
        out[f"lax_top_k_{k}"] = topk
    for n, p in ((1, 32), (3, 16), (15, 8), (63, 6), (255, 4)):
        def srch(lg, temp, key, idx, n=n, p=p):
            f = filt_search(lg, jnp.full(lg.shape[0], 0.9), n, p)
            return sampling.sample_plain(f, temp, key, idx)
        out[f"search_n{n}_p{p}"] = srch
    return out


def timed(fn, R, V, iters, scale=1.0):
    rng = np.random.default_rng(0)
    lg0 = jnp.asarray((rng.normal(size=(R, V)) * scale).astype(np.float32))
    temp = jnp.ones(R)
    key = jnp.asarray(rng.integers(0, 2**31, (R, 2)).astype(np.uint32))
    return device_us_per_call(lambda lg, i: fn(lg, temp, key, jnp.full(R, i, jnp.int32)), lg0, iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out")
    ap.add_argument("--kernel-configs", nargs="*", default=None,
                    help="block,count_block,warps,stages[,programs a row (0: default)[,unroll]] of the kernel variants "
                         "(default: the sweep of 2026-11-26)")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0], help="logit std (1: flat, random weights)")
    a = ap.parse_args()
    res = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "vocab": a.vocab, "us_per_call": {}}
    configs = (tuple(tuple(map(int, c.split(","))) for c in a.kernel_configs) if a.kernel_configs
               else KERNEL_CONFIGS)
    for name, fn in variants(a.vocab, configs).items():
        if a.only and name not in a.only:
            continue
        for scale in a.scales:
            for R in a.rows:
                try:
                    us = timed(fn, R, a.vocab, a.iters, scale)
                except Exception as e:  # noqa: BLE001 - a config that does not compile: say so, go on
                    print(f"{name:24s} std={scale:4.1f} R={R:3d} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                res["us_per_call"][f"{name}/R{R}/std{scale}"] = round(us, 1)
                print(f"{name:24s} std={scale:4.1f} R={R:3d} {us:9.1f} us", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

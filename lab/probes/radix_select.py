"""Radix-select top-k / top-p thresholds with per-row histograms (scatter-add), a fixed number of XLA passes: the
cost of each piece on the GPU (issue 25). `python3 lab/probes/radix_select.py [--rows 1 32] [--out FILE]`."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jphoton import sampling
from lab.common import device_us_per_call

LEVELS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of the unsigned order key, top down


def ukeys(x):
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(k, jnp.uint32) ^ jnp.uint32(0x80000000)


def threshold(u, w, target):
    """Largest unsigned key t with sum(w[u >= t]) >= target, per row. u [R, V] uint32, w [R, V] float32 >= 0."""
    R = u.shape[0]
    rows = jnp.arange(R)[:, None]
    prefix = jnp.zeros(R, jnp.uint32)
    above = jnp.zeros(R, jnp.float32)
    done_bits = 0
    for shift, bits in LEVELS:
        nb = 1 << bits
        in_prefix = (u >> (shift + bits)) == (prefix[:, None] >> (shift + bits)) if done_bits else True
        b = ((u >> shift) & jnp.uint32(nb - 1)).astype(jnp.int32)
        hist = jnp.zeros((R, nb), jnp.float32).at[rows, b].add(jnp.where(in_prefix, w, 0.0))
        cum = above[:, None] + jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # mass at or above each bin
        ok = cum >= target[:, None]
        sel = jnp.max(jnp.where(ok, jnp.arange(nb)[None, :], 0), axis=1)  # bin 0 always holds at the first level
        above = jnp.where(sel + 1 < nb, jnp.take_along_axis(cum, jnp.minimum(sel + 1, nb - 1)[:, None], 1)[:, 0]
                          - 0.0, above) if False else jnp.take_along_axis(
            jnp.concatenate([cum[:, 1:], above[:, None]], axis=1), sel[:, None], 1)[:, 0]
        prefix = prefix | (sel.astype(jnp.uint32) << shift)
        done_bits += bits
    return prefix


def radix_filtered(scaled, noisy, top_k, top_p):
    R, V = scaled.shape
    u = ukeys(scaled)
    use_k = (top_k > 0) & (top_k < V)
    tk = threshold(u, jnp.ones_like(scaled), jnp.where(use_k, top_k, 0).astype(jnp.float32))
    tk = jnp.where(use_k, tk, 0)
    m = jnp.max(scaled, axis=1, keepdims=True)
    e = jnp.where(u >= tk[:, None], jnp.exp(scaled - m), 0.0)
    zk = jnp.sum(e, axis=1)
    tp = threshold(u, e, top_p * zk)
    tp = jnp.where(top_p < 1.0, tp, 0)
    t = jnp.maximum(tk, tp)
    return jnp.argmax(jnp.where(u >= t[:, None], noisy, -jnp.inf), axis=1).astype(jnp.int32)


def check():
    from jphoton.sampling import _filter_top_k_top_p
    rng = np.random.default_rng(1)
    R, bad = 6, 0
    for V in (1000, 5000):
        for scale in (0.3, 1, 5):
            x = jnp.asarray((rng.normal(size=(R, V)) * scale).astype(np.float32))
            y = x + jnp.asarray(rng.gumbel(size=(R, V)).astype(np.float32))
            for k, p in ((0, 0.1), (0, 0.5), (0, 0.9), (0, 0.99), (50, 1.0), (1, 1.0), (3, 0.5), (200, 0.9),
                         (0, 1.0), (V, 0.8)):
                kk, pp = jnp.full(R, k, jnp.int32), jnp.full(R, p, jnp.float32)
                f = _filter_top_k_top_p(x, kk, pp)
                ref = np.asarray(jnp.argmax(jnp.where(jnp.isfinite(f), y, -jnp.inf), axis=-1))
                a = np.asarray(jax.jit(radix_filtered)(x, y, kk, pp))
                if (a != ref).any():
                    bad += 1
                    print("radix", V, scale, k, p, a, ref)
    print("bad", bad)


def timed(fn, R, V, iters=50):
    rng = np.random.default_rng(0)
    lg0 = jnp.asarray(rng.normal(size=(R, V)).astype(np.float32))
    key = jnp.asarray(rng.integers(0, 2**31, (R, 2)).astype(np.uint32))
    return device_us_per_call(lambda lg, i: fn(lg, key, jnp.full(R, i, jnp.int32)), lg0, iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.check:
        return check()

    def noisy(lg, key, idx):
        return lg + sampling._gumbel(lg, key, idx)

    def hist(lg, key, idx):
        R, V = lg.shape
        b = (ukeys(lg) >> 21).astype(jnp.int32)
        h = jnp.zeros((R, 2048), jnp.float32).at[jnp.arange(R)[:, None], b].add(jnp.exp(lg))
        return jnp.argmax(h, axis=1).astype(jnp.int32)

    variants = {
        "plain": lambda lg, key, idx: sampling.sample_plain(lg, jnp.ones(lg.shape[0]), key, idx),
        "one_histogram": hist,
        "radix_top_p": lambda lg, key, idx: radix_filtered(lg, noisy(lg, key, idx), jnp.zeros(lg.shape[0], jnp.int32),
                                                           jnp.full(lg.shape[0], 0.9)),
        "radix_top_k": lambda lg, key, idx: radix_filtered(lg, noisy(lg, key, idx),
                                                           jnp.full(lg.shape[0], 50, jnp.int32), jnp.ones(lg.shape[0])),
        "radix_top_k_p": lambda lg, key, idx: radix_filtered(lg, noisy(lg, key, idx),
                                                             jnp.full(lg.shape[0], 50, jnp.int32),
                                                             jnp.full(lg.shape[0], 0.9)),
    }
    res = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "us_per_call": {}}
    for name, fn in variants.items():
        for R in a.rows:
            us = timed(fn, R, a.vocab)
            res["us_per_call"][f"{name}/R{R}"] = round(us, 1)
            print(f"{name:16s} R={R:3d} {us:8.1f} us", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

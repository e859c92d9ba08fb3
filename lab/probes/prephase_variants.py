"""Device us per call of the filtered sampler with its batch-wide prephase as it was ("full": max, min, mass,
and the top-p rejection test of the first two candidates) against the "light" one (max, min, mass and the first
candidate only; the kernel's own sweeps test it; the prephase since). Every row with a top-k ignores the full
prephase's tests (`_select_row` starts from its top-k set), so for top-k batches they are two wasted passes over
[R, V]. Also counts the tokens on which the two differ (none expected but for float-summation ties). Issue 25.
`python3 lab/probes/prephase_variants.py [--rows 1 8 32]`"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jphoton import sampling
from lab.common import device_us_per_call
from pallas_kernels import filtered_sample as fs


def full(scaled, noisy, top_p):  # the prephase before 2026-11-28 (two rejection tests)
    keys = fs.float_keys(scaled)
    m = jnp.max(scaled, axis=1)
    m_low = jnp.min(jnp.where(scaled > -jnp.inf, scaled, jnp.inf), axis=1)
    e = jnp.exp(scaled - m[:, None])
    z = jnp.sum(e, axis=1)
    target = top_p * z

    def above(c):
        kc = jnp.take_along_axis(keys, c[:, None], axis=1)
        over = keys > kc
        return (jnp.sum(jnp.where(over, e, 0.0), axis=1),
                jnp.argmax(jnp.where(over, noisy, -jnp.inf), axis=1).astype(jnp.int32), kc[:, 0])

    c1 = jnp.argmax(noisy, axis=1).astype(jnp.int32)
    a1, c2, _ = above(c1)
    a2, c3, k2 = above(c2)
    ok1, ok2 = a1 < target, a2 < target
    lo = jnp.where(ok1 | ok2, fs.KEY_NEG_INF, k2 + 1)
    hi = fs.float_keys(m)
    done = ok1 | ok2 | (top_p >= 1.0) | (lo >= hi)
    cand = jnp.where(ok1 | (top_p >= 1.0), c1, jnp.where(ok2, c2, c3))
    return m, m_low, (lo, hi, cand, done, target)


def light(scaled, noisy, top_p):  # = pallas_kernels.filtered_sample.prephase since 2026-11-28
    m = jnp.max(scaled, axis=1)
    m_low = jnp.min(jnp.where(scaled > -jnp.inf, scaled, jnp.inf), axis=1)
    z = jnp.sum(jnp.exp(scaled - m[:, None]), axis=1)
    c1 = jnp.argmax(noisy, axis=1).astype(jnp.int32)
    lo, hi = jnp.full(m.shape, fs.KEY_NEG_INF, jnp.int32), fs.float_keys(m)
    return m, m_low, (lo, hi, c1, (top_p >= 1.0) | (lo >= hi), top_p * z)


VARIANTS = {"full": full, "light": light}

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
ap.add_argument("--vocab", type=int, default=128256)
ap.add_argument("--settings", nargs="+", default=["50,1.0", "0,0.9", "50,0.9", "1000,1.0"], help="top_k,top_p")
a = ap.parse_args()
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
for R in a.rows:
    rng = np.random.default_rng(0)
    lg0 = jnp.asarray(rng.normal(size=(R, a.vocab)).astype(np.float32))
    key = jnp.asarray(rng.integers(0, 2**31, (R, 2)).astype(np.uint32))
    for name, pre in VARIANTS.items():
        def alone(lg, i, pre=pre, R=R, key=key):
            noisy = lg + sampling._gumbel(lg, key, jnp.full(R, i, jnp.int32))
            m, m_low, st = pre(lg, noisy, jnp.full(R, 0.9, jnp.float32))
            return st[2] + (m > 1e30).astype(jnp.int32) + (m_low > 1e30).astype(jnp.int32)
        print(f"R={R:2d} prephase {name:5s} alone (with the noise): {device_us_per_call(alone, lg0, 100):7.1f} us",
              flush=True)
    for k, p in (map(float, x.split(",")) for x in a.settings):
        k = int(k)
        toks = {}
        for name, pre in VARIANTS.items():
            fs.prephase = pre  # filtered_sample looks it up by name at trace time

            def fn(lg, i, k=k, p=p, R=R, key=key):
                noisy = lg + sampling._gumbel(lg, key, jnp.full(R, i, jnp.int32))
                return fs.filtered_sample(lg, noisy, jnp.full(R, k, jnp.int32), jnp.full(R, p, jnp.float32))
            us = device_us_per_call(fn, lg0, 100)
            toks[name] = np.stack([np.asarray(jax.jit(fn)(lg0 * (1 + s / 10), s)) for s in range(20)])
            print(f"R={R:2d} top_k {k:4d} top_p {p}: {name:5s} {us:7.1f} us", flush=True)
        fs.prephase = light
        print(f"R={R:2d} top_k {k:4d} top_p {p}: tokens differing full vs light "
              f"{int((toks['full'] != toks['light']).sum())} of {toks['full'].size}", flush=True)

"""Device microseconds of the pieces a sort-free top-k/top-p sampler could be built from (issue 25): XLA sorts and
lax.top_k on small rows, segment maxima, and the fixed rejection passes for top-p. `python3 lab/probes/sampler_pieces.py`"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jphoton import sampling
from lab.common import device_us_per_call


def timed(fn, shape, iters=50):
    lg0 = jnp.asarray(np.random.default_rng(0).normal(size=shape).astype(np.float32))
    return device_us_per_call(fn, lg0, iters)


def keys(x):
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def prephase(lg, i):
    R = lg.shape[0]
    kd = jnp.zeros((R, 2), jnp.uint32)
    y = lg + sampling._gumbel(lg, kd, jnp.full(R, i, jnp.int32))
    m = jnp.max(lg, axis=1, keepdims=True)
    c1 = jnp.argmax(y, axis=1)
    k = keys(lg)
    e = jnp.exp(lg - m)
    k1 = jnp.take_along_axis(k, c1[:, None], 1)
    z = jnp.sum(e, axis=1)
    a1 = jnp.sum(jnp.where(k > k1, e, 0), axis=1)
    c2 = jnp.argmax(jnp.where(k > k1, y, -jnp.inf), axis=1)
    k2 = jnp.take_along_axis(k, c2[:, None], 1)
    a2 = jnp.sum(jnp.where(k > k2, e, 0), axis=1)
    c3 = jnp.argmax(jnp.where(k > k2, y, -jnp.inf), axis=1)
    t = 0.9 * z
    return jnp.where(a1 < t, c1, jnp.where(a2 < t, c2, c3)).astype(jnp.int32)


def segmax(lg, i, seg=32):
    R, V = lg.shape
    n = -(-V // seg)
    x = jnp.pad(lg, ((0, 0), (0, n * seg - V)), constant_values=-jnp.inf).reshape(R, n, seg)
    return jnp.argmax(jnp.max(x, axis=2), axis=1).astype(jnp.int32)


def main():
    R = [1, 32]
    V = 128256
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "us": {}}
    cases = {
        "plain_sampler": (lambda lg, i: sampling.sample_plain(lg, jnp.ones(lg.shape[0]), jnp.zeros((lg.shape[0], 2),
                          jnp.uint32), jnp.full(lg.shape[0], i, jnp.int32)), V),
        "prephase_2cand": (prephase, V),
        "segmax32": (segmax, V),
        "sort_4096": (lambda lg, i: jnp.sort(lg, axis=1)[:, 0].astype(jnp.int32), 4096),
        "sort_8192": (lambda lg, i: jnp.sort(lg, axis=1)[:, 0].astype(jnp.int32), 8192),
        "argsort_4096": (lambda lg, i: jnp.argsort(lg, axis=1)[:, 0].astype(jnp.int32), 4096),
        "top_k64_of_4096": (lambda lg, i: jax.lax.top_k(lg, 64)[1][:, 63], 4096),
        "top_k16_of_4096": (lambda lg, i: jax.lax.top_k(lg, 16)[1][:, 15], 4096),
        "top_k256_of_4096": (lambda lg, i: jax.lax.top_k(lg, 256)[1][:, 255], 4096),
        "top_k8_of_V": (lambda lg, i: jax.lax.top_k(lg, 8)[1][:, 7], V),
        "top_k1_of_V": (lambda lg, i: jax.lax.top_k(lg, 1)[1][:, 0], V),
    }
    only = sys.argv[1:]
    for name, (fn, v) in cases.items():
        if only and name not in only:
            continue
        for r in R:
            us = timed(fn, (r, v))
            out["us"][f"{name}/R{r}"] = round(us, 1)
            print(f"{name:18s} R={r:3d} V={v:6d} {us:8.1f} us", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

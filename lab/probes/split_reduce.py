"""Row reductions over [R, V] logits at few rows (issue 25): does splitting each row into n chunks ([R, n, V/n], then
the n partials) use more of the GPU than XLA's own reduction of R long rows? The plain sampler (Gumbel noise + argmax)
and the max / sum of exp that the top-k/top-p prephase runs, device microseconds per call.

    python3 lab/probes/split_reduce.py [--vocab 128256] [--rows 1 8 32 64] [--splits 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton import sampling  # noqa: E402
from lab.common import device_us_per_call  # noqa: E402


def argmax_split(x: jax.Array, n: int) -> jax.Array:
    """jnp.argmax(x, -1) (first index of the max) as n chunk argmaxes, then the first chunk holding the max."""
    if n == 1:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    R, V = x.shape
    c = V // n
    xr = x.reshape(R, n, c)
    local = jnp.argmax(xr, axis=-1)
    vals = jnp.take_along_axis(xr, local[:, :, None], axis=-1)[:, :, 0]
    best = jnp.argmax(vals, axis=-1)
    return (best * c + jnp.take_along_axis(local, best[:, None], axis=-1)[:, 0]).astype(jnp.int32)


def variants(n):
    def plain(lg, temp, key, idx):
        scaled = lg / temp[:, None]
        noisy = scaled + sampling._gumbel(lg, key, idx)
        return argmax_split(jnp.where((temp > 0)[:, None], noisy, lg), n)

    def greedy(lg, temp, key, idx):
        return argmax_split(lg, n)

    def max_sum(lg, temp, key, idx):  # the prephase's first two passes: max, then sum of exp
        R, V = lg.shape
        xr = lg.reshape(R, n, V // n)
        m = jnp.max(jnp.max(xr, axis=-1), axis=-1)
        z = jnp.sum(jnp.sum(jnp.exp(xr - m[:, None, None]), axis=-1), axis=-1)
        return (z > 1e30).astype(jnp.int32) + (m > 1e30)

    return {"plain": plain, "greedy": greedy, "max_sum": max_sum}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__)
    rng = np.random.default_rng(0)
    for R in a.rows:
        lg0 = jnp.asarray(rng.normal(size=(R, a.vocab)).astype(np.float32))
        temp = jnp.ones(R)
        key = jnp.asarray(rng.integers(0, 2**31, (R, 2)).astype(np.uint32))
        want = None
        for n in a.splits:
            if a.vocab % n:
                continue
            fns = variants(n)
            got = np.asarray(jax.jit(fns["plain"])(lg0, temp, key, jnp.zeros(R, jnp.int32)))
            want = got if want is None else want
            same = (got == want).all()
            line = [f"R={R:3d} split {n:3d}:"]
            for name, fn in fns.items():
                us = device_us_per_call(lambda lg, i, fn=fn, t=temp, k=key, R=R: fn(lg, t, k, jnp.full(R, i, jnp.int32)), lg0,
                                        a.iters)
                line.append(f"{name} {us:7.1f} us")
            print(" ".join(line) + ("" if same else "  TOKENS DIFFER"), flush=True)


if __name__ == "__main__":
    main()

"""Device us per call of the filtered sampler's kernel variants for the top-k candidate compaction (issue 25):
compact_cap values (1: never compacts, the extra loops' cost alone), on flat rows of 128256. --caps needs a kernel
with compact_cap (main since 2026-11-28); without it, any tree.
`python3 lab/probes/compact_cost.py --caps 4096 1 [--rows 1 32] [--block 2048]`"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from jphoton import sampling
from lab.common import device_us_per_call
from pallas_kernels.filtered_sample import filtered_sample

ap = argparse.ArgumentParser()
ap.add_argument("--caps", type=int, nargs="*", default=[0], help="0: the tree's default (main has no compact_cap)")
ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
ap.add_argument("--vocab", type=int, default=128256)
ap.add_argument("--block", type=int, default=None, help="the sweeps' block (default: filtered_sample's)")
ap.add_argument("--settings", nargs="+", default=["50,1.0", "50,0.9", "0,0.9", "1000,1.0"], help="top_k,top_p")
a = ap.parse_args()
for R in a.rows:
    rng = np.random.default_rng(0)
    lg0 = jnp.asarray(rng.normal(size=(R, a.vocab)).astype(np.float32))
    key = jnp.asarray(rng.integers(0, 2**31, (R, 2)).astype(np.uint32))
    for k, p in (map(float, x.split(",")) for x in a.settings):
        k = int(k)
        for cap in a.caps:

            def fn(lg, i, k=k, p=p, cap=cap, R=R, key=key):
                noisy = lg + sampling._gumbel(lg, key, jnp.full(R, i, jnp.int32))
                return filtered_sample(lg, noisy, jnp.full(R, k, jnp.int32), jnp.full(R, p, jnp.float32),
                                       **({"block": a.block} if a.block else {}),
                                       **({"compact_cap": cap} if cap else {}))
            print(f"R={R:2d} top_k {k:4d} top_p {p}: cap {cap:5d} {device_us_per_call(fn, lg0, 100):7.1f} us",
                  flush=True)

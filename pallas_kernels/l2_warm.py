"""Warming the GPU's L2 cache with weights that the next kernels will read, from spare programs of a latency-bound
kernel (a Triton-backend building block, not a kernel of its own).

Why: in a small-batch decode step the DRAM sits idle during the short, latency-bound kernels between the weight
matmuls (attention and its combine at ~5-7 us per layer in the 1B step, RESULTS.md), and every matmul then starts
cold: its first loads wait ~1 us on DRAM, and its last programs finish alone. XLA runs one kernel at a time, so nothing
else can use that idle bandwidth -- unless the latency-bound kernel launches extra programs that read the upcoming
weights. The H100's L2 (50 MB) keeps them until the matmul reads them a few microseconds later, at L2 speed. This is
what persistent "megakernels" get from overlapping one op's weight loads with the previous op, done here without a
grid-wide barrier: the warming programs only read, so nothing waits on them.

A warm program reads its share of each array's first `limit` bytes ([L, rows, W] view of a stacked weight at `layer`,
W elements a row) in [TILE, W] tiles, folds them into an elementwise max (so that the compiler cannot drop the loads)
and stores one [W] row of it to a scratch output that nobody reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ROW = 1024  # elements per row of the [L, rows, ROW] view (2 KiB of bf16)
TILE = 4  # rows per load: 8 KiB of bf16
UNROLL = 4  # loads issued back to back per loop step, before any is used: 32 KiB in flight per program
NUM_SMS = 132  # H100 SXM
PER_SM = 1  # warm programs: enough to make about this many programs per SM with the host kernel's own


def default_programs(busy: int) -> int:
    """How many warm programs to add to a kernel that runs `busy` programs of its own."""
    return max(PER_SM * NUM_SMS - busy, NUM_SMS // 4)


def as_rows(w: jax.Array, limit_bytes: int | None) -> tuple[jax.Array, int] | None:
    """The [L, rows, ROW] view of a stacked weight [L, ...] (a free reshape) and how many of its rows to warm (at most
    limit_bytes' worth, None = all); None if its size per layer is not a multiple of ROW."""
    per_layer = w[0].size
    if per_layer % ROW:
        return None
    rows = per_layer // ROW
    if limit_bytes is not None:
        rows = min(rows, max(limit_bytes // (ROW * w.dtype.itemsize), 0))
    return (w.reshape(w.shape[0], per_layer // ROW, ROW), rows) if rows else None


def _share(rows: int, parts: int) -> int:
    """Rows per part: an equal share, rounded up to whole tiles."""
    per = -(-rows // parts)
    return -(-per // (TILE * UNROLL)) * TILE * UNROLL


def warm(refs, limits: tuple[int, ...], layer, part, parts: int, out_ref) -> None:
    """Inside a Triton-backend kernel: program `part` of `parts` reads its share of rows [0, limit) of each ref
    [L, rows, ROW] at `layer`, and stores a [ROW] digest of them to out_ref[part]."""
    digest = jnp.full((TILE, ROW), -jnp.inf, jnp.float32)
    cols = jnp.arange(ROW, dtype=jnp.int32)
    for ref, limit in zip(refs, limits, strict=True):
        per = _share(limit, parts)
        lo = part * per

        def body(i, acc, ref=ref, limit=limit, lo=lo):
            tiles = []
            for u in range(UNROLL):
                r0 = lo + (i * UNROLL + u) * TILE
                rows = r0 + jnp.arange(TILE, dtype=jnp.int32)
                mask = (rows < limit)[:, None] & (cols < ROW)[None, :]
                tiles.append(plgpu.load(ref.at[layer, pl.ds(r0, TILE), pl.ds(0, ROW)], mask=mask, other=-jnp.inf,
                                        eviction_policy="evict_last"))
            for tile in tiles:
                acc = jnp.maximum(acc, tile.astype(jnp.float32))
            return acc

        digest = jax.lax.fori_loop(0, per // (TILE * UNROLL), body, digest)
    plgpu.store(out_ref.at[part, pl.ds(0, ROW)], jnp.max(digest, axis=0))


def reference_digest(arrays: list[tuple[jax.Array, int]], layer, parts: int) -> jax.Array:
    """What `warm` stores, in jnp: per part, the max over its shares (tests)."""
    out = jnp.full((parts, ROW), -jnp.inf, jnp.float32)
    for w, limit in arrays:
        per = _share(limit, parts)
        rows = w[layer].astype(jnp.float32)
        for p in range(parts):
            lo, hi = p * per, min((p + 1) * per, limit)
            if hi > lo:
                out = out.at[p].set(jnp.maximum(out[p], rows[lo:hi].max(axis=0)))
    return out

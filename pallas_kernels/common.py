"""Helpers every kernel file here shares: where a kernel runs (Triton on a GPU, interpret mode elsewhere), power-of-two
tile sizes, one log line per distinct kernel call shape (which path ran, never per step), and `traced_once`."""

from __future__ import annotations

import inspect
import logging

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

NEG = -1e30  # finite "minus infinity": the online-softmax rescale stays free of inf - inf


def use_interpret(interpret: bool | None) -> bool:
    """Interpret mode unless asked otherwise or running on a GPU backend."""
    if interpret is not None:
        return interpret
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes must be powers of two."""
    return 1 << max(int(n) - 1, 0).bit_length()


_logged: set = set()


def log_once(log: logging.Logger, key, msg: str, *args) -> None:
    """log.info(msg, *args) the first time `key` is seen: kernels are traced per shape, so this says once per compiled
    shape which path ran."""
    if key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


def traced_once(fn):
    """A kernel entry point as a `jax.jit` whose keyword-only options are static and whose positional arguments (arrays,
    and `layer`: a Python int becomes a traced scalar) are not. A layer loop calls a kernel once per layer with equal
    shapes; JAX would trace each call's kernel body and lower it to Triton anew (~0.15 s a call on the H100 host, most of
    a step shape's Python trace, which holds the GIL while the engine serves). Through the jit, one program traces and
    lowers it once and calls it per layer; XLA inlines the calls, so the compiled program is unchanged."""
    static = [name for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    return jax.jit(fn, static_argnames=static)


def load_kv_block(k_ref, v_ref, bt_ref, r, layer, h, t, valid, dd, dmask, *, page_size: int, pages: int):
    """The K and V tiles [BC, HD] of key positions t [BC] of row r, KV head h, from the paged pool: each position's
    page id from the block table, its pool slot page * page_size + offset; positions not `valid` (and head-dim lanes
    past `dmask`) read zeros. -> (k, v)."""
    page_idx = jnp.minimum(jax.lax.div(t, page_size), pages - 1)
    page = plgpu.load(bt_ref.at[r, page_idx], mask=valid, other=0)
    slot = jnp.where(valid, page * page_size + jax.lax.rem(t, page_size), 0)
    kvmask = valid[:, None] & dmask[None, :]
    k = plgpu.load(k_ref.at[layer, slot[:, None], h, dd[None, :]], mask=kvmask, other=0.0)
    v = plgpu.load(v_ref.at[layer, slot[:, None], h, dd[None, :]], mask=kvmask, other=0.0)
    return k, v


def softmax_block(q, k, v, see, carry, *, scale: float, precision, pv_dtype):
    """One key block of an online softmax inside a paged-attention kernel: q [M, HD], k and v [BC, HD] tiles, see [M, BC]
    which scores count; carry (m [M], l [M], acc [M, HD]) in float32 -> the new carry. The two dots run on tensor cores
    with float32 accumulation; p is rounded to the pool's dtype before the PV dot (as every flash kernel does)."""
    m, l, acc = carry
    sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32) * scale
    sc = jnp.where(see, sc, NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    p = jnp.where(see, jnp.exp(sc - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + jnp.sum(p, axis=1)
    pv = jax.lax.dot_general(p.astype(pv_dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[:, None] + pv


def check_paged_pool(k_pool, v_pool, block_table, page_size: int, sliding_window, q_dtype, R: int, Hq: int,
                     hd: int) -> None:
    """The checks both paged-attention kernels share: the pools [L, slots, Hkv, hd] against the queries' R rows, Hq
    heads and head_dim, the page size, the block table and the window. ValueError on the first that fails."""
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [L, slots, Hkv, hd]; got {k_pool.shape} and {v_pool.shape}")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool dtypes differ: {k_pool.dtype} vs {v_pool.dtype}")
    for name, dt in (("q", q_dtype), ("k_pool", k_pool.dtype)):
        if dt not in (jnp.bfloat16, jnp.float16, jnp.float32):
            raise ValueError(f"{name} must be bfloat16, float16 or float32, got {dt}")
    _, slots, Hkv, hd_kv = k_pool.shape
    if hd_kv != hd:
        raise ValueError(f"head_dim of q ({hd}) and of the KV pool ({hd_kv}) differ")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if slots % page_size:
        raise ValueError(f"the pool's slot count ({slots}) is not a multiple of page_size ({page_size})")
    if block_table.ndim != 2 or block_table.shape[0] != R:
        raise ValueError(f"block_table must be [R={R}, P], got {block_table.shape}")
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"block_table must be integers, got {block_table.dtype}")
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")

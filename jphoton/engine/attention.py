"""Paged attention in plain JAX: the KV pool is a flat array of token slots, sequences own pages of `page_size` slots.

Attention runs as an online softmax over blocks of pages inside a `while_loop` whose trip count is the longest context
in the batch, so the cost follows the real context length while every shape stays static (no recompile per length).
A Pallas kernel replaces this on GPU later; this stays as the reference it is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity": keeps the online-softmax rescale free of inf - inf


def token_slots(block_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Slot index in the flat pool of each position. block_table [R, P]; positions [R, T] -> [R, T]."""
    page = jnp.take_along_axis(block_table, positions // page_size, axis=1, mode="clip")
    return page * page_size + positions % page_size


def _own_values(v: jax.Array, k_pos: jax.Array, ctx_len: jax.Array) -> jax.Array:
    """v [R, C, Hkv, hd] with the slots past each row's context zeroed. They hold whatever the page held before (another
    request's values, possibly NaN after a model overflowed): their weight is 0, but 0 * NaN is NaN, so they are
    selected away rather than trusted to be finite (the Pallas kernels load them masked, as zeros)."""
    return jnp.where((k_pos[None, :] < ctx_len[:, None])[:, :, None, None], v, 0)


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, block_table: jax.Array,
                    q_pos: jax.Array, ctx_len: jax.Array, *, page_size: int, pages_per_block: int,
                    sliding_window: int | None = None) -> jax.Array:
    """q [R, T, Hq, hd] at positions q_pos [R, T]; row r sees keys at positions < ctx_len[r] and <= its query's position.
    k_pool, v_pool [L, slots, Hkv, hd]; block_table [R, P] with P a multiple of pages_per_block. Returns [R, T, Hq, hd]."""
    R, T, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    C = pages_per_block * page_size
    qg = q.reshape(R, T, Hkv, G, hd).astype(jnp.float32) * (hd ** -0.5)
    n_blocks = (jnp.max(ctx_len) + C - 1) // C

    def body(state):
        j, m, l, acc = state
        pages = jax.lax.dynamic_slice_in_dim(block_table, j * pages_per_block, pages_per_block, axis=1)
        slots = (pages[:, :, None] * page_size + jnp.arange(page_size)).reshape(R, C)
        k = k_pool[layer, slots].astype(jnp.float32)  # [R, C, Hkv, hd]
        k_pos = j * C + jnp.arange(C)
        v = _own_values(v_pool[layer, slots].astype(jnp.float32), k_pos, ctx_len)
        visible = (k_pos[None, None, :] < ctx_len[:, None, None]) & (k_pos[None, None, :] <= q_pos[:, :, None])
        if sliding_window is not None:
            visible &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
        s = jnp.einsum("rtkgd,rckd->rkgtc", qg, k)
        s = jnp.where(visible[:, None, None], s, NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(visible[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        l = l * scale + p.sum(-1)
        acc = acc * scale[..., None] + jnp.einsum("rkgtc,rckd->rkgtd", p, v)
        return j + 1, m_new, l, acc

    init = (jnp.int32(0), jnp.full((R, Hkv, G, T), NEG, jnp.float32), jnp.zeros((R, Hkv, G, T), jnp.float32),
            jnp.zeros((R, Hkv, G, T, hd), jnp.float32))
    _, _, l, acc = jax.lax.while_loop(lambda st: st[0] < n_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows with no visible key (padding) give zeros, not NaN
    return out.transpose(0, 3, 1, 2, 4).reshape(R, T, Hq, hd).astype(q.dtype)


def paged_attention_static(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                           block_table: jax.Array, q_pos: jax.Array, ctx_len: jax.Array, *, page_size: int,
                           num_pages: int, sliding_window: int | None = None) -> jax.Array:
    """The same attention over a static number of pages per row (the step's context bucket): one gather, one softmax,
    no loop. On GPU a data-dependent `while_loop` makes XLA bring its predicate to the host every iteration, which
    serializes the step with the host; this form keeps the whole step asynchronous."""
    R, T, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    pages = block_table[:, :num_pages]
    slots = (pages[:, :, None] * page_size + jnp.arange(page_size)).reshape(R, num_pages * page_size)
    k = k_pool[layer, slots]  # [R, C, Hkv, hd]
    k_pos = jnp.arange(num_pages * page_size)
    v = _own_values(v_pool[layer, slots], k_pos, ctx_len)
    visible = (k_pos[None, None, :] < ctx_len[:, None, None]) & (k_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    qg = q.reshape(R, T, Hkv, Hq // Hkv, hd)
    s = jnp.einsum("rtkgd,rckd->rkgtc", qg, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    s = jnp.where(visible[:, None, None], s, NEG)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    p = jnp.where(visible[:, None, None], p, 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    out = jnp.einsum("rkgtc,rckd->rtkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(R, T, Hq, hd).astype(q.dtype)

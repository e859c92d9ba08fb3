"""Paged prefill attention: a chunk of query tokens per row over its paged KV cache, causal (and sliding-window), as a
Pallas (Triton) kernel, plus a jnp reference (`paged_prefill_attention_reference`, the float32 oracle).

Grid (row, KV head, query block): a program owns `block_q` query positions of one row and all G query heads of its KV
head (GQA), gathers K/V tiles straight from the pool and loops over the key blocks up to its last query's position,
so the cost follows each row's own length and a prefill step needs no context bucket. The chunk's own keys and values
must already be in the pool (the engine scatters them first). Query positions >= q_len come out as zeros, never NaN.
Design: docs/kernels.md, "Paged prefill attention"; numbers: docs/step-shapes.md, item 10.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import NEG, check_paged_pool, load_kv_block, log_once, softmax_block, traced_once
from pallas_kernels.common import next_pow2 as _pow2
from pallas_kernels.common import use_interpret as _use_interpret

log = logging.getLogger("jphoton.kernels")



@dataclasses.dataclass(frozen=True)
class PagedPrefillConfig:
    """Launch parameters. tile_rows: query-tile rows per program (block_q = tile_rows // G query positions, all G
    heads); block_kv: key positions per loop step. Both powers of two >= 16."""

    tile_rows: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("tile_rows", "block_kv"):
            b = getattr(self, name)
            if b < 16 or b & (b - 1):
                raise ValueError(f"PagedPrefillConfig.{name} must be a power of two >= 16, got {b}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"PagedPrefillConfig: num_warps and num_stages must be positive, got {self}")


def default_config(group: int) -> PagedPrefillConfig:
    """64 tile rows (16 query positions of a 4-head group), or the next power of two that holds at least 8 positions
    of a larger group."""
    return PagedPrefillConfig(tile_rows=max(64, _pow2(8 * group)))


def path_name(interpret: bool | None = None) -> str:
    """What the engine's start-up log line says about this kernel."""
    return "Pallas paged prefill attention (" + ("interpret mode" if _use_interpret(interpret) else "Triton") + ")"


# ----------------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel(layer_ref, bt_ref, start_ref, len_ref, prefix_ref, q_ref, k_ref, v_ref, o_ref, *, G, BQ, BM, T, hd, HD,
            P, ps, BC, window, scale, pv_dtype, precision):
    r, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    q_start, q_len, prefix = start_ref[r], len_ref[r], prefix_ref[r]
    mm = jnp.arange(BM, dtype=jnp.int32)
    qi = jax.lax.div(mm, G)  # tile row -> (query position in the block, head of the group)
    gi = jax.lax.rem(mm, G)
    t = b * BQ + qi  # the query's index in the chunk
    in_tile = (qi < BQ) & (t < T)
    live = in_tile & (t < q_len)
    pos = q_start + t  # its position in the sequence
    see_until = jnp.maximum(pos, prefix - 1)  # the last key it sees (a bidirectional prefix: every key < prefix)
    head = h * G + gi
    tc = jnp.where(in_tile, t, 0)
    dd = jnp.arange(HD, dtype=jnp.int32)
    dmask = dd < hd
    q = plgpu.load(q_ref.at[r, tc[:, None], head[:, None], dd[None, :]], mask=live[:, None] & dmask[None, :],
                   other=0.0).astype(k_ref.dtype)

    # keys this block of queries can see: [lo, hi), hi = the last live query's position + 1
    n_live = jnp.clip(q_len - b * BQ, 0, BQ)
    hi = jnp.maximum(q_start + b * BQ + n_live, jnp.where(n_live > 0, prefix, 0))
    lo = jnp.maximum(q_start + b * BQ - window + 1, 0) if window is not None else jnp.int32(0)
    j_lo = jax.lax.div(lo, BC)
    j_hi = jnp.where(n_live > 0, jax.lax.div(hi + (BC - 1), BC), j_lo)
    tt = jnp.arange(BC, dtype=jnp.int32)

    def body(j, carry):
        kp = j * BC + tt
        valid = (kp >= lo) & (kp < hi)
        k, v = load_kv_block(k_ref, v_ref, bt_ref, r, layer, h, kp, valid, dd, dmask, page_size=ps, pages=P)
        see = valid[None, :] & (kp[None, :] <= see_until[:, None])  # [BM, BC]
        if window is not None:
            see &= pos[:, None] - kp[None, :] < window
        return softmax_block(q, k, v, see, carry, scale=scale, precision=precision, pv_dtype=pv_dtype)

    init = (jnp.full((BM,), NEG, jnp.float32), jnp.zeros((BM,), jnp.float32), jnp.zeros((BM, HD), jnp.float32))
    _, l, acc = jax.lax.fori_loop(j_lo, j_hi, body, init)
    out = jnp.where(live[:, None], acc / jnp.maximum(l, 1e-30)[:, None], 0.0)  # padding queries: zeros
    o_ref[r, b, h, :, :] = out.astype(o_ref.dtype)  # the whole tile: see `_untile`


def _untile(tiles: jax.Array, G: int, T: int, hd: int) -> jax.Array:
    """[R, blocks, Hkv, BM, HD] program tiles -> [R, T, Hq, hd]. Each program writes its whole tile as one block: a
    scatter to (position, head) indices would give a tile's padding rows (a group that does not fill BM, positions past
    T) duplicate indices, which interpret mode's masked scatter does not order. One small XLA copy of the output."""
    R, nb, Hkv, BM, HD = tiles.shape
    BQ = BM // G
    x = tiles[:, :, :, :BQ * G].reshape(R, nb, Hkv, BQ, G, HD).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(R, nb * BQ, Hkv * G, HD)[:, :T, :, :hd]


# ----------------------------------------------------------------------------------------------------------------------
# the public functions


def check_inputs(q, k_pool, v_pool, block_table, q_start, q_len, page_size, sliding_window, prefix=None) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [R, T, Hq, hd] (a chunk of query tokens per row), got shape {q.shape}")
    R, _, Hq, hd = q.shape
    check_paged_pool(k_pool, v_pool, block_table, page_size, sliding_window, q.dtype, R, Hq, hd)
    for name, a in (("q_start", q_start), ("q_len", q_len)) + ((("prefix", prefix),) if prefix is not None else ()):
        if a.shape != (R,):
            raise ValueError(f"{name} must be [R={R}], got {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {a.dtype}")


def _layer_array(layer) -> jax.Array:
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)


def paged_prefill_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer, block_table: jax.Array,
                            q_start: jax.Array, q_len: jax.Array, *, page_size: int, sliding_window: int | None = None,
                            prefix: jax.Array | None = None, config: PagedPrefillConfig | None = None,
                            interpret: bool | None = None) -> jax.Array:
    """Causal attention of a chunk of query tokens per row over the paged KV cache.
    prefix [R] (default none): row r's first prefix[r] positions attend to each other bidirectionally (an image
    prefix): a query at a position < prefix[r] sees every key < prefix[r], all in the pool already.

    q [R, T, Hq, hd]: row r's query i (i < q_len[r]) sits at position q_start[r] + i and sees the keys at positions
    <= its own (and > its own - sliding_window); those keys, the chunk's own included, are in the pool already.
    k_pool, v_pool [L, slots, Hkv, hd] with slot = page * page_size + offset; layer a Python int or a traced scalar;
    block_table [R, P] page ids (covering positions < q_start + q_len). Returns [R, T, Hq, hd] in q.dtype, zeros at
    i >= q_len[r]. interpret: None = interpret mode unless the default backend is a GPU."""
    return _paged_prefill_attention(q, k_pool, v_pool, layer, block_table, q_start, q_len, prefix, page_size=page_size,
                                    sliding_window=sliding_window, config=config, interpret=interpret)


@traced_once
def _paged_prefill_attention(q, k_pool, v_pool, layer, block_table, q_start, q_len, prefix, *, page_size,
                             sliding_window, config, interpret):  # (prefix: an array, traced, or None)
    check_inputs(q, k_pool, v_pool, block_table, q_start, q_len, page_size, sliding_window, prefix)
    if prefix is None:
        prefix = jnp.zeros_like(q_len)
    R, T, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    cfg = config or default_config(G)
    BM, BC = cfg.tile_rows, cfg.block_kv
    if BM < G:
        raise ValueError(f"PagedPrefillConfig.tile_rows ({BM}) must hold one query's {G} heads")
    BQ = BM // G
    HD = max(16, _pow2(hd))
    interp = _use_interpret(interpret)
    log_once(log, ("paged_prefill_attention", interp, R, T), "paged prefill attention %s: R=%d T=%d",
             "Pallas interpret mode (no GPU)" if interp else "Pallas Triton on GPU", R, T)
    f32 = k_pool.dtype == jnp.float32
    kernel = functools.partial(
        _kernel, G=G, BQ=BQ, BM=BM, T=T, hd=hd, HD=HD, P=block_table.shape[1], ps=page_size, BC=BC,
        window=sliding_window, scale=float(hd) ** -0.5, pv_dtype=k_pool.dtype,
        precision=jax.lax.Precision.HIGHEST if f32 else None)
    args = (_layer_array(layer), block_table.astype(jnp.int32), q_start.astype(jnp.int32), q_len.astype(jnp.int32),
            prefix.astype(jnp.int32), q, k_pool, v_pool)
    nb = -(-T // BQ)
    with warnings.catch_warnings():  # jax 0.11 warns that the Triton backend is deprecated, once per trace
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        tiles = pl.pallas_call(
            kernel,
            grid=(R, Hkv, nb),
            out_shape=jax.ShapeDtypeStruct((R, nb, Hkv, BM, HD), q.dtype),
            interpret=interp,
            compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            name=f"paged_prefill_attention_M{BM}_HD{HD}_BC{BC}",
        )(*args)
    return _untile(tiles, G, T, hd)


def paged_prefill_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                                      block_table: jax.Array, q_start: jax.Array, q_len: jax.Array, *, page_size: int,
                                      sliding_window: int | None = None, prefix=None, config=None,
                                      interpret=None) -> jax.Array:
    """The same attention in plain jnp, float32 throughout: gather every page of the table, mask, softmax. Returns
    float32 [R, T, Hq, hd], zeros at i >= q_len[r] (the oracle). config and interpret are accepted and ignored."""
    del config, interpret
    check_inputs(q, k_pool, v_pool, block_table, q_start, q_len, page_size, sliding_window, prefix)
    R, T, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    P = block_table.shape[1]
    slots = (block_table.astype(jnp.int32)[:, :, None] * page_size + jnp.arange(page_size)).reshape(R, P * page_size)
    layer = 0 if layer is None else layer
    k = k_pool[layer][slots].astype(jnp.float32)  # [R, C, Hkv, hd]
    v = v_pool[layer][slots].astype(jnp.float32)
    kp = jnp.arange(P * page_size)[None, None, :]
    i = jnp.arange(T)[None, :]
    pos = (q_start.astype(jnp.int32)[:, None] + i)[:, :, None]  # [R, T, 1]
    live = i < q_len.astype(jnp.int32)[:, None]  # [R, T]
    until = pos if prefix is None else jnp.maximum(pos, prefix.astype(jnp.int32)[:, None, None] - 1)
    visible = (kp <= until) & live[:, :, None]
    if sliding_window is not None:
        visible &= pos - kp < sliding_window
    qg = q.astype(jnp.float32).reshape(R, T, Hkv, Hq // Hkv, hd)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("rtkgd,rckd->rkgtc", qg, k, precision=hi) * (hd ** -0.5)
    vis = visible[:, None, None]
    s = jnp.where(vis, s, NEG)
    p = jnp.where(vis, jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    out = jnp.einsum("rkgtc,rckd->rtkgd", p, v, precision=hi)
    return out.reshape(R, T, Hq, hd)

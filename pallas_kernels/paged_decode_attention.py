"""Paged decode attention: one query token per row over its paged KV cache, as a Pallas (Triton) kernel, plus a jnp
reference (`paged_decode_attention_reference`, the float32 oracle).

Grid (row, KV head, split): a program owns one KV head and all of its G query heads (GQA) and reads each visible key
and value once, straight from the pool (pages gathered inside the kernel, the stacked pool indexed by a traced layer,
never sliced); its loop follows the row's own length, and a jnp combine merges the splits. With `new_kv` the row's
current key/value is stored into the pools (aliased outputs, updated in place). Rows with ctx_len 0 (padding) come
out as zeros, never NaN.
Design: docs/kernels.md, "Paged decode attention"; numbers: docs/decisions.md, "Decode step on the device".
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

NUM_SMS = 132  # H100 SXM; only shapes the default split count


@dataclasses.dataclass(frozen=True)
class PagedDecodeConfig:
    """Launch parameters. block_tokens: key positions per loop step (a power of two >= 16); splits: programs per
    (row, KV head) over the sequence (1 = no combine pass)."""

    block_tokens: int = 64
    splits: int = 1
    num_warps: int = 4
    # 4 stages measured best inside the 1B step; 5 lost (docs/decisions.md, "Decode step on the device")
    num_stages: int = 4

    def __post_init__(self):
        b = self.block_tokens
        if b < 16 or b & (b - 1):
            raise ValueError(f"PagedDecodeConfig.block_tokens must be a power of two >= 16, got {b}")
        if self.splits < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"PagedDecodeConfig: splits, num_warps and num_stages must be positive, got {self}")


def default_config(rows: int, num_kv_heads: int, max_tokens: int) -> PagedDecodeConfig:
    """Blocks of 64 tokens; splits: the largest power of two that keeps (row, head, split) programs at about 4 per SM
    or fewer, each split at least two blocks of the longest possible context (max_tokens, static), at most 64: the
    best split count measured inside the engine step (docs/decisions.md, "Attention split count rounded down")."""
    block = min(64, max(16, _pow2(max_tokens)))
    blocks = -(-max_tokens // block)
    want = -(-4 * NUM_SMS // max(rows * num_kv_heads, 1))
    splits = max(1, min(_pow2_floor(want), 64, _pow2_floor(max(blocks // 2, 1))))
    return PagedDecodeConfig(block_tokens=block, splits=splits)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _log_path(interpret: bool, what: str) -> None:
    log_once(log, ("paged_decode_attention", interpret, what), "paged decode attention %s: %s", what,
             "Pallas interpret mode (no GPU)" if interpret else "Pallas Triton on GPU")


def path_name(interpret: bool | None = None) -> str:
    """What the engine's start-up log line says about this kernel."""
    return "Pallas paged decode attention (" + ("interpret mode" if _use_interpret(interpret) else "Triton") + ")"


# ----------------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel(layer_ref, bt_ref, len_ref, q_ref, k_ref, v_ref, *refs, G, Gp, hd, HD, P, ps, BC, S, max_tokens,
            window, scale, pv_dtype, precision, write, k_off=0, v_off=0):
    out_refs = list(refs)
    if write:  # the current token's key/value (heads k_off + h, v_off + h) in, the pools (aliased to k_ref, v_ref) out
        kn_ref, vn_ref = out_refs[:2]
        k_out_ref, v_out_ref = out_refs[-2:]
        out_refs = out_refs[2:-2]
    r, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    ctx = len_ref[r]
    hi = jnp.minimum(ctx, max_tokens)
    lo = jnp.maximum(ctx - window, 0) if window is not None else jnp.int32(0)
    # This split's blocks: the row's visible blocks cut into S runs (lax.div: operands are >= 0, and jnp's floor
    # division sign fix-ups do not lower to Triton).
    b_lo = jax.lax.div(lo, BC)
    b_hi = jax.lax.div(hi + (BC - 1), BC)
    nb = jnp.maximum(b_hi - b_lo, 0)
    per = jax.lax.div(nb + (S - 1), S)
    start = b_lo + s * per
    end = jnp.minimum(start + per, b_hi)

    gg = jnp.arange(Gp, dtype=jnp.int32)
    dd = jnp.arange(HD, dtype=jnp.int32)
    gmask, dmask = gg < G, dd < hd
    q = plgpu.load(q_ref.at[r, pl.ds(h * G, Gp), pl.ds(0, HD)], mask=gmask[:, None] & dmask[None, :], other=0.0)
    q = q.astype(k_ref.dtype)
    tt = jnp.arange(BC, dtype=jnp.int32)
    last = ctx - 1  # the current token's position: with `write`, its key/value come from kn/vn, not from the pool
    if write:
        k_cur = plgpu.load(kn_ref.at[r, k_off + h, pl.ds(0, HD)], mask=dmask, other=0.0).astype(k_ref.dtype)
        v_cur = plgpu.load(vn_ref.at[r, v_off + h, pl.ds(0, HD)], mask=dmask, other=0.0).astype(v_ref.dtype)
    def body(j, carry):
        t = j * BC + tt
        valid = (t >= lo) & (t < hi)
        k, v = load_kv_block(k_ref, v_ref, bt_ref, r, layer, h, t, valid, dd, dmask, page_size=ps, pages=P)
        if write:
            cur = (t == last)[:, None]
            k = jnp.where(cur, k_cur[None, :], k)
            v = jnp.where(cur, v_cur[None, :], v)
        return softmax_block(q, k, v, valid[None, :], carry, scale=scale, precision=precision, pv_dtype=pv_dtype)

    init = (jnp.full((Gp,), NEG, jnp.float32), jnp.zeros((Gp,), jnp.float32), jnp.zeros((Gp, HD), jnp.float32))
    m, l, acc = jax.lax.fori_loop(start, end, body, init)

    if write:  # the split whose blocks hold the current position stores its key/value into the pool (one writer)
        b_cur = jax.lax.div(jnp.maximum(last, 0), BC)
        mine = (last >= 0) & (b_cur >= start) & (b_cur < end)
        page = bt_ref[r, jnp.minimum(jax.lax.div(jnp.maximum(last, 0), ps), P - 1)]
        slot = page * ps + jax.lax.rem(jnp.maximum(last, 0), ps)
        plgpu.store(k_out_ref.at[layer, slot, h, pl.ds(0, HD)], k_cur, mask=dmask & mine)
        plgpu.store(v_out_ref.at[layer, slot, h, pl.ds(0, HD)], v_cur, mask=dmask & mine)

    if S == 1:
        [o_ref] = out_refs
        out = acc / jnp.maximum(l, 1e-30)[:, None]  # no visible key (padding rows): zeros, not NaN
        plgpu.store(o_ref.at[r, pl.ds(h * G, Gp), pl.ds(0, HD)], out.astype(o_ref.dtype),
                    mask=gmask[:, None] & dmask[None, :])
    else:
        acc_ref, m_ref, l_ref = out_refs
        plgpu.store(acc_ref.at[r, h, s, pl.ds(0, Gp), pl.ds(0, HD)], acc)
        plgpu.store(m_ref.at[r, h, s, pl.ds(0, Gp)], m)
        plgpu.store(l_ref.at[r, h, s, pl.ds(0, Gp)], l)


def _combine(acc, m, l, G: int, hd: int, out_dtype) -> jax.Array:
    """Merge the splits' partial softmaxes: acc [R, Hkv, S, Gp, HD], m, l [R, Hkv, S, Gp] -> [R, Hkv * G, hd]."""
    acc, m, l = acc[..., :G, :hd], m[..., :G], l[..., :G]
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)  # empty splits: m = NEG, l = 0, acc = 0 -> they add nothing
    l_all = jnp.sum(l * w, axis=2)
    out = jnp.sum(acc * w[..., None], axis=2) / jnp.maximum(l_all, 1e-30)[..., None]
    R, Hkv = out.shape[:2]
    return out.reshape(R, Hkv * G, hd).astype(out_dtype)


# ----------------------------------------------------------------------------------------------------------------------
# the public functions


def check_inputs(q, k_pool, v_pool, block_table, ctx_len, page_size, max_pages, sliding_window) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [R, Hq, hd] (one query token per row), got shape {q.shape}")
    R, Hq, hd = q.shape
    check_paged_pool(k_pool, v_pool, block_table, page_size, sliding_window, q.dtype, R, Hq, hd)
    if ctx_len.shape != (R,):
        raise ValueError(f"ctx_len must be [R={R}], got {ctx_len.shape}")
    if not jnp.issubdtype(ctx_len.dtype, jnp.integer):
        raise ValueError(f"ctx_len must be integers, got {ctx_len.dtype}")
    if max_pages is not None and not (isinstance(max_pages, int) and 1 <= max_pages <= block_table.shape[1]):
        raise ValueError(f"max_pages must be an int in [1, {block_table.shape[1]}], got {max_pages!r}")


def _layer_array(layer) -> jax.Array:
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)


def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer, block_table: jax.Array,
                           ctx_len: jax.Array, *, page_size: int, max_pages: int | None = None,
                           sliding_window: int | None = None, new_kv: tuple[jax.Array, jax.Array] | None = None,
                           config: PagedDecodeConfig | None = None, interpret: bool | None = None):
    """Decode attention of one query token per row over the paged KV cache.

    q [R, Hq, hd]: row r's query at position ctx_len[r] - 1; it sees the keys at positions < ctx_len[r] (and
    >= ctx_len[r] - sliding_window), at most max_pages * page_size of them (max_pages: a static bound, default the
    block table's width P). k_pool, v_pool [L, slots, Hkv, hd] with slot = page * page_size + offset; layer a Python
    int or a traced scalar; block_table [R, P] page ids; ctx_len [R] (0 = padding row -> zeros).
    Returns [R, Hq, hd] in q.dtype. interpret: None = interpret mode unless the default backend is a GPU.

    new_kv = (k, v), each [R, Hkv, hd]: the key/value of each row's current token (position ctx_len - 1). The kernel
    attends to them from registers and writes them into the pools itself (aliased in place), and returns
    (out, (k_pool, v_pool)): a decode step then needs no KV-write kernels of its own (two scatters per layer, ~2.4 us
    each at B=2 on the H100, RESULTS.md). Needs ctx_len <= max_pages * page_size (the engine's rows always are).
    new_kv = "packed": q is [R, Hq + 2 * Hkv, hd] = [query heads | key heads | value heads] of the current token, read
    in place by head offset: the engine builds it in one XLA fusion with RoPE, where separate q, k, v operands would
    each be materialised by a kernel of its own."""
    packed = isinstance(new_kv, str)
    if packed and new_kv != "packed":
        raise ValueError(f"new_kv must be None, (k, v) or 'packed', got {new_kv!r}")
    # one trace and Triton lowering for every layer of a program (`traced_once`): the options static, the arrays not
    return _paged_decode_attention(q, k_pool, v_pool, layer, block_table, ctx_len, None if packed else new_kv,
                                   page_size=page_size, max_pages=max_pages, sliding_window=sliding_window,
                                   packed=packed, config=config, interpret=interpret)


@traced_once
def _paged_decode_attention(q, k_pool, v_pool, layer, block_table, ctx_len, new_kv, *, page_size, max_pages,
                            sliding_window, packed, config, interpret):
    Hkv = k_pool.shape[2]
    qkv = q
    if packed:
        if q.ndim != 3 or q.shape[1] <= 2 * Hkv:
            raise ValueError(f"packed q must be [R, Hq + 2 * Hkv, hd] with Hkv = {Hkv}, got {q.shape}")
        q = jax.ShapeDtypeStruct((q.shape[0], q.shape[1] - 2 * Hkv, q.shape[2]), q.dtype)  # shapes only, from here
    check_inputs(q, k_pool, v_pool, block_table, ctx_len, page_size, max_pages, sliding_window)
    write = packed or new_kv is not None
    if write and not packed:
        k_new, v_new = new_kv
        want = (q.shape[0], *k_pool.shape[2:])
        if k_new.shape != want or v_new.shape != want:
            raise ValueError(f"new_kv must be two [R, Hkv, hd] = {want} arrays, got {k_new.shape} and {v_new.shape}")
        k_new, v_new = k_new.astype(k_pool.dtype), v_new.astype(v_pool.dtype)
    R, Hq, hd = q.shape
    G = Hq // Hkv
    P = block_table.shape[1]
    max_tokens = (max_pages or P) * page_size
    cfg = config or default_config(R, Hkv, max_tokens)
    S, BC = cfg.splits, cfg.block_tokens
    Gp, HD = max(16, _pow2(G)), max(16, _pow2(hd))
    interp = _use_interpret(interpret)
    what = f"R={R} splits={S}"
    if write:
        what += ", current token's KV written in the kernel" + (" (packed q|k|v)" if packed else "")
    _log_path(interp, what)
    f32 = k_pool.dtype == jnp.float32
    kernel = functools.partial(
        _kernel, G=G, Gp=Gp, hd=hd, HD=HD, P=P, ps=page_size, BC=BC, S=S, max_tokens=max_tokens,
        window=sliding_window, scale=float(hd) ** -0.5, pv_dtype=k_pool.dtype,
        precision=jax.lax.Precision.HIGHEST if f32 else None, write=write, k_off=Hq if packed else 0,
        v_off=Hq + Hkv if packed else 0)
    if S == 1:
        out_shape = [jax.ShapeDtypeStruct((R, Hq, hd), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((R, Hkv, S, Gp, HD), jnp.float32),
                     jax.ShapeDtypeStruct((R, Hkv, S, Gp), jnp.float32),
                     jax.ShapeDtypeStruct((R, Hkv, S, Gp), jnp.float32)]
    args = [_layer_array(layer), block_table.astype(jnp.int32), ctx_len.astype(jnp.int32), qkv, k_pool, v_pool]
    if write:
        args += [qkv, qkv] if packed else [k_new, v_new]
    aliases = {}
    if write:  # inputs 4, 5 (the pools) are the last two outputs, updated in place
        aliases.update({4: len(out_shape), 5: len(out_shape) + 1})
        out_shape += [jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)]
    with warnings.catch_warnings():  # jax 0.11 warns that the Triton backend is deprecated, once per trace
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        out = pl.pallas_call(
            kernel,
            grid=(R, Hkv, S),
            out_shape=tuple(out_shape),
            input_output_aliases=aliases,
            interpret=interp,
            compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            name=f"paged_decode_attention_G{Gp}_HD{HD}_BC{BC}_S{S}{'_W' if write else ''}",
        )(*args)
    if write:
        *out, k_pool, v_pool = out
    result = out[0] if S == 1 else _combine(*out, G, hd, q.dtype)
    return (result, (k_pool, v_pool)) if write else result


def paged_decode_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer, block_table: jax.Array,
                                     ctx_len: jax.Array, *, page_size: int, max_pages: int | None = None,
                                     sliding_window: int | None = None, config=None, interpret=None) -> jax.Array:
    """The same attention in plain jnp, float32 throughout: gather max_pages pages per row, mask, softmax. Returns
    float32 [R, Hq, hd] (the oracle). config and interpret are accepted and ignored (same signature as the kernel)."""
    del config, interpret
    check_inputs(q, k_pool, v_pool, block_table, ctx_len, page_size, max_pages, sliding_window)
    R, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    n = max_pages or block_table.shape[1]
    pages = block_table[:, :n].astype(jnp.int32)
    slots = (pages[:, :, None] * page_size + jnp.arange(page_size)).reshape(R, n * page_size)
    layer = 0 if layer is None else layer
    k = k_pool[layer][slots].astype(jnp.float32)  # [R, C, Hkv, hd]
    v = v_pool[layer][slots].astype(jnp.float32)
    pos = jnp.arange(n * page_size)[None, :]
    ctx = ctx_len.astype(jnp.int32)[:, None]
    visible = pos < ctx
    if sliding_window is not None:
        visible &= pos >= ctx - sliding_window
    qg = q.astype(jnp.float32).reshape(R, Hkv, Hq // Hkv, hd)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("rkgd,rckd->rkgc", qg, k, precision=hi) * (hd ** -0.5)
    s = jnp.where(visible[:, None, None], s, NEG)
    p = jnp.where(visible[:, None, None], jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    out = jnp.einsum("rkgc,rckd->rkgd", p, v, precision=hi)
    return out.reshape(R, Hq, hd)

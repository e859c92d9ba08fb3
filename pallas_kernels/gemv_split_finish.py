"""Split-K decode GEMVs whose last program finishes the layer's next step, plus plain-jnp references.

The decode GEMV (gemv.py) splits K over several programs per column block to put a program on every SM, and its fp32
partial sums then need a whole-sum consumer: XLA's split-K sum, RoPE and q|k|v packing after the QKV projection, the
residual add and RMSNorm after the O and down projections. On the H100 each of those is a kernel of its own costing
~1.2-2 us at decode sizes, mostly launch and ramp (RESULTS.md, the 1B step kernel by kernel). Here the programs of a
column block arrive at a counter after storing their partials (`common.arrive_last`); the last one sums them and runs
the consumer on its tile, inside the kernel that is already running:

  qkv_rope       x @ Wqkv (+ bias), then rotate-half RoPE on the q and k heads, written as the packed bf16
                 [M, Hq + 2 * Hkv, hd] that the paged decode attention kernel reads (new_kv="packed"). A column block
                 holds whole heads (BN a multiple of hd), so a column's RoPE partner (the other half of its head) is in
                 the same block: the finishing program reads the partials a second time at the partner columns.
  residual_norm  h' = h + y @ W, then RMSNorm(h') * g for the next matmul. Two levels: the last program of a column
                 block writes its h' columns and their sum of squares per row; the last of those (a second counter)
                 normalises the whole rows.

Numerics follow the XLA path op for op where it rounds (the product rounded to the activation dtype as `dense` does,
bias and RoPE terms as bf16 values, the normed row rounded before the weight multiplies); sums are fp32 in a fixed
order, so results are deterministic run to run.

Counters come from a `common.Semaphores` (zeros, threaded from kernel to kernel, left zero by each kernel).

Measured on the H100 inside the 1B step at 2 rows (RESULTS.md, 2026-11-24 22:25): correct (bit-identical over repeated
calls, counters zero), but slower than what they replace. qkv_rope 10.0-10.4 us per layer against XLA's QKV GEMM +
RoPE/pack fusion (6.3 + 2.0); residual_norm after O 11.5 us against 5.0 + 1.2 + 1.65, after down 20.4 us against
12.7 + 1.65 + 1.65. The split-K GEMV alone takes ~6.7 us (QKV) in the step, so the finish costs ~3.7 us at one level
and ~6 us at two: more than the ~1.2-2 us kernels it saves. Not on by default (matmul kind "finish", models/matmul.py).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import Semaphores, arrive_last, log_once, next_pow2, triton_call, use_interpret
from pallas_kernels.gemv import GemvConfig, default_config, dot_k_loop, k_plan

log = logging.getLogger("jphoton.kernels")

MAX_ROWS = 16  # activation rows; the partial tiles are [16, BN] either way (tensor-core dots pad to 16)


def _plan(M: int, K: int, N: int, cfg: GemvConfig | None, block_n: int | None = None):
    cfg = cfg or default_config(M, K, N)
    BN = block_n or cfg.block_n
    BK, split, chunks = k_plan(K, cfg)
    return cfg, BN, BK, split, chunks


def _check(x, w, layer, max_rows=MAX_ROWS):
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w a stacked [L, K, N]; got {x.shape} and {w.shape}")
    if not 1 <= x.shape[0] <= max_rows:
        raise ValueError(f"takes 1..{max_rows} rows, got {x.shape[0]}")
    if layer is None:
        raise ValueError("a stacked [L, K, N] weight needs `layer`")


def _sum_partials(part_ref, S, rows, cols, mask):
    """sum over the S partials [S, M, N] at row indices rows [Mp] x column indices cols [BN] (a gather; indices are
    clamped into the array, as interpret mode needs even where `mask` drops them)."""
    _, M, N = part_ref.shape
    rows, cols = jnp.minimum(rows, M - 1), jnp.minimum(cols, N - 1)
    total = None
    for s in range(S):
        p = plgpu.load(part_ref.at[jnp.int32(s), rows[:, None], cols[None, :]], mask=mask, other=0.0)
        total = p if total is None else total + p
    return total


# ----------------------------------------------------------------------------------------------------------------------
# QKV + RoPE


def _qkv_rope_kernel(layer_ref, pos_ref, inv_ref, x_ref, w_ref, b_ref, _ctr_in, part_ref, out_ref, ctr_ref, *, M, Mp,
                     K, N, BN, BK, chunks, S, hd, rope_cols, has_bias, unroll, interpret):
    j, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = j * BN
    cc = jnp.arange(BN, dtype=jnp.int32)
    nmask = n0 + cc < N
    rr = jnp.arange(Mp, dtype=jnp.int32)
    rmask = rr < M
    dtype = out_ref.dtype
    # The rotation of this block's columns, before the weight stream: its loads and sin/cos then overlap the K loop's
    # first tiles instead of lengthening the last program's finish (every program computes it; it is [Mp, BN]).
    half = hd // 2
    d = jax.lax.rem(cc, hd)
    first = d < half
    pos = plgpu.load(pos_ref.at[jnp.minimum(rr, M - 1)], mask=rmask, other=0).astype(jnp.float32)
    freq = plgpu.load(inv_ref.at[jnp.where(first, d, d - half)])
    angle = pos[:, None] * freq[None, :]
    cos = jnp.cos(angle).astype(dtype).astype(jnp.float32)  # as the XLA path rounds its tables
    sin = jnp.sin(angle).astype(dtype).astype(jnp.float32)
    (acc,) = dot_k_loop(x_ref, w_ref, layer, (n0,), nmask, s * (chunks * BK), M=M, Mp=Mp, K=K, BN=BN, BK=BK,
                        chunks=chunks, masked=(S * chunks * BK != K) or (N % BN != 0), unroll=unroll)
    mask = rmask[:, None] & nmask[None, :]
    plgpu.store(part_ref.at[s, pl.ds(0, Mp), pl.ds(n0, BN)], acc, mask=mask)

    def finish():
        cols = n0 + cc
        partner = jnp.where(first, cols + half, cols - half)

        def value(c):  # the projection at columns c, as the XLA path holds it: rounded, then + bias, rounded
            y = _sum_partials(part_ref, S, rr, c, mask).astype(dtype)
            if has_bias:
                b = plgpu.load(b_ref.at[layer, jnp.minimum(c, N - 1)], mask=nmask, other=0.0).astype(dtype)
                y = (y.astype(jnp.float32) + b[None, :].astype(jnp.float32)).astype(dtype)
            return y.astype(jnp.float32)

        y, yp = value(cols), value(partner)
        # rotate-half: [x1 cos - x2 sin | x2 cos + x1 sin]; the partner of a first-half column is x2, and vice versa
        roped = y * cos + jnp.where(first, -1.0, 1.0)[None, :] * yp * sin
        out = jnp.where((cols < rope_cols)[None, :], roped, y)
        plgpu.store(out_ref.at[pl.ds(0, Mp), pl.ds(n0, BN)], out.astype(dtype), mask=mask)

    arrive_last(ctr_ref, j, S, finish, interpret=interpret)


def qkv_rope(x: jax.Array, w: jax.Array, layer, positions: jax.Array, inv_freq: jax.Array, *, num_heads: int,
             num_kv_heads: int, head_dim: int, bias: jax.Array | None = None, semaphores: Semaphores | None = None,
             config: GemvConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """x [M, K] @ w[layer] ([L, K, (Hq + 2 Hkv) hd], the fused q|k|v weight) (+ bias[layer]), RoPE at `positions`
    [M] with `inv_freq` [hd / 2] on the q and k heads: returns [M, Hq + 2 Hkv, hd] in x.dtype (q | k | v heads)."""
    _check(x, w, layer)
    M, K = x.shape
    hd, Hq, Hkv = head_dim, num_heads, num_kv_heads
    N = (Hq + 2 * Hkv) * hd
    if w.shape[2] != N or hd < 16 or hd & (hd - 1):
        raise ValueError(f"w must be [L, K, {N}] for {Hq} + 2 x {Hkv} heads of a power-of-two head_dim >= 16 "
                         f"(got {w.shape}, head_dim {hd})")
    if positions.shape != (M,) or inv_freq.shape != (hd // 2,):
        raise ValueError(f"positions must be [{M}] and inv_freq [{hd // 2}]; got {positions.shape}, {inv_freq.shape}")
    if bias is not None and bias.shape != (w.shape[0], N):
        raise ValueError(f"bias must be [{w.shape[0]}, {N}], got {bias.shape}")
    cfg = default_config(M, K, N) if config is None else config
    cfg, BN, BK, S, chunks = _plan(M, K, N, cfg, block_n=max(cfg.block_n, hd))  # whole heads per column block
    interp = use_interpret(interpret)
    tiles = pl.cdiv(N, BN)
    log_once(log, ("qkv_rope", interp, M, K, N, cfg), "qkv_rope [%d, %d] x [%d, %d] + RoPE, split %d, finished in "
             "the kernel: %s", M, K, K, N, S, "Pallas interpret mode (no GPU)" if interp else "Pallas Triton on GPU")
    sems = semaphores or Semaphores()
    ctr = sems.take(tiles)
    kernel = functools.partial(
        _qkv_rope_kernel, M=M, Mp=16, K=K, N=N, BN=BN, BK=BK, chunks=chunks, S=S, hd=hd, rope_cols=(Hq + Hkv) * hd,
        has_bias=bias is not None, unroll=cfg.unroll, interpret=interp)
    b = bias if bias is not None else jnp.zeros((1, 1), x.dtype)
    args = [jnp.asarray(layer, jnp.int32).reshape(1), positions.astype(jnp.int32), inv_freq.astype(jnp.float32), x,
            w, b, ctr]
    out_shape = (jax.ShapeDtypeStruct((S, M, N), jnp.float32), jax.ShapeDtypeStruct((M, N), x.dtype),
                 jax.ShapeDtypeStruct(ctr.shape, jnp.int32))
    _, out, ctr = triton_call(kernel, f"qkv_rope_M{M}_BN{BN}_BK{BK}_S{S}", (tiles, S), out_shape, args, {6: 2}, cfg,
                              interp)
    sems.give(ctr)
    return out.reshape(M, Hq + 2 * Hkv, hd)


def qkv_rope_reference(x, w, layer, positions, inv_freq, *, num_heads, num_kv_heads, head_dim, bias=None):
    """The model's XLA path (jphoton/models: `dense`, bias, `apply_rope`), packed as the kernel returns it."""
    from jphoton.models.layers import apply_rope, dense

    qkv = dense(x, w[layer])
    if bias is not None:
        qkv = qkv + bias[layer]
    qkv = qkv.reshape(x.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    rope = apply_rope(qkv[:, :num_heads + num_kv_heads], positions, inv_freq)
    return jnp.concatenate([rope, qkv[:, num_heads + num_kv_heads:]], axis=1)


# ----------------------------------------------------------------------------------------------------------------------
# output projection + residual add + RMSNorm


def _residual_kernel(layer_ref, x_ref, w_ref, h_ref, g_ref, _ctr_in, part_ref, ss_ref, h_out_ref, n_out_ref, ctr_ref,
                     *, M, Mp, K, N, BN, BK, chunks, S, T, Tp, CH, eps, unroll, interpret):
    j, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = j * BN
    cc = jnp.arange(BN, dtype=jnp.int32)
    nmask = n0 + cc < N
    (acc,) = dot_k_loop(x_ref, w_ref, layer, (n0,), nmask, s * (chunks * BK), M=M, Mp=Mp, K=K, BN=BN, BK=BK,
                        chunks=chunks, masked=(S * chunks * BK != K) or (N % BN != 0), unroll=unroll)
    rr = jnp.arange(Mp, dtype=jnp.int32)
    rmask = rr < M
    mask = rmask[:, None] & nmask[None, :]
    plgpu.store(part_ref.at[s, pl.ds(0, Mp), pl.ds(n0, BN)], acc, mask=mask)
    dtype = h_out_ref.dtype

    def normalise_rows():  # the last column block: every h' column and sum of squares is in
        ss = plgpu.load(ss_ref.at[pl.ds(0, Tp), pl.ds(0, Mp)],
                        mask=(jnp.arange(Tp, dtype=jnp.int32) < T)[:, None] & rmask[None, :], other=0.0)
        inv_rms = 1.0 / jnp.sqrt(jnp.sum(ss, axis=0) / N + eps)  # [Mp]
        for c0 in range(0, N, CH):
            cols = c0 + jnp.arange(CH, dtype=jnp.int32)
            cmask = cols < N
            m2 = rmask[:, None] & cmask[None, :]
            hf = plgpu.load(h_out_ref.at[pl.ds(0, Mp), pl.ds(c0, CH)], mask=m2, other=0.0).astype(jnp.float32)
            g = plgpu.load(g_ref.at[layer, pl.ds(c0, CH)], mask=cmask, other=0.0).astype(jnp.float32)
            normed = g[None, :] * (hf * inv_rms[:, None]).astype(dtype).astype(jnp.float32)
            plgpu.store(n_out_ref.at[pl.ds(0, Mp), pl.ds(c0, CH)], normed.astype(n_out_ref.dtype), mask=m2)

    def finish_block():
        y = _sum_partials(part_ref, S, rr, n0 + cc, mask).astype(dtype).astype(jnp.float32)
        h = plgpu.load(h_ref.at[pl.ds(0, Mp), pl.ds(n0, BN)], mask=mask, other=0.0).astype(jnp.float32)
        h = (h + y).astype(dtype)
        plgpu.store(h_out_ref.at[pl.ds(0, Mp), pl.ds(n0, BN)], h, mask=mask)
        hf = h.astype(jnp.float32)
        plgpu.store(ss_ref.at[j, pl.ds(0, Mp)], jnp.sum(hf * hf, axis=1))  # masked columns are zeros
        arrive_last(ctr_ref, T, T, normalise_rows, interpret=interpret)

    arrive_last(ctr_ref, j, S, finish_block, interpret=interpret)


def residual_norm(h: jax.Array, y: jax.Array, w: jax.Array, layer, norm: jax.Array, *, eps: float,
                  semaphores: Semaphores | None = None, config: GemvConfig | None = None,
                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """h [M, D] + y [M, K] @ w[layer] ([L, K, D]) -> (h', RMSNorm(h') * norm[layer]) with norm [L, D]: the residual
    stream and the next matmul's input, as the model's `matmul.residual` returns them."""
    _check(y, w, layer)
    M, K = y.shape
    D = w.shape[2]
    if h.shape != (M, D) or norm.ndim != 2 or norm.shape[1] != D:
        raise ValueError(f"h must be [{M}, {D}] and norm [L, {D}]; got {h.shape} and {norm.shape}")
    cfg, BN, BK, S, chunks = _plan(M, K, D, config)
    T = pl.cdiv(D, BN)
    interp = use_interpret(interpret)
    log_once(log, ("residual_norm", interp, M, K, D, cfg), "residual_norm [%d, %d] x [%d, %d] + residual + RMSNorm, "
             "split %d, finished in the kernel: %s", M, K, K, D, S,
             "Pallas interpret mode (no GPU)" if interp else "Pallas Triton on GPU")
    sems = semaphores or Semaphores()
    ctr = sems.take(T + 1)
    kernel = functools.partial(
        _residual_kernel, M=M, Mp=16, K=K, N=D, BN=BN, BK=BK, chunks=chunks, S=S, T=T, Tp=next_pow2(T),
        CH=min(512, next_pow2(D)), eps=float(eps), unroll=cfg.unroll, interpret=interp)
    normed_dtype = jnp.result_type(norm.dtype, h.dtype)
    args = [jnp.asarray(layer, jnp.int32).reshape(1), y, w, h, norm, ctr]
    out_shape = (jax.ShapeDtypeStruct((S, M, D), jnp.float32), jax.ShapeDtypeStruct((next_pow2(T), 16), jnp.float32),
                 jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, normed_dtype),
                 jax.ShapeDtypeStruct(ctr.shape, jnp.int32))
    _, _, h2, normed, ctr = triton_call(kernel, f"residual_norm_M{M}_BN{BN}_BK{BK}_S{S}", (T, S), out_shape, args,
                                        {5: 4}, cfg, interp)
    sems.give(ctr)
    return h2, normed


def residual_norm_reference(h, y, w, layer, norm, *, eps):
    """The model's XLA path: `dense`, the residual add, `rms_norm`."""
    from jphoton.models.layers import dense, rms_norm

    h = h + dense(y, w[layer])
    return h, rms_norm(h, norm[layer], eps)


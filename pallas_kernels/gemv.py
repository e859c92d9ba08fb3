"""Skinny matmul for decode ("GEMV"): y [M, N] = x [M, K] @ W, M a few tokens (<= MAX_ROWS), W bf16, as one Pallas
(Triton) kernel built for read bandwidth, plus a plain-jnp reference.

Grid (n-block, k-split): a program streams its weight tiles ([BK, BN], or [BN, BK] of a transposed [N, K] weight such
as a tied embedding as the LM head) with the few activation rows alongside, on tensor cores (`pl.dot`) or, with
`mode="fma"` for M <= 4, on the CUDA cores. Split-K partials are fp32 [split, M, N], summed by jnp (deterministic: no
atomics) or returned (`partials=True`, for add_rms_norm). W may be a stack [L, K, N] with a traced `layer`, never
sliced into a copy. Output dtype: x.dtype, or `out_dtype` (the LM head). Configs: `default_config`.
Design: docs/kernels.md, "GEMV"; numbers: docs/decisions.md, "Decode step on the device".
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

from pallas_kernels.common import log_once, traced_once, use_interpret  # noqa: F401 (use_interpret: public here)
from pallas_kernels.common import next_pow2 as _pow2

log = logging.getLogger("jphoton.kernels")

MAX_ROWS = 64  # most activation rows one call takes (an [Mp, BN] fp32 accumulator lives in registers)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64  # output columns per program
    block_k: int = 256  # reduction chunk per loop step
    split: int = 1  # programs sharing one column block (split-K); clipped so every split has >= one chunk
    num_warps: int = 4
    num_stages: int = 3
    mode: str = "dot"  # "dot" (pl.dot, rows padded to 16) | "fma" (multiply + reduce in fp32, one row at a time)
    unroll: bool = False  # K loop unrolled in Python

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= 16, got {v}")
        if self.split < 1:
            raise ValueError(f"GemvConfig.split must be >= 1, got {self.split}")
        if self.mode not in ("dot", "fma"):
            raise ValueError(f"GemvConfig.mode must be 'dot' or 'fma', got {self.mode!r}")

    def short(self) -> str:
        return (f"{self.mode} BN{self.block_n} BK{self.block_k} S{self.split} w{self.num_warps} s{self.num_stages}"
                f"{' unrolled' if self.unroll else ''}")


NUM_SMS = 132  # H100 SXM; only shapes the split rule of default_config


def default_config(m: int, k: int, n: int) -> GemvConfig:
    """The sweep's winners on the H100 (benchmarks/decode_matmul.py, Llama-3.2-1B shapes, M = 1/8/32; RESULTS.md):

        dot, BN 64, BK 128 (x padded to 16/32/64 rows; "fma" lost to it at every shape but one, by < 15% there)
        N >= 16384 (gate_up, LM head): BN 128
        split = smallest power of two with (N / BN) * split >= NUM_SMS, capped so each split keeps >= 4 K chunks
            (S4 on QKV and O, S2 on gate_up, S8 on down: each the fastest split measured)

    i.e. >= ~1 program per SM, each keeping ~48 KiB of weight tiles in flight (3 stages of a 16-32 KiB tile).
    `m` is unused: the same config won at M = 1, 8 and 32."""
    del m
    bn = 128 if n >= 16384 else 64
    bk = 128
    split = 1
    while pl.cdiv(n, bn) * split < NUM_SMS and k // (2 * split) >= 4 * bk:
        split *= 2
    return GemvConfig(block_n=bn, block_k=bk, split=split, num_warps=4, num_stages=3, mode="dot")


def k_plan(K: int, cfg: GemvConfig) -> tuple[int, int, int]:
    """(BK, split, chunks): the reduction chunk for K, and the split-K count and chunks per split for `cfg`, clipped
    so that every split has at least one chunk and none is empty."""
    BK = min(cfg.block_k, max(16, _pow2(K)))
    total = pl.cdiv(K, BK)
    split = max(1, min(cfg.split, total))
    chunks = pl.cdiv(total, split)
    return BK, pl.cdiv(total, chunks), chunks


def path_name(interpret: bool | None = None) -> str:
    return "Pallas GEMV, interpret mode (no GPU)" if use_interpret(interpret) else "Pallas GEMV (Triton) on GPU"


def _log_path(interpret: bool, m: int, k: int, n: int, cfg: GemvConfig, prologue: str = "") -> None:
    log_once(log, ("gemv", interpret, m, k, n, cfg, prologue), "gemv [%d, %d] x [%d, %d]%s: %s, %s", m, k, k, n,
             f" ({prologue} prologue)" if prologue else "", path_name(interpret), cfg.short())


def _load(ref, mask):
    # Triton refuses `other` without a mask (an unmasked tile is the fast path, so it must stay maskless)
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)


def dot_k_loop(x_ref, w_ref, layer, col_starts, nmask, k_begin, *, M, Mp, K, BN, BK, chunks, masked, unroll):
    """The bandwidth loop of a program: for each column start c in `col_starts`, the fp32 sums
    x[:, k_begin : k_begin + chunks * BK] @ W[layer, those rows, c : c + BN] as an [Mp, BN] tile (rows past M are
    zeros; columns where `nmask` is False read zeros). W is [L, K, N]; its [BK, BN] tiles (rows contiguous along N) and
    the activation tile feed `pl.dot`-style tensor-core dots, nothing else inside the loop: elementwise work on the
    activation tile there (RMSNorm or SwiGLU prologues) was measured slower and dropped (docs/decisions.md, "Decode
    step on the device")."""
    rows = jnp.arange(Mp, dtype=jnp.int32) < M
    dims = (((1,), (0,)), ((), ()))

    def body(i, accs):
        k0 = k_begin + i * BK
        kmask = k0 + jnp.arange(BK, dtype=jnp.int32) < K
        tile_mask = kmask[:, None] & nmask[None, :] if masked else None
        ws = [_load(w_ref.at[layer, pl.ds(k0, BK), pl.ds(c, BN)], tile_mask) for c in col_starts]
        x = plgpu.load(x_ref.at[pl.ds(0, Mp), pl.ds(k0, BK)], mask=rows[:, None] & kmask[None, :], other=0.0)
        x = x.astype(ws[0].dtype)
        return tuple(a + jax.lax.dot_general(x, w, dims, precision=jax.lax.Precision.HIGHEST,
                                             preferred_element_type=jnp.float32) for a, w in zip(accs, ws, strict=True))

    accs = tuple(jnp.zeros((Mp, BN), jnp.float32) for _ in col_starts)
    if unroll:
        for i in range(chunks):
            accs = body(jnp.int32(i), accs)
        return accs
    return jax.lax.fori_loop(0, chunks, body, accs)


def _gemv_kernel(layer_ref, x_ref, w_ref, o_ref, *, M, Mp, K, N, BN, BK, chunks, split, transposed, fma, unroll,
                 mask_k, mask_n, glu, split_out):
    # Triton-friendly: every aranged extent is a power of two, every mask has the full shape of its tile, and the fma
    # mode keeps one [BN] accumulator per row (a tuple carry) instead of stacking rows into a non-power-of-two tile.
    j, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = j * BN
    nmask = n0 + jnp.arange(BN, dtype=jnp.int32) < N
    k_begin = s * (chunks * BK)
    masked = mask_k or mask_n
    rows = jnp.arange(Mp, dtype=jnp.int32) < M

    if not (fma or transposed):  # W [K, N] (or [K, 2N] = [gate | up] with glu: two accumulators)
        accs = dot_k_loop(x_ref, w_ref, layer, (n0, N + n0) if glu else (n0,), nmask, k_begin, M=M, Mp=Mp, K=K,
                          BN=BN, BK=BK, chunks=chunks, masked=masked, unroll=unroll)
        acc = accs if glu else accs[0]
    else:
        def body(i, acc):
            k0 = k_begin + i * BK
            kmask = k0 + jnp.arange(BK, dtype=jnp.int32) < K
            if transposed:  # W [N, K]: a [BN, BK] tile, rows contiguous along K
                w = _load(w_ref.at[layer, pl.ds(n0, BN), pl.ds(k0, BK)],
                          nmask[:, None] & kmask[None, :] if masked else None)
            else:  # W [K, N]: a [BK, BN] tile, rows contiguous along N
                w = _load(w_ref.at[layer, pl.ds(k0, BK), pl.ds(n0, BN)],
                          kmask[:, None] & nmask[None, :] if masked else None)
            if fma:  # M <= 8 rows, each a [BK] slice of x, multiplied and reduced in fp32
                wf = w.astype(jnp.float32)
                out = []
                for r in range(M):
                    xr = _load(x_ref.at[jnp.int32(r), pl.ds(k0, BK)], kmask if mask_k else None)
                    xr = xr.astype(jnp.float32)
                    part = jnp.sum(wf * xr[None, :], axis=1) if transposed else jnp.sum(wf * xr[:, None], axis=0)
                    out.append(acc[r] + part)
                return tuple(out)
            x = plgpu.load(x_ref.at[pl.ds(0, Mp), pl.ds(k0, BK)], mask=rows[:, None] & kmask[None, :], other=0.0)
            return acc + jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (1,)), ((), ())),
                                             precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

        acc = tuple(jnp.zeros((BN,), jnp.float32) for _ in range(M)) if fma else jnp.zeros((Mp, BN), jnp.float32)
        if unroll:
            for i in range(chunks):
                acc = body(jnp.int32(i), acc)
        else:
            acc = jax.lax.fori_loop(0, chunks, body, acc)

    def out_ref(*rows):
        return o_ref.at[(s, *rows, pl.ds(n0, BN))] if split_out else o_ref.at[(*rows, pl.ds(n0, BN))]

    if glu:  # SwiGLU on the fp32 sums: silu(gate) * up, rounded once
        gate, up = acc
        acc = gate / (1.0 + jnp.exp(-gate)) * up
    if fma:
        for r in range(M):
            plgpu.store(out_ref(jnp.int32(r)), acc[r].astype(o_ref.dtype), mask=nmask)
    else:
        plgpu.store(out_ref(pl.ds(0, Mp)), acc.astype(o_ref.dtype), mask=rows[:, None] & nmask[None, :])


@traced_once
def gemv(x: jax.Array, w: jax.Array, layer=None, *, transposed: bool = False, out_dtype=None, glu: bool = False,
         glu_n: int | None = None, n: int | None = None, partials: bool = False, config: GemvConfig | None = None,
         interpret: bool | None = None) -> jax.Array:
    """x [M, K] @ W -> [M, N] with fp32 accumulation, M <= MAX_ROWS.

    W: [K, N], or [N, K] with `transposed=True` (computes x @ W.T: a tied embedding as the LM head), or either stacked
    [L, ...] with `layer` (a Python int or a traced scalar), never sliced. out_dtype: default x.dtype (float32 for the
    LM head). interpret: None = interpret mode unless the default backend is a GPU.

    Epilogues, so that the layer's next elementwise step costs no kernel of its own:
      glu: W is [K, 2N] = [gate | up] (a fused gate+up matrix); returns silu(x @ gate) * (x @ up) [M, N] from the fp32
        sums, so SwiGLU's [M, 2N] input never reaches HBM. No split-K (the activation needs whole sums), "dot" mode,
        not transposed. glu_n: N when W has more columns after [gate | up] (LoRA's, jphoton/models/lora.py), unread.
      n: only W's first n columns (W [K, N'] not transposed, N' >= n; the rest unread).
      partials: returns the split-K partial sums as they are, float32 [split, M, N] (split may be 1), for a consumer
        kernel that sums them together with its own work (add_rms_norm.py: residual add + RMSNorm) instead of a
        separate sum here."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got {x.shape}")
    if w.ndim == 2:
        w, layer = w[None], 0
    elif w.ndim != 3:
        raise ValueError(f"w must be [K, N] or [L, K, N], got {w.shape}")
    elif layer is None:
        raise ValueError("a stacked [L, K, N] weight needs `layer`")
    if glu and (transposed or partials or (w.shape[2] % 2 if glu_n is None else w.shape[2] < 2 * glu_n)):
        raise ValueError(f"glu needs a [K, 2N] weight, not transposed, without partials; got {w.shape}")
    M, K = x.shape
    N = w.shape[1] if transposed else (glu_n or w.shape[2] // 2) if glu else w.shape[2]
    if n is not None:
        if glu or transposed or not 1 <= n <= N:
            raise ValueError(f"n={n} needs a [K, N >= n] weight, not transposed, no glu; got {w.shape}")
        N = n
    Kw = w.shape[2] if transposed else w.shape[1]
    if Kw != K:
        raise ValueError(f"x {x.shape} does not fit w {w.shape} (transposed={transposed})")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {M}")
    cfg = config or default_config(M, K, N)
    if glu:
        cfg = dataclasses.replace(cfg, split=1, mode="dot")
    fma = cfg.mode == "fma" and M <= 8
    Mp = max(16, _pow2(M))
    BN = min(cfg.block_n, max(16, _pow2(N)))
    BK, split, chunks = k_plan(K, cfg)
    interp = use_interpret(interpret)
    _log_path(interp, M, K, N, cfg, "SwiGLU" if glu else "split-K partials" if partials else "")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    split_out = split > 1 or partials
    kernel = functools.partial(
        _gemv_kernel, M=M, Mp=Mp, K=K, N=N, BN=BN, BK=BK, chunks=chunks, split=split, transposed=transposed, fma=fma,
        unroll=cfg.unroll, mask_k=split * chunks * BK != K, mask_n=N % BN != 0, glu=glu, split_out=split_out)
    part_dtype = jnp.float32 if split_out else out_dtype
    out_shape = (split, M, N) if split_out else (M, N)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    with warnings.catch_warnings():  # jax 0.11 warns that the Triton backend is deprecated, once per trace
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        out = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(N, BN), split),
            out_shape=jax.ShapeDtypeStruct(out_shape, part_dtype),
            interpret=interp,
            compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            name=f"gemv_{'fma' if fma else 'dot'}{'_glu' if glu else ''}{'_partials' if partials else ''}_M{M}_BN{BN}"
                 f"_BK{BK}_S{split}{'_T' if transposed else ''}",
        )(layer_arr, x, w)
    if split > 1 and not partials:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out


def gemv_reference(x: jax.Array, w: jax.Array, layer=None, *, transposed: bool = False, out_dtype=None,
                   glu: bool = False) -> jax.Array:
    """Plain jnp: the same product (and SwiGLU epilogue) through XLA with fp32 accumulation."""
    if w.ndim == 3:
        w = w[layer]
    if transposed:
        w = w.T
    out = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    if glu:
        gate, up = jnp.split(out, 2, axis=-1)
        out = gate * jax.nn.sigmoid(gate) * up
    return out.astype(out_dtype or x.dtype)

"""Warp decode: an output-centric MoE layer for decode-sized batches, as two Pallas (Triton) kernels, plus a float32
reference.

`gate_up`: a program owns intermediate rows of one routed expert (a slot) for every token routed to it, so each
weight row is read once a step; `down`: a program owns output rows of one token and sums over its top-k experts.
No per-expert padding, no gather/scatter/combine buffer: h is one fp32 row per (token, expert) pair. Slots: "pairs",
"experts", or "auto" (pairs while T*K < E / 2). Weights w_gate, w_up [E, F, D] and w_down [E, D, F] (HF's [out, in]
per expert), or [L, ...] stacks with a traced `layer`, never sliced into a copy. Activations (`ACTIVATIONS`): "silu",
SiLU(gate) * up (Qwen3-MoE); "gelu_plus1", GELU(gate) * (up + 1) with the exact (erf) GELU (Moondream 3).
Design: docs/kernels.md, "Warp decode for MoE"; numbers: docs/decisions.md, "Prefix caching, LoRA, tensor parallelism, MoE".
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

from pallas_kernels.common import log_once, traced_once
from pallas_kernels.common import next_pow2 as _pow2
from pallas_kernels.common import use_interpret as _use_interpret

log = logging.getLogger("jphoton.kernels")

# Most tokens one kernel call takes: gate_up keeps a [tokens, BF] fp32 accumulator pair in registers. Larger steps
# (prefill, when warp decode is forced) run in chunks of this many tokens, each re-reading its experts' weights.
MAX_ROWS = 64
ACTIVATIONS = ("silu", "gelu_plus1")


def _erf(x):
    """erf in float32 from exp alone (Triton has no erf): Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7."""
    a = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y = 1.0 - poly * jnp.exp(-a * a)
    return jnp.where(x < 0, -y, y)


def activate(g, u, activation: str):
    """The expert's hidden row from its two projections (float32): what `ACTIVATIONS` names."""
    if activation == "silu":
        return g / (1.0 + jnp.exp(-g)) * u
    return 0.5 * g * (1.0 + _erf(g * 0.7071067811865476)) * (u + 1.0)


@dataclasses.dataclass(frozen=True)
class WarpDecodeConfig:
    """Tile sizes (powers of two; clipped to the problem) and launch parameters of the two kernels."""

    block_f: int = 32  # gate_up: intermediate rows per program
    block_k: int = 256  # gate_up: hidden-dim chunk per loop step
    block_d: int = 16  # down: output rows per program
    block_fd: int = 256  # down: intermediate-dim chunk per loop step
    warps_gate_up: int = 4
    stages_gate_up: int = 3
    warps_down: int = 4
    stages_down: int = 3
    slots: str = "auto"  # "pairs" | "experts" | "auto"
    # Unroll a kernel's loop in Python (straight-line code: every tile's load can be issued before the first is used,
    # memory-level parallelism without relying on the software pipeliner, which targets loads that feed dots).
    unroll_gate_up: bool = False
    unroll_down: bool = False

    def __post_init__(self):
        for name in ("block_f", "block_k", "block_d", "block_fd"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"WarpDecodeConfig.{name} must be a power of two, got {v}")
        if self.slots not in ("auto", "pairs", "experts"):
            raise ValueError(f"WarpDecodeConfig.slots must be 'auto', 'pairs' or 'experts', got {self.slots!r}")


def default_config(tokens: int, num_experts: int, top_k: int, hidden: int, inter: int) -> WarpDecodeConfig:
    """A starting point per batch size, chosen so that a 132-SM GPU gets several programs per SM at every size (the
    bytes in flight that hide HBM latency); benchmarks/moe_decode.py --sweep measures alternatives on the GPU."""
    del num_experts, top_k, hidden, inter
    if tokens == 1:
        return WarpDecodeConfig(block_f=16, block_k=512, block_d=4, block_fd=256, unroll_gate_up=True, unroll_down=True)
    if tokens <= 8:
        return WarpDecodeConfig(block_f=32, block_k=256, block_d=8, block_fd=256, unroll_down=True)
    return WarpDecodeConfig()


def _log_path(interpret: bool, what: str) -> None:
    log_once(log, ("moe_warp_decode", interpret, what), "warp-decode MoE %s: %s", what,
             "Pallas interpret mode (no GPU)" if interpret else "Pallas Triton on GPU")


def _loop(n: int, body, carry, unroll: bool):
    """fori_loop(0, n, body, carry), or the same loop unrolled in Python."""
    if not unroll:
        return jax.lax.fori_loop(0, n, body, carry)
    for i in range(n):
        carry = body(jnp.int32(i), carry)
    return carry


def _compiler_params(warps: int, stages: int):
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


# ----------------------------------------------------------------------------------------------------------------------
# gate_up


def _gate_up_kernel(layer_ref, slots_ref, ids_ref, x_ref, wg_ref, wu_ref, h_ref, *, T, K, KK, D, F, M, BF, BK,
                    unroll, activation):
    fb, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    e = slots_ref[s]
    tt = jnp.arange(M, dtype=jnp.int32)
    kk = jnp.arange(KK, dtype=jnp.int32)
    ids = plgpu.load(ids_ref.at[pl.ds(0, M), pl.ds(0, KK)], mask=(tt[:, None] < T) & (kk[None, :] < K), other=-1)
    match = ids == e  # [M, KK]: at most one hit per row (a token's top-k experts are distinct)
    hit = jnp.max(match.astype(jnp.int32), axis=1) > 0  # [M]
    k_of = jnp.sum(jnp.where(match, kk[None, :], 0), axis=1)  # [M]: which of the token's k slots routes to e
    any_hit = jnp.max(hit.astype(jnp.int32)) > 0

    @pl.when((e >= 0) & any_hit)
    def _():
        f0 = fb * BF
        fcols = f0 + jnp.arange(BF, dtype=jnp.int32)
        fmask = fcols < F

        def body(i, carry):
            acc_g, acc_u = carry
            k0 = i * BK
            kmask = k0 + jnp.arange(BK, dtype=jnp.int32) < D
            wmask = fmask[:, None] & kmask[None, :]
            wg = plgpu.load(wg_ref.at[layer, e, pl.ds(f0, BF), pl.ds(k0, BK)], mask=wmask, other=0.0)  # [BF, BK]
            wu = plgpu.load(wu_ref.at[layer, e, pl.ds(f0, BF), pl.ds(k0, BK)], mask=wmask, other=0.0)
            x = plgpu.load(x_ref.at[pl.ds(0, M), pl.ds(k0, BK)], mask=hit[:, None] & kmask[None, :], other=0.0)
            if M == 1:  # one token: a GEMV, multiply-and-reduce in fp32
                xf = x.astype(jnp.float32)
                acc_g += jnp.sum(wg.astype(jnp.float32) * xf, axis=1)[None, :]
                acc_u += jnp.sum(wu.astype(jnp.float32) * xf, axis=1)[None, :]
            else:  # tensor cores: bf16 operands, fp32 accumulation (HIGHEST: float32 operands stay IEEE, not TF32)
                dims = (((1,), (1,)), ((), ()))
                hi = jax.lax.Precision.HIGHEST
                acc_g += jax.lax.dot_general(x, wg, dims, precision=hi, preferred_element_type=jnp.float32)
                acc_u += jax.lax.dot_general(x, wu, dims, precision=hi, preferred_element_type=jnp.float32)
            return acc_g, acc_u

        zeros = jnp.zeros((M, BF), jnp.float32)
        acc_g, acc_u = _loop(pl.cdiv(D, BK), body, (zeros, zeros), unroll)
        h = activate(acc_g, acc_u, activation)
        rows = tt * K + k_of  # pair index of (token, e); masked rows never write
        plgpu.store(h_ref.at[rows[:, None], fcols[None, :]], h.astype(h_ref.dtype), mask=hit[:, None] & fmask[None, :])


def gate_up(x, topk_ids, slots, w_gate, w_up, layer, cfg: WarpDecodeConfig, interpret: bool,
            activation: str = "silu") -> jax.Array:
    """h [T*K, F] float32: act(x W_gate^T, x W_up^T) (`activate`) for every (token, routed expert) pair, row
    t*K + k."""
    T, D = x.shape
    K = topk_ids.shape[1]
    _, _, F, _ = w_gate.shape
    M = 1 if T == 1 else max(16, _pow2(T))
    BF = min(cfg.block_f, max(16, _pow2(F)))
    # Tiles are sized for 2-byte weights; 4-byte ones get half the hidden-dim chunk (same bytes in shared memory).
    BK = min(max(16, cfg.block_k * 2 // w_gate.dtype.itemsize), max(16, _pow2(D)))
    kernel = functools.partial(_gate_up_kernel, T=T, K=K, KK=_pow2(K), D=D, F=F, M=M, BF=BF, BK=BK,
                               unroll=cfg.unroll_gate_up, activation=activation)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(F, BF), slots.shape[0]),
        out_shape=jax.ShapeDtypeStruct((T * K, F), jnp.float32),
        interpret=interpret,
        compiler_params=_compiler_params(cfg.warps_gate_up, cfg.stages_gate_up),
        name=f"moe_warp_gate_up_M{M}_BF{BF}_BK{BK}{'_unrolled' if cfg.unroll_gate_up else ''}_{activation}",
    )(layer, slots, topk_ids, x, w_gate, w_up)


# ----------------------------------------------------------------------------------------------------------------------
# down


def _down_kernel(layer_ref, ids_ref, wts_ref, h_ref, wd_ref, y_ref, *, K, KK, D, F, BD, BFD, unroll):
    t, db = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    d0 = db * BD
    dmask = d0 + jnp.arange(BD, dtype=jnp.int32) < D
    nf = pl.cdiv(F, BFD)
    # The token's experts and weights, loaded once: inside the loop a weight tile's address then depends on registers
    # only, not on a scalar load per step, so consecutive tiles can be in flight together.
    kk = jnp.arange(KK, dtype=jnp.int32)
    ids = plgpu.load(ids_ref.at[t, pl.ds(0, KK)], mask=kk < K, other=0)
    wts = plgpu.load(wts_ref.at[t, pl.ds(0, KK)], mask=kk < K, other=0.0)

    def body(j, acc):
        k = jax.lax.div(j, jnp.int32(nf))  # lax, not // and %: jnp's floor-division sign fix-ups do not lower to Triton
        f0 = jax.lax.rem(j, jnp.int32(nf)) * BFD
        e = jnp.sum(jnp.where(kk == k, ids, 0))
        w = jnp.sum(jnp.where(kk == k, wts, 0.0))
        fmask = f0 + jnp.arange(BFD, dtype=jnp.int32) < F
        hrow = plgpu.load(h_ref.at[t * K + k, pl.ds(f0, BFD)], mask=fmask, other=0.0)  # [BFD] fp32
        wd = plgpu.load(wd_ref.at[layer, e, pl.ds(d0, BD), pl.ds(f0, BFD)], mask=dmask[:, None] & fmask[None, :],
                        other=0.0)  # [BD, BFD] bf16
        return acc + jnp.sum(wd.astype(jnp.float32) * (w * hrow)[None, :], axis=1)

    acc = _loop(K * nf, body, jnp.zeros((BD,), jnp.float32), unroll)
    plgpu.store(y_ref.at[t, pl.ds(d0, BD)], acc.astype(y_ref.dtype), mask=dmask)


def down(h, topk_ids, topk_weights, w_down, layer, out_dtype, cfg: WarpDecodeConfig, interpret: bool) -> jax.Array:
    """y [T, D] = sum_k w[t, k] * h[t*K + k] W_down[ids[t, k]]^T, one fp32 accumulator per output element."""
    T, K = topk_ids.shape
    _, _, D, F = w_down.shape
    BD = min(cfg.block_d, _pow2(D))
    BFD = min(cfg.block_fd, _pow2(F))
    kernel = functools.partial(_down_kernel, K=K, KK=_pow2(K), D=D, F=F, BD=BD, BFD=BFD, unroll=cfg.unroll_down)
    return pl.pallas_call(
        kernel,
        grid=(T, pl.cdiv(D, BD)),
        out_shape=jax.ShapeDtypeStruct((T, D), out_dtype),
        interpret=interpret,
        compiler_params=_compiler_params(cfg.warps_down, cfg.stages_down),
        name=f"moe_warp_down_BD{BD}_BF{BFD}{'_unrolled' if cfg.unroll_down else ''}",
    )(layer, topk_ids, topk_weights, h, w_down)


# ----------------------------------------------------------------------------------------------------------------------
# the layer


def _slots(topk_ids: jax.Array, num_experts: int, mode: str) -> jax.Array:
    T, K = topk_ids.shape
    if mode == "auto":
        mode = "pairs" if T * K < num_experts // 2 else "experts"
    if mode == "experts":
        return jnp.arange(num_experts, dtype=jnp.int32)
    flat = topk_ids.reshape(-1)
    if T == 1:
        return flat  # one token's top-k experts are distinct
    n = flat.shape[0]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
    repeated = jnp.any((flat[None, :] == flat[:, None]) & earlier, axis=1)
    return jnp.where(repeated, -1, flat)


def _as_stacked(w: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    if w.ndim == 3:
        w, layer = w[None], 0
    return w, jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)


def check_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got {x.shape}")
    T, D = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.ndim != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both be [T={T}, K]")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be integers, got {topk_ids.dtype}")
    if w_gate.shape != w_up.shape or w_gate.ndim != 4 or w_down.ndim != 4:
        raise ValueError(f"w_gate/w_up must be [L, E, F, D] and w_down [L, E, D, F]; got {w_gate.shape}, {w_up.shape}, "
                         f"{w_down.shape}")
    L, E, F, Dw = w_gate.shape
    if Dw != D or w_down.shape != (L, E, D, F):
        raise ValueError(f"weight shapes {w_gate.shape} / {w_down.shape} do not fit x {x.shape}")


@traced_once
def moe_warp_decode(x, topk_ids, topk_weights, w_gate, w_up, w_down, layer=None, *,
                    config: WarpDecodeConfig | None = None, interpret: bool | None = None, out_dtype=None,
                    activation: str = "silu") -> jax.Array:
    """The routed-experts part of a MoE layer for T tokens: y[t] = sum_k w[t,k] * FFN_{ids[t,k]}(x[t]).

    x [T, D] (bf16 or f32); topk_ids [T, K] int; topk_weights [T, K] (used in fp32); w_gate, w_up [E, F, D] and
    w_down [E, D, F], or stacked [L, ...] with `layer` (a Python int or a traced scalar). Returns [T, D] in out_dtype
    (default x.dtype). interpret: None = interpret mode unless the default backend is a GPU. activation: one of
    `ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.shape[0] > MAX_ROWS:  # a prefill-sized step (only when warp decode is forced): bounded register tiles
        return jnp.concatenate([
            moe_warp_decode(x[i:i + MAX_ROWS], topk_ids[i:i + MAX_ROWS], topk_weights[i:i + MAX_ROWS], w_gate, w_up,
                            w_down, layer, config=config, interpret=interpret, out_dtype=out_dtype,
                            activation=activation)
            for i in range(0, x.shape[0], MAX_ROWS)])
    w_gate, layer_arr = _as_stacked(w_gate, layer)
    w_up, _ = _as_stacked(w_up, layer)
    w_down, _ = _as_stacked(w_down, layer)
    check_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    T, D = x.shape
    _, E, F, _ = w_gate.shape
    K = topk_ids.shape[1]
    cfg = config or default_config(T, E, K, D, F)
    interp = _use_interpret(interpret)
    _log_path(interp, f"T={T}")
    ids = topk_ids.astype(jnp.int32)
    slots = _slots(ids, E, cfg.slots)
    with warnings.catch_warnings():  # jax 0.11 warns that the Triton backend is deprecated, once per trace
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        h = gate_up(x, ids, slots, w_gate, w_up, layer_arr, cfg, interp, activation)
        return down(h, ids, topk_weights.astype(jnp.float32), w_down, layer_arr, out_dtype or x.dtype, cfg, interp)


# ----------------------------------------------------------------------------------------------------------------------
# float32 reference


def moe_reference(x, topk_ids, topk_weights, w_gate, w_up, w_down, layer=None, activation: str = "silu") -> jax.Array:
    """Plain jnp, float32 throughout (weights upcast), one top-k slot at a time: the numerical oracle (exact erf GELU
    for "gelu_plus1"). Returns f32."""
    if w_gate.ndim == 4:
        w_gate, w_up, w_down = w_gate[layer], w_up[layer], w_down[layer]
    xf = x.astype(jnp.float32)
    out = jnp.zeros(x.shape, jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    for k in range(topk_ids.shape[1]):
        e = topk_ids[:, k]
        g = jnp.einsum("td,tfd->tf", xf, w_gate[e].astype(jnp.float32), precision=hi)
        u = jnp.einsum("td,tfd->tf", xf, w_up[e].astype(jnp.float32), precision=hi)
        h = jax.nn.silu(g) * u if activation == "silu" else jax.nn.gelu(g, approximate=False) * (u + 1.0)
        y = jnp.einsum("tf,tdf->td", h, w_down[e].astype(jnp.float32), precision=hi)
        out = out + topk_weights[:, k].astype(jnp.float32)[:, None] * y
    return out

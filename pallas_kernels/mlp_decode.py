"""A dense SwiGLU MLP for decode in one Pallas (Triton backend) kernel: gate+up, SwiGLU and down, output-centric over
the intermediate dimension, plus a plain-jnp reference.

Why: in a decode step the MLP is two bandwidth-bound GEMVs (gate+up [D, 2F], down [F, D]: 100 MB of Llama-3.2-1B's
121 MB per layer). As two kernels, the down projection cannot start streaming its weights until the last gate+up
program has finished, and each kernel pays its own launch, ramp and tail. Here one program owns a block of BF
intermediate columns and does all of its work:

    act[:, f0:f0+BF] = silu(x @ Wg[:, f0:f0+BF]) * (x @ Wu[:, f0:f0+BF])   (fp32 sums, rounded once to x.dtype)
    part[j] = act[:, f0:f0+BF] @ Wd[f0:f0+BF, :]                            (fp32, all D output columns)

The intermediate activation never leaves the program (registers), and the program goes straight from its gate+up
tiles to its BF rows of Wd. That is the down projection's split-K with BF-row splits: the F/BF partials [F/BF, M, D]
(fp32, 1 MB per row at Llama-3.2-1B's F = 8192 with BF = 64, ~1% of the weight bytes) are summed by the consumer
together with the residual add (`swiglu_mlp` sums them in jnp; XLA fuses that sum into the add). Deterministic: no
atomics, so greedy decoding stays reproducible run to run.

Like gemv.py (whose K loop this reuses, and whose design notes apply): Triton backend, so it runs in interpret mode on
the CPU (jax 0.10, the tests) and compiles on the H100 (jax 0.11); stacked weights [L, ...] read at a traced or
Python `layer`, never sliced (a slice fed to a custom call is copied).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import Semaphores, grid_barrier, log_once, next_pow2, triton_call, use_interpret
from pallas_kernels.gemv import MAX_ROWS, NUM_SMS, _load, dot_k_loop

log = logging.getLogger("jphoton.kernels")

MAX_PROGRAMS = NUM_SMS  # "barrier" mode: one program per SM at most, so that all are resident when the barrier waits


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    block_f: int = 64  # intermediate columns per program (= rows of Wd it reads; = the down projection's split-K size)
    block_k: int = 128  # gate+up reduction chunk (over D) per loop step
    block_n: int = 64  # down-projection output columns per program ("barrier"; per loop step in "columns")
    num_warps: int = 4
    num_stages: int = 3
    # "barrier": two phases in one launch (gate+up with SwiGLU for all F, a grid barrier, then the down projection as
    # an ordinary split-K GEMV over [F, D]); "columns": one phase, each program's BF columns straight into its BF rows
    # of Wd (no barrier, but F / BF partials and a second, narrow weight stream per program)
    mode: str = "barrier"
    prefetch: int = 2  # barrier mode: Wd tiles each program loads before the barrier (their latency hidden by it)

    def __post_init__(self):
        for name in ("block_f", "block_k", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MlpConfig.{name} must be a power of two >= 16, got {v}")
        if self.mode not in ("barrier", "columns"):
            raise ValueError(f"MlpConfig.mode must be 'barrier' or 'columns', got {self.mode!r}")
        if self.prefetch < 0:
            raise ValueError(f"MlpConfig.prefetch must be >= 0, got {self.prefetch}")

    def short(self) -> str:
        pre = f" pre{self.prefetch}" if self.mode == "barrier" else ""
        return (f"{self.mode} BF{self.block_f} BK{self.block_k} BN{self.block_n} w{self.num_warps} "
                f"s{self.num_stages}{pre}")


def path_name(interpret: bool | None = None) -> str:
    where = "interpret mode (no GPU)" if use_interpret(interpret) else "(Triton) on GPU"
    return f"Pallas fused MLP {where}"


def _gate_up_act(layer, x_ref, wgu_ref, out_dtype, j, *, M, Mp, D, F, BF, BK, k_chunks, mask_k, mask_f):
    """Program j's SwiGLU activations [Mp, BF] of intermediate columns j*BF..: fp32 sums, rounded once to the weights'
    dtype (what gemv's glu epilogue writes); padded rows and columns past F are zero sums, so zero activations."""
    f0 = j * BF
    fmask = f0 + jnp.arange(BF, dtype=jnp.int32) < F
    gate, up = dot_k_loop(x_ref, wgu_ref, layer, (f0, F + f0), fmask, 0, M=M, Mp=Mp, K=D, BN=BF, BK=BK,
                          chunks=k_chunks, masked=mask_k or mask_f, unroll=False)
    return (gate / (1.0 + jnp.exp(-gate)) * up).astype(out_dtype), f0, fmask


_DOT = (((1,), (0,)), ((), ()))


def _columns_kernel(layer_ref, x_ref, wgu_ref, wd_ref, o_ref, *, M, Mp, D, F, BF, BK, k_chunks, BN, n_chunks,
                    mask_k, mask_f, mask_n):
    j = pl.program_id(0)
    layer = layer_ref[0]
    act, f0, fmask = _gate_up_act(layer, x_ref, wgu_ref, wd_ref.dtype, j, M=M, Mp=Mp, D=D, F=F, BF=BF, BK=BK,
                                  k_chunks=k_chunks, mask_k=mask_k, mask_f=mask_f)
    rows = jnp.arange(Mp, dtype=jnp.int32) < M

    def body(i, carry):
        n0 = i * BN
        nmask = n0 + jnp.arange(BN, dtype=jnp.int32) < D
        w = _load(wd_ref.at[layer, pl.ds(f0, BF), pl.ds(n0, BN)],
                  fmask[:, None] & nmask[None, :] if mask_f or mask_n else None)
        y = jax.lax.dot_general(act, w, _DOT, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        plgpu.store(o_ref.at[j, pl.ds(0, Mp), pl.ds(n0, BN)], y, mask=rows[:, None] & nmask[None, :])
        return carry

    jax.lax.fori_loop(0, n_chunks, body, jnp.int32(0))


def _barrier_kernel(layer_ref, x_ref, wgu_ref, wd_ref, act_in_ref, ctr_in_ref, act_ref, o_ref, ctr_ref, *, phase, M, Mp,
                    D, F, BF, BK, k_chunks, mask_k, mask_f, BN, S, kd_chunks, items, pre, P):
    """phase "both" (GPU): gate+up for the whole F into act_ref, grid barrier, down. Interpret mode runs "glu" and then
    "down" as two calls (the down call reads act_in_ref): the same code, without the barrier that its one-at-a-time
    programs could never pass."""
    del ctr_in_ref  # aliased to ctr_ref
    j = pl.program_id(0)
    layer = layer_ref[0]
    rows = jnp.arange(Mp, dtype=jnp.int32) < M
    if phase in ("both", "glu"):
        act, f0, fmask = _gate_up_act(layer, x_ref, wgu_ref, act_ref.dtype, j, M=M, Mp=Mp, D=D, F=F, BF=BF, BK=BK,
                                      k_chunks=k_chunks, mask_k=mask_k, mask_f=mask_f)
        plgpu.store(act_ref.at[pl.ds(0, Mp), pl.ds(f0, BF)], act, mask=rows[:, None] & fmask[None, :])
    if phase == "glu":
        return
    # down: item j = (column block c, K split s) of the [F, D] GEMV; programs past `items` only pass the barrier
    c, sp = jax.lax.div(j, S), jax.lax.rem(j, S)
    c = jnp.minimum(c, pl.cdiv(D, BN) - 1)
    n0, k_begin = c * BN, sp * (kd_chunks * BK)
    nmask = n0 + jnp.arange(BN, dtype=jnp.int32) < D
    kk = jnp.arange(BK, dtype=jnp.int32)
    masked = (F % (S * kd_chunks * BK) != 0) or D % BN != 0

    def w_tile(i):
        k0 = k_begin + i * BK
        return _load(wd_ref.at[layer, pl.ds(k0, BK), pl.ds(n0, BN)],
                     ((k0 + kk < F)[:, None] & nmask[None, :]) if masked else None)

    # Wd does not depend on the activations: the first tiles' loads go out before the barrier, under its wait
    early = [w_tile(jnp.int32(i)) for i in range(min(pre, kd_chunks))]
    if phase == "both":
        grid_barrier(ctr_ref, 0, P)
    src = act_ref if phase == "both" else act_in_ref

    def step(i, w, acc):
        k0 = k_begin + i * BK
        a = plgpu.load(src.at[pl.ds(0, Mp), pl.ds(k0, BK)], mask=rows[:, None] & (k0 + kk < F)[None, :], other=0.0)
        return acc + jax.lax.dot_general(a.astype(w.dtype), w, _DOT, precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32)

    acc = jnp.zeros((Mp, BN), jnp.float32)
    for i, w in enumerate(early):
        acc = step(jnp.int32(i), w, acc)
    acc = jax.lax.fori_loop(len(early), kd_chunks, lambda i, acc: step(i, w_tile(i), acc), acc)

    @pl.when(j < items)
    def _():
        plgpu.store(o_ref.at[sp, pl.ds(0, Mp), pl.ds(n0, BN)], acc, mask=rows[:, None] & nmask[None, :])


def _check(x, w_gate_up, w_down, layer):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, D], got {x.shape}")
    if w_gate_up.ndim == 2 and w_down.ndim == 2:
        w_gate_up, w_down, layer = w_gate_up[None], w_down[None], 0
    elif w_gate_up.ndim != 3 or w_down.ndim != 3:
        raise ValueError(f"weights must both be [K, N] or both stacked [L, K, N]; got {w_gate_up.shape}, "
                         f"{w_down.shape}")
    elif layer is None:
        raise ValueError("stacked [L, K, N] weights need `layer`")
    M, D = x.shape
    F = w_down.shape[1]
    if w_gate_up.shape[1:] != (D, 2 * F) or w_down.shape[2] != D or w_gate_up.shape[0] != w_down.shape[0]:
        raise ValueError(f"w_gate_up must be [.., D, 2F] and w_down [.., F, D] for x [M, D] = {x.shape}; got "
                         f"{w_gate_up.shape}, {w_down.shape}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"the fused MLP takes 1..{MAX_ROWS} rows, got {M}")
    return w_gate_up, w_down, layer


def swiglu_mlp_partials(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, layer=None, *,
                        config: MlpConfig | None = None, semaphores: Semaphores | None = None,
                        interpret: bool | None = None) -> jax.Array:
    """Partial sums of silu(x @ gate) * (x @ up) @ w_down, float32 [S, M, D], whose sum over axis 0 is the MLP's
    output (S: the down projection's K splits; F / BF in "columns" mode).

    x [M, D] (M <= gemv.MAX_ROWS); w_gate_up [D, 2F] = [gate | up], w_down [F, D]; or both stacked [L, ...] with
    `layer` (a Python int or a traced scalar). semaphores: the step's zeroed counters (common.Semaphores; "barrier"
    mode takes two and leaves them zero; default: a fresh zero array). interpret: None = interpret mode unless the
    default backend is a GPU."""
    w_gate_up, w_down, layer = _check(x, w_gate_up, w_down, layer)
    cfg = config or MlpConfig()
    M, D = x.shape
    F = w_down.shape[1]
    Mp = max(16, next_pow2(M))
    BK = min(cfg.block_k, max(16, next_pow2(D)))
    BN = min(cfg.block_n, max(16, next_pow2(D)))
    BF = min(cfg.block_f, max(16, next_pow2(F)))
    if cfg.mode == "barrier":  # every program resident at once, or the barrier never opens
        while pl.cdiv(F, BF) > MAX_PROGRAMS:
            BF *= 2
        while pl.cdiv(D, BN) > pl.cdiv(F, BF):
            BN *= 2
    P = pl.cdiv(F, BF)
    interp = use_interpret(interpret)
    log_once(log, ("mlp", interp, M, D, F, cfg), "fused MLP [%d, %d] -> %d -> %d: %s, %s (%d programs)", M, D, F, D,
             path_name(interp), cfg.short(), P)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    common = dict(M=M, Mp=Mp, D=D, F=F, BF=BF, BK=BK, k_chunks=pl.cdiv(D, BK), mask_k=D % BK != 0,
                  mask_f=F % BF != 0)
    if cfg.mode == "columns":
        kernel = functools.partial(_columns_kernel, BN=BN, n_chunks=pl.cdiv(D, BN), mask_n=D % BN != 0, **common)
        return triton_call(kernel, f"mlp_columns_M{M}_BF{BF}_BK{BK}_BN{BN}", (P,),
                           jax.ShapeDtypeStruct((P, M, D), jnp.float32), (layer_arr, x, w_gate_up, w_down), {}, cfg,
                           interp)
    ncol = pl.cdiv(D, BN)
    S = max(1, P // ncol)
    kd_chunks = pl.cdiv(pl.cdiv(F, S), BK)
    S = pl.cdiv(pl.cdiv(F, BK), kd_chunks)  # no empty split
    sems = semaphores or Semaphores()
    ctr = sems.take(2)
    out_shape = (jax.ShapeDtypeStruct((M, F), w_down.dtype), jax.ShapeDtypeStruct((S, M, D), jnp.float32),
                 jax.ShapeDtypeStruct(ctr.shape, jnp.int32))
    name = f"mlp_barrier_M{M}_BF{BF}_BK{BK}_BN{BN}_S{S}"

    def kernel(phase):
        return functools.partial(_barrier_kernel, phase=phase, BN=BN, S=S, kd_chunks=kd_chunks, items=ncol * S,
                                 pre=cfg.prefetch, P=P, **common)

    def call(phase, act_in):
        return triton_call(kernel(phase), name, (P,), out_shape, (layer_arr, x, w_gate_up, w_down, act_in, ctr),
                           {5: 2}, cfg, interp)

    if not interp:
        _, parts, ctr = call("both", x)  # act_in unused: the kernel reads its own act output after the barrier
    else:
        act, _, ctr = call("glu", x)
        _, parts, ctr = call("down", act)
    sems.give(ctr)
    return parts


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, layer=None, *, config: MlpConfig | None = None,
               semaphores: Semaphores | None = None, interpret: bool | None = None) -> jax.Array:
    """silu(x @ gate) * (x @ up) @ w_down [M, D] in x's dtype: the partials summed in fp32, rounded once."""
    parts = swiglu_mlp_partials(x, w_gate_up, w_down, layer, config=config, semaphores=semaphores,
                                interpret=interpret)
    return jnp.sum(parts, axis=0).astype(x.dtype)


def swiglu_mlp_reference(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, layer=None) -> jax.Array:
    """Plain jnp with the rounding of the two-GEMV path: SwiGLU of the fp32 gate+up sums rounded to the weights'
    dtype, then the down dot with fp32 accumulation, rounded to x's dtype."""
    if w_gate_up.ndim == 3:
        w_gate_up, w_down = w_gate_up[layer], w_down[layer]
    hi = jax.lax.Precision.HIGHEST
    gate, up = jnp.split(jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32, precision=hi), 2, axis=-1)
    act = (gate * jax.nn.sigmoid(gate) * up).astype(w_down.dtype)
    return jnp.dot(act, w_down, preferred_element_type=jnp.float32, precision=hi).astype(x.dtype)

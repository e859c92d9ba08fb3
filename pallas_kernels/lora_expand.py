"""Multi-LoRA expand for decode steps, as one Pallas (Triton backend) kernel, plus a plain-jnp reference.

A LoRA group's update is y + ((x @ A) * onehot) @ B, with A [K, C] and B [C, O] holding every adapter slot's columns
(C = slots * targets * rank; jphoton/models/lora.py). Through XLA a decode step ran five kernels per group: the shrink
GEMM (split-K, as its K is long and C narrow), the split-K sum, the mask and cast, the expand GEMM and the add (H100
profile of the 1B step at 32 rows: +0.44 ms a step, 1.31x, RESULTS.md). Here the shrink is the GEMV kernel writing
split-K partials (pallas_kernels/gemv.py, `partials=True`), and this kernel does the rest in one pass: each program
owns BN output columns, sums the partials of a [rows, BC] chunk of C, zeroes the columns that are not the row's slot
(column c belongs to slot c // width; slot -1 = no adapter), multiplies by B's [BC, BN] tile on the tensor cores, and
adds the rounded result to y, written in place (y is aliased to the output).

Numerics follow the XLA path (models/lora.py `delta`): fp32 sums, the masked shrink rounded to B's dtype, the product
accumulated in fp32 and rounded to y's dtype before the add.
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import log_once, next_pow2, use_interpret

log = logging.getLogger("jphoton.kernels")

MAX_ROWS = 64


def _kernel(slots_ref, p_ref, b_ref, y_ref, o_ref, *, S, Sp, M, Mp, C, BC, O, BN, width):
    n0 = pl.program_id(0) * BN
    rows = jnp.arange(Mp, dtype=jnp.int32) < M
    nmask = n0 + jnp.arange(BN, dtype=jnp.int32) < O
    slot = plgpu.load(slots_ref.at[pl.ds(0, Mp)], mask=rows, other=-1)
    in_split = jnp.arange(Sp, dtype=jnp.int32) < S

    def body(i, acc):
        c0 = i * BC
        cols = c0 + jnp.arange(BC, dtype=jnp.int32)
        cmask = cols < C
        parts = plgpu.load(p_ref.at[pl.ds(0, Sp), pl.ds(0, Mp), pl.ds(c0, BC)],
                           mask=in_split[:, None, None] & rows[None, :, None] & cmask[None, None, :], other=0.0)
        shrunk = jnp.sum(parts, axis=0)
        shrunk = jnp.where((cols // width)[None, :] == slot[:, None], shrunk, 0.0).astype(b_ref.dtype)
        b = plgpu.load(b_ref.at[pl.ds(c0, BC), pl.ds(n0, BN)], mask=cmask[:, None] & nmask[None, :], other=0.0)
        return acc + jax.lax.dot_general(shrunk, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, pl.cdiv(C, BC), body, jnp.zeros((Mp, BN), jnp.float32))
    tile = rows[:, None] & nmask[None, :]
    y = plgpu.load(y_ref.at[pl.ds(0, Mp), pl.ds(n0, BN)], mask=tile, other=0.0)
    out = y.astype(jnp.float32) + acc.astype(y.dtype).astype(jnp.float32)
    plgpu.store(o_ref.at[pl.ds(0, Mp), pl.ds(n0, BN)], out.astype(o_ref.dtype), mask=tile)


def lora_expand(y: jax.Array, parts: jax.Array, b: jax.Array, slots: jax.Array, width: int, *, block_n: int = 64,
                block_c: int = 64, num_warps: int = 4, interpret: bool | None = None) -> jax.Array:
    """y [M, O] + ((sum(parts [S, M, C]) * onehot) @ b [C, O]), onehot[m, c] = (c // width == slots[m]); y is updated
    in place (donate it). interpret: None = interpret mode unless the default backend is a GPU."""
    if y.ndim != 2 or parts.ndim != 3 or b.ndim != 2 or parts.shape[1] != y.shape[0] or parts.shape[2] != b.shape[0] \
            or b.shape[1] != y.shape[1] or slots.shape != (y.shape[0],):
        raise ValueError(f"lora_expand: y [M, O], parts [S, M, C], b [C, O], slots [M]; got {y.shape}, "
                         f"{parts.shape}, {b.shape}, {slots.shape}")
    M, O = y.shape
    S, _, C = parts.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"lora_expand takes 1..{MAX_ROWS} rows, got {M}")
    Mp, Sp = max(16, next_pow2(M)), next_pow2(S)
    BN, BC = min(block_n, max(16, next_pow2(O))), min(block_c, max(16, next_pow2(C)))
    interp = use_interpret(interpret)
    log_once(log, ("lora_expand", interp, M, S, C, O), "lora_expand [%d rows, %d partials, %d slot columns -> %d]: %s",
             M, S, C, O, "Pallas interpret mode (no GPU)" if interp else "Pallas (Triton) on GPU")
    kernel = functools.partial(_kernel, S=S, Sp=Sp, M=M, Mp=Mp, C=C, BC=BC, O=O, BN=BN, width=width)
    with warnings.catch_warnings():  # jax 0.11 warns that the Triton backend is deprecated, once per trace
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        return pl.pallas_call(
            kernel,
            grid=(pl.cdiv(O, BN),),
            out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
            input_output_aliases={3: 0},
            interpret=interp,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
            name=f"lora_expand_M{M}_S{S}_C{C}_BN{BN}",
        )(slots.astype(jnp.int32), parts, b, y)


def lora_expand_reference(y, parts, b, slots, width: int):
    """Plain jnp: the same update through XLA."""
    C = b.shape[0]
    keep = (jnp.arange(C, dtype=jnp.int32) // width)[None, :] == slots[:, None]
    shrunk = jnp.where(keep, jnp.sum(parts, axis=0), 0.0).astype(b.dtype)
    delta = jnp.dot(shrunk, b, preferred_element_type=jnp.float32).astype(y.dtype)
    return y + delta

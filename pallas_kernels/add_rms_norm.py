"""Residual add + RMSNorm after a split-K GEMV, as one Pallas (Triton) kernel, plus a plain-jnp reference.

It takes the GEMV's partials as written (`gemv(..., partials=True)`: float32 [S, M, D]); one program per row sums them,
rounds the product to h's dtype (as the dot's output would be), adds it to h and normalises, writing both h and the
normed row: the split-K sum, the add and the norm in one kernel. Numerics follow jphoton/models/layers.py op for op
(fp32 statistics; the normed row rounded to h's dtype before the weight multiplies; every bf16 op rounded once), so
the fused path computes what the XLA path computes.
Why: docs/kernels.md, "Residual add + RMSNorm"; numbers: docs/decisions.md, "Decode step on the device".
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import log_once, next_pow2, traced_once, use_interpret

log = logging.getLogger("jphoton.kernels")


def _kernel(layer_ref, h_ref, p_ref, w_ref, h_out_ref, n_out_ref, *, S, Sp, D, Dp, eps):
    r = pl.program_id(0)
    cols = pl.ds(0, Dp)
    in_row = jnp.arange(Dp, dtype=jnp.int32) < D
    mask = in_row if Dp != D else None

    def load(ref):
        return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)

    # All S partials as one [Sp, Dp] tile: one load whose latency is paid once. Summed one [Dp] load at a time, the
    # loads were issued one after another (H100 profile: 2.6 us with 4 partials, 3.7 us with 8).
    parts = plgpu.load(p_ref.at[pl.ds(0, Sp), r, cols],
                       mask=(jnp.arange(Sp, dtype=jnp.int32) < S)[:, None] & in_row[None, :], other=0.0)
    y = jnp.sum(parts, axis=0)
    dtype = h_out_ref.dtype
    h = (load(h_ref.at[r, cols]).astype(jnp.float32) + y.astype(dtype).astype(jnp.float32)).astype(dtype)
    hf = h.astype(jnp.float32)
    inv_rms = 1.0 / jnp.sqrt(jnp.sum(hf * hf) / D + eps)  # masked columns are zeros
    g = load(w_ref.at[layer_ref[0], cols]).astype(jnp.float32)
    normed = g * (hf * inv_rms).astype(dtype).astype(jnp.float32)
    plgpu.store(h_out_ref.at[r, cols], h, mask=mask)
    plgpu.store(n_out_ref.at[r, cols], normed.astype(n_out_ref.dtype), mask=mask)


@traced_once
def add_rms_norm(h: jax.Array, parts: jax.Array, weight: jax.Array, layer=None, *, eps: float, num_warps: int = 8,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """h [M, D] + sum(parts [S, M, D]) -> (h', RMSNorm(h') * weight) (parts may have more columns after D, unread:
    a LoRA shrink's, jphoton/models/lora.py), h' in h's dtype, the normed rows in the dtype
    `weight * h'` has. weight: [D], or stacked [L, D] read at `layer` (a Python int or a traced scalar; never sliced,
    so a layer loop does not copy it). interpret: None = interpret mode unless the default backend is a GPU."""
    if h.ndim != 2 or parts.ndim != 3 or parts.shape[1] != h.shape[0] or parts.shape[2] < h.shape[1]:
        raise ValueError(f"parts must be [S, M, D] over h [M, D]; got h {h.shape}, parts {parts.shape}")
    if weight.ndim == 1:
        weight, layer = weight[None], 0
    elif layer is None:
        raise ValueError("a stacked [L, D] weight needs `layer`")
    if weight.ndim != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight {weight.shape} does not fit h {h.shape}")
    (M, D), S = h.shape, parts.shape[0]
    interp = use_interpret(interpret)
    log_once(log, ("add_rms_norm", interp, M, D, S), "add_rms_norm [%d, %d] + %d partials: %s", M, D, S,
             "Pallas interpret mode (no GPU)" if interp else "Pallas Triton on GPU")
    normed_dtype = jnp.result_type(weight.dtype, h.dtype)
    kernel = functools.partial(_kernel, S=S, Sp=next_pow2(S), D=D, Dp=next_pow2(D), eps=float(eps))
    with warnings.catch_warnings():  # jax 0.11 warns that the Triton backend is deprecated, once per trace
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        return pl.pallas_call(
            kernel,
            grid=(M,),
            out_shape=(jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, normed_dtype)),
            interpret=interp,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
            name=f"add_rms_norm_M{M}_S{S}",
        )(jnp.asarray(layer, jnp.int32).reshape(1), h, parts, weight)


def add_rms_norm_reference(h: jax.Array, parts: jax.Array, weight: jax.Array, layer=None, *, eps: float
                           ) -> tuple[jax.Array, jax.Array]:
    """Plain jnp, the formulas of the model's XLA path (jphoton/models/layers.py `dense`'s rounding, `rms_norm`)."""
    h = h + jnp.sum(parts, axis=0).astype(h.dtype)
    xf = h.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return h, (weight[layer] if weight.ndim == 2 else weight) * xf.astype(h.dtype)

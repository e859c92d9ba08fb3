"""Building blocks shared by the decoder families: RMSNorm, RoPE tables, SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.models.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Statistics in float32 whatever the activation dtype; the weight multiplies after the cast back, as HF does.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, with the config's scaling applied (computed on the host once)."""
    hd = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.kind == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32)
    if rs.kind == "factors":
        factors = np.asarray(rs.freq_factors, np.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope freq factors have shape {factors.shape}, expected {inv.shape}")
        return (inv / factors).astype(np.float32)
    if rs.kind == "llama3":
        old = np.float32(rs.original_max_position_embeddings)
        low_wavelen = old / np.float32(rs.low_freq_factor)
        high_wavelen = old / np.float32(rs.high_freq_factor)
        wavelen = np.float32(2 * np.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(rs.factor), inv)
        smooth = (old / wavelen - np.float32(rs.low_freq_factor)) / np.float32(rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(rs.factor) + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unknown rope scaling kind {rs.kind!r}")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [..., T, H, hd]; positions: [..., T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, hd/2]
    cos = jnp.cos(angles)[..., None, :].astype(x.dtype)
    sin = jnp.sin(angles)[..., None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w accumulated in float32 and rounded once to x.dtype, as torch's cuBLAS GEMMs do: the rounding then does
    not depend on which GEMM emitter or split-K XLA picks for a shape. The cast fuses into the GEMM's epilogue, so
    nothing wider than x.dtype reaches HBM."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in float32, rounded once to gate.dtype. Written as bf16 ops, XLA rounds after each of the
    sigmoid's exp, add and divide and after the product."""
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    return dense(silu_mul(dense(x, w_gate), dense(x, w_up)), w_down)

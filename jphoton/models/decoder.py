"""What every decoder family here shares (the dense Llama family in models/llama.py, Qwen3-MoE in
models/qwen3_moe.py): the params and attention-callback types, and the attention block's input projections.

`attend(q, k, v, kv, layer) -> (out, kv)` writes this step's keys/values into layer `layer` of the KV state and attends
over it: one layer body then serves every KV layout (llama.dense_attention, the engine's paged attention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.models.config import ModelConfig
from jphoton.models.layers import apply_rope, dense, rms_norm

Params = dict[str, Any]
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


def _split_last(x: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
    bounds = np.cumsum(sizes)[:-1].tolist()
    return jnp.split(x, bounds, axis=-1)


def attention_projections(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                          proj: Callable[[jax.Array, str], jax.Array] | None = None,
                          update: Callable[[jax.Array], jax.Array] | None = None):
    """q, k, v with RoPE (and qk-norm) applied, from the normed rows h and one layer's params `lp` (separate wq / wk /
    wv or the serving layout's fused wqkv). proj(h, key) is the weight matmul (default h @ lp[key]). update(qkv, extra):
    applied to the q|k|v products [..., q_size + 2 * kv_size] before the split, with the product's columns past them
    (a LoRA update and its shrink, models/lora.py INLINE; None without them)."""
    lead = h.shape[:-1]
    if proj is None:
        def proj(h, key):
            return dense(h, lp[key])
    if "wqkv" in lp:
        qkv = proj(h, "wqkv")
        width = cfg.q_size + 2 * cfg.kv_size
        extra = None
        if qkv.shape[-1] > width:  # LoRA's shrink columns (models/lora.py INLINE)
            qkv, extra = qkv[..., :width], qkv[..., width:]
        if cfg.qkv_bias:
            qkv = qkv + lp["bqkv"]
        if update is not None:
            qkv = update(qkv, extra)
        q, k, v = _split_last(qkv, (cfg.q_size, cfg.kv_size, cfg.kv_size))
    else:
        q, k, v = proj(h, "wq"), proj(h, "wk"), proj(h, "wv")
        if cfg.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        if update is not None:
            q, k, v = _split_last(update(jnp.concatenate([q, k, v], axis=-1), None),
                                  (cfg.q_size, cfg.kv_size, cfg.kv_size))
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

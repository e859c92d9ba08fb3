"""Moondream's vision tower (2 and 3 share it) as pure functions over the params of models/moondream.py: a
SigLIP-style ViT over 378x378 crops (patch 14 -> 27x27 = 729 patches), the global view plus up to `max_crops`
overlapping local crops; the local crops' features are stitched and average-pooled back to 27x27 (`pool_weights`, host
side, fixed shape whatever the tiling), concatenated with the global view's and projected by a 2-layer MLP into the
text width; `encode_into_cache` (the engine's vision step) writes them into the image cache the text steps read."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jphoton.models.moondream import MoondreamConfig, Params, affine, layer_norm, mlp


def patches(crops: jax.Array, patch: int) -> jax.Array:
    """crops [N, S, S, 3] uint8 -> [N, (S/p)^2, 3*p*p] in the reference's (channel, row, column) order, scaled to
    [-1, 1]."""
    N, S = crops.shape[0], crops.shape[1]
    g = S // patch
    x = crops.astype(jnp.float32) / 255.0 * 2.0 - 1.0
    x = x.reshape(N, g, patch, g, patch, 3).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(N, g * g, 3 * patch * patch)


def vision_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str = "xla") -> jax.Array:
    """q, k, v [N, T, H, d] -> [N, T, H, d]: each crop's patches attend to each other (bidirectional). impl "xla": the
    plain einsums, float32 scores (the reference); "cudnn": cuDNN's fused flash attention (GPU, 16-bit inputs)."""
    scale = q.shape[-1] ** -0.5
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn")
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


def vision_encode(params: Params, cfg: MoondreamConfig, crops: jax.Array, dtype=None, attention: str = "xla"
                  ) -> jax.Array:
    """crops [N, 378, 378, 3] uint8 -> features [N, 729, enc_dim] (after the final LayerNorm); attention: the
    `vision_attention` implementation."""
    v, p = cfg.vision, params["vision"]
    dtype = dtype or p["patch_w"].dtype
    x = affine(patches(crops, v.patch_size).astype(dtype), p["patch_w"], p["patch_b"]) + p["pos"].astype(dtype)
    H, E = v.n_heads, v.enc_dim
    N, T = x.shape[0], x.shape[1]

    def block(x, w):
        h = layer_norm(x, w["ln1_w"], w["ln1_b"], v.ln_eps)
        q, k, vv = (a.reshape(N, T, H, E // H) for a in jnp.split(affine(h, w["wqkv"], w["bqkv"]), 3, axis=-1))
        a = vision_attention(q, k, vv, attention)
        x = x + affine(a.reshape(N, T, E), w["wo"], w["bo"])
        h = layer_norm(x, w["ln2_w"], w["ln2_b"], v.ln_eps)
        return x + mlp(h, w["fc1"], w["b1"], w["fc2"], w["b2"]), None

    if isinstance(p["layers"], tuple):  # (serving_layout) unrolled over per-layer params
        for w in p["layers"]:
            x, _ = block(x, w)
    else:
        x, _ = jax.lax.scan(block, x, p["layers"])
    return layer_norm(x, p["post_ln_w"], p["post_ln_b"], v.ln_eps)


def vision_project(params: Params, cfg: MoondreamConfig, features: jax.Array, pool_rows: jax.Array,
                   pool_cols: jax.Array) -> jax.Array:
    """features [1 + C, 729, E] (global view first, then C local crops; padding crops allowed) and the crops' pooling
    weights pool_rows / pool_cols [C, g, g] (`jphoton.image.crops.pool_weights`: zero for padding crops) ->
    image embeddings [729, D]. The local features are stitched and average-pooled to g x g as
    sum_c rows_c @ F_c @ cols_c^T, which is the reference's reconstruct-then-adaptive-pool, in one fixed shape."""
    v, p = cfg.vision, params["vision"]
    g, E = v.grid, v.enc_dim
    local = features[1:].reshape(-1, g, g, E).astype(jnp.float32)
    pooled = jnp.einsum("cij,cjkd,clk->ild", pool_rows.astype(jnp.float32), local, pool_cols.astype(jnp.float32))
    x = jnp.concatenate([features[0], pooled.reshape(g * g, E).astype(features.dtype)], axis=-1)
    return mlp(x, p["proj_fc1"], p["proj_b1"], p["proj_fc2"], p["proj_b2"])


def encode_into_cache(params: Params, cfg: MoondreamConfig, slot: jax.Array, crops: jax.Array, pool_rows: jax.Array,
                      pool_cols: jax.Array, attention: str = "xla") -> Params:
    """The vision step: encode one image's crops (padded to a bucket: padding crops have zero pooling weights) and
    write its projected embeddings into `params["image_cache"][slot]`. Returns params (the engine donates them)."""
    feats = vision_encode(params, cfg, crops, dtype=params["image_cache"].dtype, attention=attention)
    emb = vision_project(params, cfg, feats, pool_rows, pool_cols)
    cache = jax.lax.dynamic_update_slice(params["image_cache"], emb[None].astype(params["image_cache"].dtype),
                                         (slot, 0, 0))
    return {**params, "image_cache": cache}

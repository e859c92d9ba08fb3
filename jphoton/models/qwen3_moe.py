"""Qwen3-MoE decoder: Qwen3 attention (q/k RMSNorm, GQA, RoPE) with a mixture-of-experts MLP in the layers HF's rule
selects (`cfg.is_moe_layer`), a dense SwiGLU MLP in the others. Same contract as the Llama family:
`forward(params, cfg, tokens, positions, kv, attend) -> (hidden, kv)`, with paged attention through `attend`.

Params: see models/llama.py (`param_shapes`): attention and norms stacked over all layers in `layers`, experts in `moe`,
dense MLPs (if any) in `dense_mlp`. When every layer is MoE and `unroll` is off, the layer loop is one `lax.scan` whose
body indexes the expert stacks with the traced layer number (the warp-decode kernels read the stack in place; nothing
is sliced out); otherwise it is a Python loop (what `unroll` gives the dense families too), served from per-layer
params (`llama.unstack_layers`) by the engine.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jphoton.models import moe
from jphoton.models.config import ModelConfig
from jphoton.models.decoder import Attend, Params, attention_projections
from jphoton.models.layers import dense, rms_norm, rope_inv_freq, swiglu


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, kv: Any, attend: Attend,
            unroll: bool = False, moe_backend: str = "auto", tp=None) -> tuple[jax.Array, Any]:
    """tp: run as one shard of a tensor-parallel model (models/tensor_parallel.py): each sublayer's output is this
    shard's partial sum, all-reduced before the residual add."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    x = params["embed"][tokens] if tp is None else tp.embed(params["embed"], tokens)
    reduce = (lambda y: y) if tp is None else tp.psum  # a sublayer's partial sums, in the activation dtype
    k, norm = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def attention(x, kv, lp, index):
        q, kk, v = attention_projections(cfg, lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), positions, inv_freq)
        o, kv = attend(q, kk, v, kv, index)
        o = o.reshape(*x.shape[:-1], cfg.q_size)
        o = reduce(dense(o, lp["wo"]))
        if cfg.o_bias:
            o = o + lp["bo"]
        x = x + o
        return x, kv, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)

    moe_rank = {i: r for r, i in enumerate(cfg.moe_layers)}
    dense_rank = {i: r for r, i in enumerate(cfg.dense_layers)}
    if isinstance(params["layers"], (tuple, list)):  # per-layer params (llama.unstack_layers): the unrolled loop
        vectors = params.get("layer_vectors", {})  # norms and biases stay [L, ...] stacks (llama.unstack_layers)
        for i, lp in enumerate(params["layers"]):
            x, kv, h = attention(x, kv, {**lp, **{key: v[i] for key, v in vectors.items()}}, i)
            if i in moe_rank:  # the kernels take a stack and an index: this layer's experts as a stack of one
                experts = jax.tree_util.tree_map(lambda a: a[None], params["moe"][moe_rank[i]])
                x = x + reduce(moe.moe_ffn(h, experts, 0, k, norm, moe_backend))
            else:
                mp = params["dense_mlp"][dense_rank[i]]
                x = x + reduce(swiglu(h, mp["w_gate"], mp["w_up"], mp["w_down"]))
    elif not dense_rank and not unroll:
        def layer(carry, xs):
            x, kv = carry
            lp, index = xs
            x, kv, h = attention(x, kv, lp, index)
            return (x + reduce(moe.moe_ffn(h, params["moe"], index, k, norm, moe_backend)), kv), None

        (x, kv), _ = jax.lax.scan(layer, (x, kv), (params["layers"], jnp.arange(cfg.num_layers)))
    else:
        for i in range(cfg.num_layers):
            lp = jax.tree_util.tree_map(lambda a, i=i: a[i], params["layers"])
            x, kv, h = attention(x, kv, lp, i)
            if i in moe_rank:
                x = x + reduce(moe.moe_ffn(h, params["moe"], moe_rank[i], k, norm, moe_backend))
            else:
                mp = jax.tree_util.tree_map(lambda a, r=dense_rank[i]: a[r], params["dense_mlp"])
                x = x + reduce(swiglu(h, mp["w_gate"], mp["w_up"], mp["w_down"]))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv

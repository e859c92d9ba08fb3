"""Mixture-of-experts feed-forward: top-k softmax routing and the backends that run the routed experts.

Backends (all take the same stacked expert weights, so switching costs nothing): warp_decode (the output-centric Pallas
kernels of pallas_kernels/moe_warp_decode.py, for decode-sized steps) and expert_centric (plain JAX: pairs sorted by
expert, a grouped GEMM with `jax.lax.ragged_dot_general`, bf16 intermediates in a bf16 model, the combine in fp32: for
prefill and large batches). "auto" picks warp_decode for steps of at most WARP_DECODE_MAX_TOKENS tokens (a static
shape: once per compiled bucket). Weights per MoE layer, stacked, HF's [out, in] per expert: router [Lm, D, E]
(optionally router_b [Lm, E]), w_gate / w_up [Lm, E, F, D], w_down [Lm, E, D, F]. The expert's activation: "silu",
SiLU(gate) * up (Qwen3-MoE), or "gelu_plus1", exact GELU(gate) * (up + 1) (Moondream 3).
Numbers: docs/decisions.md, "Prefix caching, LoRA, tensor parallelism, MoE".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MOE_BACKENDS = ("auto", "warp_decode", "expert_centric")
# Tokens per step up to which "auto" runs warp decode. Measured on the H100 (benchmarks/RESULTS.md, `gpu_suite.sh
# moe-threshold`, one layer, bf16): warp decode beat the expert-centric path at every size tried, 32..192 tokens, on
# both the Qwen3-30B-A3B and moondream3 shapes, by 1.65-2.38x and 1.19-1.77x; the margin shrinks past 64 tokens (the
# kernels then run in 64-token chunks that each re-read the experts), so the switch sits at the largest size measured
# to win on both shapes. Prefill chunks above it take the grouped GEMM.
WARP_DECODE_MAX_TOKENS = 192


def check_backend(backend: str) -> str:
    if backend not in MOE_BACKENDS:
        raise ValueError(f"moe_backend must be one of {', '.join(repr(b) for b in MOE_BACKENDS)}, got {backend!r}")
    return backend


def resolve_backend(backend: str, num_tokens: int) -> str:
    """The backend a step of `num_tokens` tokens runs (static at trace time)."""
    check_backend(backend)
    if backend == "auto":
        return "warp_decode" if num_tokens <= WARP_DECODE_MAX_TOKENS else "expert_centric"
    return backend


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """x [N, D], router [D, E] (+ bias [E]) -> (ids [N, k] int32, weights [N, k] float32). Softmax over all experts in
    fp32, top-k, optionally renormalised (HF Qwen3-MoE; HF rounds the weights to the model dtype, we keep them in
    fp32). Renormalised, this equals a softmax over the top-k logits (Moondream 3)."""
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def _layer(w: jax.Array, layer) -> jax.Array:
    return w if layer is None else w[layer]


def expert_centric(x, ids, weights, w_gate, w_up, w_down, layer=None, activation: str = "silu") -> jax.Array:
    """Sort pairs by expert, two grouped GEMMs (`ragged_dot_general`), weighted scatter-add combine. Returns x.dtype.
    Intermediates (SiLU(gate)*up and each expert's output) are rounded to x.dtype, as a bf16 grouped-GEMM pipeline
    does; the combine accumulates in fp32."""
    w_gate, w_up, w_down = _layer(w_gate, layer), _layer(w_up, layer), _layer(w_down, layer)
    N, K = ids.shape
    E = w_gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    token = order // K
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[token]  # [N*K, D], grouped by expert
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                           rhs_group_dimensions=[0])
    g = jax.lax.ragged_dot_general(xs, w_gate, group_sizes, dn, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot_general(xs, w_up, group_sizes, dn, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u if activation == "silu" else jax.nn.gelu(g, approximate=False) * (u + 1)).astype(x.dtype)
    y = jax.lax.ragged_dot_general(h, w_down, group_sizes, dn, preferred_element_type=jnp.float32).astype(x.dtype)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros(x.shape, jnp.float32).at[token].add(y).astype(x.dtype)


def warp_decode(x, ids, weights, w_gate, w_up, w_down, layer=None, activation: str = "silu") -> jax.Array:
    from pallas_kernels.moe_warp_decode import moe_warp_decode

    return moe_warp_decode(x, ids, weights, w_gate, w_up, w_down, layer, activation=activation)


_EXPERTS = {"warp_decode": warp_decode, "expert_centric": expert_centric}


def moe_ffn(x: jax.Array, mp: dict, layer, top_k: int, norm_topk_prob: bool, backend: str,
            activation: str = "silu") -> jax.Array:
    """The MoE feed-forward of one layer. x [..., D]; mp holds the stacked MoE weights (router, optional router_b,
    w_gate, w_up, w_down) and `layer` indexes them (a Python int or a traced scalar: the kernels index the stack,
    never slice it)."""
    lead = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])
    ids, weights = route(xf, mp["router"][layer], top_k, norm_topk_prob,
                         mp["router_b"][layer] if "router_b" in mp else None)
    experts = _EXPERTS[resolve_backend(backend, xf.shape[0])]
    y = experts(xf, ids, weights, mp["w_gate"], mp["w_up"], mp["w_down"], layer, activation)
    return y.reshape(*lead, x.shape[-1])

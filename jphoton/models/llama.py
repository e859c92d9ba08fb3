"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) as pure functions over a params pytree.

Checkpoint layout: layers stacked on a leading axis (`param_shapes` gives every leaf's shape); loaders and checkpoints
keep it. Serving layout (`fuse_params`, once when a model is built for the engine): wq|wk|wv fused into wqkv and
w_gate|w_up into w_gate_up; `unstack_layers` gives the unrolled loop per-layer matrices (norms and biases stay [L, X]
stacks, `layer_vectors`). `forward` branches on which keys are present. MoE variants (`cfg.num_experts > 0`) keep their
expert stacks apart (models/qwen3_moe.py). Attention is a callback, `attend(q, k, v, kv, layer) -> (out, kv)`, so one
layer body serves every KV layout (models/decoder.py); `dense_attention` is the reference, the engine's paged
attention is jphoton/engine/attention.py. Every leaf's shape: docs/models.md, "Params layouts".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.models import lora as lora_lib
from jphoton.models import qwen3_moe, tensor_parallel
from jphoton.models.config import ModelConfig
from jphoton.models.decoder import Attend, Params, attention_projections
from jphoton.models.layers import rms_norm, rope_inv_freq, silu_mul
from jphoton.models.matmul import PlainMatmul, swiglu_of


def param_shapes(cfg: ModelConfig) -> Params:
    """The params pytree as shapes (tuples); tells random init, loaders and checkpoint restore what to expect."""
    L, D, F, V, hd = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    layers = {
        "attn_norm": (L, D), "mlp_norm": (L, D),
        "wq": (L, D, cfg.q_size), "wk": (L, D, cfg.kv_size), "wv": (L, D, cfg.kv_size), "wo": (L, cfg.q_size, D),
        "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
    }
    if cfg.qkv_bias:
        layers.update(bq=(L, cfg.q_size), bk=(L, cfg.kv_size), bv=(L, cfg.kv_size))
    if cfg.o_bias:
        layers.update(bo=(L, D))
    if cfg.qk_norm:
        layers.update(q_norm=(L, hd), k_norm=(L, hd))
    shapes: Params = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
    if cfg.num_experts:
        for name in ("w_gate", "w_up", "w_down"):
            del layers[name]
        Lm, Ld, E, Fm = len(cfg.moe_layers), len(cfg.dense_layers), cfg.num_experts, cfg.moe_intermediate_size
        if Lm:
            shapes["moe"] = {"router": (Lm, D, E), "w_gate": (Lm, E, Fm, D), "w_up": (Lm, E, Fm, D),
                             "w_down": (Lm, E, D, Fm)}
        if Ld:
            shapes["dense_mlp"] = {"w_gate": (Ld, D, F), "w_up": (Ld, D, F), "w_down": (Ld, F, D)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def check_params(cfg: ModelConfig, params: Params) -> None:
    """Raise ValueError unless `params` has exactly the keys and shapes the config implies."""
    want = param_shapes(cfg)

    def walk(w, p, path):
        if isinstance(w, dict):
            if not isinstance(p, dict):
                raise ValueError(f"params{path}: expected a dict")
            missing, extra = sorted(set(w) - set(p)), sorted(set(p) - set(w))
            if missing or extra:
                raise ValueError(f"params{path}: missing {missing}, unexpected {extra}")
            for k in w:
                walk(w[k], p[k], f"{path}.{k}")
        elif tuple(p.shape) != tuple(w):
            raise ValueError(f"params{path}: shape {tuple(p.shape)}, expected {tuple(w)}")

    walk(want, params, "")


# Serving-layout fusions: fused key -> the keys it concatenates along the last axis (in `layers`).
FUSIONS = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_params(cfg: ModelConfig, params: Params, *, consume: bool = False) -> Params:
    """The serving layout: returns params whose `layers` hold wqkv (+ bqkv) and, for dense MLPs, w_gate_up instead of
    their parts (docs/models.md, "Params layouts"). Numpy leaves are concatenated on the host (before any device_put);
    device leaves group by group on their device. consume=True pops the parts out of `params["layers"]` as it goes, so
    that (when nothing else holds them) each group's parts are freed once its fused copy exists: the peak is the weights
    plus one fused group, never a second copy of the model. Already-fused params come back unchanged."""
    src = params["layers"]
    if isinstance(src, (tuple, list)):  # per-layer params (`unstack_layers`, or random weights made that way)
        return {**params, "layers": tuple(fuse_params(cfg, {"layers": lp}, consume=consume)["layers"] for lp in src)}
    layers = dict(src)
    for fused, parts in FUSIONS.items():
        if fused in layers or not all(p in layers for p in parts):
            continue
        arrays = [layers.pop(p) for p in parts]
        if consume:
            for p in parts:
                src.pop(p, None)
        if all(isinstance(a, np.ndarray) for a in arrays):
            layers[fused] = np.concatenate(arrays, axis=-1)
        elif tensor_parallel.is_sharded(arrays[0]):  # column-parallel parts: shard s of the result is [q_s | k_s | v_s]
            layers[fused] = tensor_parallel.concat_shards(arrays)
        else:
            layers[fused] = jnp.concatenate(arrays, axis=-1)
        del arrays
    return {**params, "layers": layers}


def layer_groups(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Which decoder layers each stacked group of `param_shapes` holds, in stack order."""
    groups = {"layers": tuple(range(cfg.num_layers))}
    if cfg.num_experts:
        groups.update(moe=cfg.moe_layers, dense_mlp=cfg.dense_layers)
    return groups


def unstack_layers(params: Params, *, consume: bool = False) -> Params:
    """The per-layer serving layout for the unrolled layer loop: each stacked group (`layers`, and for MoE models `moe`
    and `dense_mlp`) becomes a tuple of per-layer dicts of its matrices. Why: an unrolled loop over a stack slices layer
    i out of it, the slice fuses into that layer's GEMMs, and every layer's GEMM becomes a fusion of its own that
    XLA:GPU autotunes separately (~5,000 autotuned kernels for a 30-layer model; docs/step-shapes.md); with one array
    per layer the layers' GEMMs are the same fusion, tuned once. The per-layer vectors of `layers` (norms, biases,
    qk-norms: [L, X] stacks) stay stacked, in `layer_vectors`: a static slice of one fuses into its elementwise
    consumer, a kernel reads the stack at the layer, and every array is one more argument of each step's dispatch
    (~1-3 us each on the H100; 104 -> 74 for the 1B, docs/step-shapes.md). Numpy leaves are split into views (no copy);
    device leaves by one jitted split per leaf shape. consume=True pops each stack out of `params` as it goes (peak:
    weights + one leaf). Already-unstacked params come back unchanged, but for vectors still in the per-layer dicts
    (stacked now)."""
    out = dict(params)
    for group in ("layers", "moe", "dense_mlp"):
        stack = params.get(group)
        if stack is None:
            continue
        if isinstance(stack, (tuple, list)):
            if group == "layers" and any(a.ndim == 1 for a in stack[0].values()):
                out.update(_stack_vectors(stack, params.get("layer_vectors")))
            continue
        n = next(iter(stack.values())).shape[0]
        per_layer: list[dict[str, Any]] = [{} for _ in range(n)]
        vectors = {}
        for key in list(stack):
            a = stack.pop(key) if consume else stack[key]
            if group == "layers" and a.ndim == 2:
                vectors[key] = a
                continue
            parts = list(a) if isinstance(a, np.ndarray) else _split_leading(a)
            del a
            for lp, part in zip(per_layer, parts, strict=True):
                lp[key] = part
        out[group] = tuple(per_layer)
        if vectors:
            out["layer_vectors"] = vectors
    return out


def _stack_vectors(layers, vectors: Params | None) -> Params:
    """Per-layer dicts holding their vectors -> (dicts without them, `layer_vectors` stacks)."""
    keys = [k for k, a in layers[0].items() if a.ndim == 1]
    stack = np.stack if all(isinstance(lp[k], np.ndarray) for lp in layers for k in keys) else jnp.stack
    stacked = {k: stack([lp[k] for lp in layers]) for k in keys}
    return {"layers": tuple({k: a for k, a in lp.items() if k not in stacked} for lp in layers),
            "layer_vectors": {**(vectors or {}), **stacked}}


def layer_params(params: Params, i: int) -> Params:
    """Layer i's params in any layout: stacked (`layers` [L, ...]) or per-layer (`unstack_layers`: the layer's dict
    of matrices and row i of each `layer_vectors` stack, a static slice)."""
    layers = params["layers"]
    if not isinstance(layers, (tuple, list)):
        return jax.tree.map(lambda a: a[i], layers)
    return {**layers[i], **{k: v[i] for k, v in params.get("layer_vectors", {}).items()}}


@jax.jit
def _split_leading(a: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(a[i] for i in range(a.shape[0]))


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, kv: Any,
            attend: Attend, unroll: bool = False, moe_backend: str = "auto",
            matmul: Callable | None = None, lora: lora_lib.LoraInputs | None = None,
            tp: tensor_parallel.TensorParallel | None = None) -> tuple[jax.Array, Any]:
    """Run the decoder on `tokens` at `positions` (same shape, any leading dims, e.g. [B, T] or a flat [N]).

    Returns final-normed hidden states [..., D] and the updated KV state. The KV state rides in the layer loop's carry
    (updated in place by XLA, never copied per layer); `attend(q, k, v, kv, layer)` writes this layer's keys/values
    into it and returns the attention output [..., Hq, hd]. `unroll` runs the layers as a Python loop (the layer index
    a Python int) instead of a `lax.scan`: longer compiles, but no loop control between layers (on GPU each loop
    iteration is a synchronisation point for XLA). Per-layer params (`unstack_layers`) always run unrolled.
    `moe_backend` only matters for MoE configs (models/moe.py). `matmul` (models/matmul.py; None = plain `@`, XLA) runs
    the dense layers' weight matmuls, given the layer's matrix and a stack + index for kernels, and the residual adds
    and RMSNorms after them; MoE configs ignore it. Params may be in the serving layouts (`fuse_params`,
    `unstack_layers`) or not. `lora`: per-row LoRA adapters (models/lora.py), added to every target's product; None
    runs the base model alone (no LoRA op in the program). `tp`: run as one shard of a tensor-parallel model
    (models/tensor_parallel.py), inside `shard_map`: `cfg` and `params` are then the shard's, and the hook's `residual`
    must all-reduce (`matmul.make(..., reduce=tp.psum)`)."""
    if cfg.num_experts:
        if lora is not None:
            raise ValueError("LoRA adapters are supported for dense Llama-family models only, not MoE")
        return qwen3_moe.forward(params, cfg, tokens, positions, kv, attend, unroll=unroll, moe_backend=moe_backend,
                                 tp=tp)
    mm = matmul or PlainMatmul()
    eps = cfg.rms_norm_eps
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    per_layer = isinstance(params["layers"], (tuple, list))
    if per_layer and "layer_vectors" not in params:  # per-layer dicts still holding their norms: stack them
        params = unstack_layers(params)
    layers = params["layers"]
    # Each sublayer ends by normalising the residual stream for the next matmul (the MLP's norm after attention; the
    # next layer's attention norm, or the final norm, after the MLP), so that a hook can run the residual add and the
    # norm in one kernel: `matmul.residual`. Same ops as norm-at-the-start, in the same order.
    if per_layer:  # the norms as [L, D] stacks (`layer_vectors`): a kernel reads them at (stack, index)
        attn_norms = params["layer_vectors"]["attn_norm"]
        L = len(layers)
        next_norms = [(attn_norms, i + 1) for i in range(L - 1)] + [(params["final_norm"][None], 0)]
        first_norm = attn_norms[0]
    else:
        next_norm = jnp.concatenate([layers["attn_norm"][1:], params["final_norm"][None]])
        first_norm = layers["attn_norm"][0]
    x = embed(params["embed"], tokens, tp)
    h = rms_norm(x, first_norm, eps)

    def layer(carry, lp, norm_after, stacks, index, kv_layer, lw=None, norm_index=None):
        """One decoder layer. lp: this layer's matrices (what an XLA dot should read); stacks[key][index]: the same
        matrix as a stack + index (what a kernel should read: a slice fed to a custom call is copied; per-layer params
        pass a [1, ...] view and index 0, and their norms' [L, D] stacks with norm_index {key: row}). kv_layer: the
        layer's index in the KV pool. lw: the layer's LoRA groups (models/lora.py) or None. Each product's columns
        past the base ones are its LoRA shrink (lora.INLINE); the update of O or down is added to the residual stream
        inside the hook, before the product (same sum); with LoRA rows gate+up runs as a product and a SwiGLU, not the
        hook's fused `glu`."""
        x, h, kv = carry  # the residual stream, and its normalised copy that this layer's attention reads

        def proj(v, key):
            return mm(v, lp[key], stacks[key], index)

        def lora_update(group):  # y, the group's shrink (each row its own adapter's columns) -> y + update
            if lw is None:
                return None
            width = lora_lib.group_width(group, lora.rank)
            return lambda y, shrunk: mm.lora_expand(y, shrunk, lw[group][1], lora.token_slots, width)

        q, k, v = attention_projections(cfg, lp, h, positions, inv_freq, proj, update=lora_update("qkv"))
        o, kv = attend(q, k, v, kv, kv_layer)
        norm_at = norm_index or {"mlp_norm": index, "next_norm": index}
        x, h = mm.residual(x, o.reshape(*x.shape[:-1], cfg.q_size), lp["wo"], stacks["wo"], index, lp["mlp_norm"],
                           stacks["mlp_norm"], eps, bias=lp["bo"] if cfg.o_bias else None, lora=lora_update("o"),
                           norm_layer=norm_at["mlp_norm"])
        F2 = 2 * cfg.intermediate_size
        if lw is not None:  # gate | up | the gate_up group's shrink, one product
            gate_up = proj(h, "w_gate_up")
            act = swiglu_of(lora_update("gate_up")(gate_up[..., :F2], gate_up[..., F2:]))
        elif "w_gate_up" in lp:  # (a LoRA engine's base program: the GEMV reads gate | up only)
            act = mm.glu(h, lp["w_gate_up"], stacks["w_gate_up"], index, n=cfg.intermediate_size)
        else:
            act = silu_mul(proj(h, "w_gate"), proj(h, "w_up"))
        x, h = mm.residual(x, act, lp["w_down"], stacks["w_down"], index, norm_after, stacks["next_norm"], eps,
                           lora=lora_update("down"), norm_layer=norm_at["next_norm"])
        return x, h, kv

    carry = (x, h, kv)
    if per_layer:
        for i in range(L):
            lp = layer_params(params, i)
            (next_stack, next_i) = next_norms[i]
            stacks = ({key: a[None] for key, a in layers[i].items()}
                      | {"mlp_norm": params["layer_vectors"]["mlp_norm"], "next_norm": next_stack})
            lw = lora_lib.layer_weights(lora.weights, i) if lora is not None else None
            carry = layer(carry, lp, next_stack[next_i], stacks, 0, i, lw,
                          norm_index={"mlp_norm": i, "next_norm": next_i})
    elif not unroll:
        stacks = {**layers, "next_norm": next_norm}

        def scanned(carry, xs):
            lp, norm_after, index, lw = xs
            return layer(carry, lp, norm_after, stacks, index, index, lw), None

        lora_xs = lora.weights if lora is not None else None
        carry, _ = jax.lax.scan(scanned, carry, (layers, next_norm, jnp.arange(cfg.num_layers), lora_xs))
    else:
        # Unrolled as a Python loop, not `scan(unroll=True)`: the layer index is then a constant, where the unrolled
        # scan slices it out of an iota at run time, and every custom call taking it as an operand (attention, GEMVs)
        # waited on a one-element slice kernel of its own (~0.9 us per layer on the H100, RESULTS.md). The engine
        # serves the unrolled loop over per-layer params (`unstack_layers`); this stacked form is the reference.
        stacks = {**layers, "next_norm": next_norm}
        for i in range(cfg.num_layers):
            lw = lora_lib.layer_weights(lora.weights, i) if lora is not None else None
            carry = layer(carry, jax.tree.map(lambda a, i=i: a[i], layers), next_norm[i], stacks, i, i, lw)
    _, h, kv = carry
    return h, kv


def embed(table: jax.Array, tokens: jax.Array, tp: tensor_parallel.TensorParallel | None = None) -> jax.Array:
    """The token embeddings; vocabulary-parallel under tensor parallelism."""
    return table[tokens] if tp is None else tp.embed(table, tokens)


def lm_head(params: Params, hidden: jax.Array, matmul=None) -> jax.Array:
    """Logits in float32 for hidden states [..., D]. matmul: None (XLA) or a hook with `.head(hidden [R, D], w,
    transposed)` (models/matmul.py), which reads a tied embedding [V, D] as it lies (no transposed copy)."""
    if matmul is not None and hidden.ndim == 2:
        if "lm_head" in params:
            return matmul.head(hidden, params["lm_head"], transposed=False)
        return matmul.head(hidden, params["embed"], transposed=True)
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(hidden, w, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Dense-cache reference attention: the numerical oracle that faster layouts are tested against.


class DenseKV(NamedTuple):
    k: jax.Array  # [L, B, S, Hkv, hd]
    v: jax.Array


def init_dense_kv(cfg: ModelConfig, batch: int, length: int, dtype) -> DenseKV:
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return DenseKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA. q [B, T, Hq, hd]; k, v [B, S, Hkv, hd]; mask [B, T, S] (True = visible)."""
    B, T, Hq, hd = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, hd).astype(q.dtype)


def causal_mask(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """q_pos [B, T], k_pos [B, S] -> [B, T, S]; a key is visible at or before the query (and within the window)."""
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= q_pos[:, :, None] - k_pos[:, None, :] < sliding_window
    return mask


def dense_attention(cfg: ModelConfig, positions: jax.Array) -> Attend:
    """Write k/v at `positions` [B, T] (positions >= S are padding and dropped), attend over positions <= the query's."""

    def attend(q, k, v, kv, layer):
        ck, cv = kv
        B, S = ck.shape[1:3]
        rows = jnp.arange(B)[:, None]
        ck = ck.at[layer, rows, positions].set(k.astype(ck.dtype), mode="drop")
        cv = cv.at[layer, rows, positions].set(v.astype(cv.dtype), mode="drop")
        k_pos = jnp.broadcast_to(jnp.arange(S), (B, S))
        out = grouped_attention(q, ck[layer], cv[layer], causal_mask(positions, k_pos, cfg.sliding_window))
        return out, (ck, cv)

    return attend


def reference_logits(params: Params, cfg: ModelConfig, sequences: list[np.ndarray], unroll: bool = False,
                     moe_backend: str = "auto") -> list[np.ndarray]:
    """Float32 logits at every position of each sequence, computed from scratch in one padded batch (one compile per
    padded length): the simplest possible oracle for tests."""
    T = max(len(s) for s in sequences)
    tokens = np.zeros((len(sequences), T), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = s
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape)
    kv = init_dense_kv(cfg, len(sequences), T, params["embed"].dtype)
    hidden, _ = forward(params, cfg, jnp.asarray(tokens), positions, tuple(kv), dense_attention(cfg, positions),
                        unroll=unroll, moe_backend=moe_backend)
    logits = np.asarray(lm_head(params, hidden))
    return [logits[i, :len(s)] for i, s in enumerate(sequences)]

"""Moondream 2 (the 2025-06 release) and 3 as config + params pytree + pure functions: text decoder, region heads
(the vision tower over the same params: models/moondream_vision.py).

Text decoder: Phi-style blocks (one LayerNorm with bias feeding attention and a GELU-tanh MLP in parallel, summed into
the residual), multi-head attention with RoPE on the first `rot_dim` dims of each head, final LayerNorm, LM head with
bias. A query's prompt is BOS, the 729 image embeddings (attending to each other bidirectionally: the first
`prefix_len` positions), then the skill template's tokens (jphoton/image/skills.py).
Moondream 3 (`TextConfig.n_experts` > 0): the same block, but from layer `moe_start` on the MLP is a mixture of experts
(router with bias, top-k, softmax over the chosen; experts GELU(gate) * (up + 1), models/moe.py), and every layer
scales q and v per head by a learned token term and position term before RoPE (`tau`); the region decoders are a
LayerNorm and one linear layer each; a query's template ends with its suffix once.
Weights: x @ w layout ([in, out]); layers stacked on a leading axis (`param_shapes`): Moondream 3 keeps attention in
`layers` (all layers), the dense MLPs in `dense` and the experts in `moe`. Loader: weights/moondream.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.image import spatial
from jphoton.models import moe
from jphoton.models.matmul import PlainMatmul

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    rot_dim: int = 32
    rope_theta: float = 10000.0
    ln_eps: float = 1e-5
    n_experts: int = 0  # 0: a dense MLP in every layer (Moondream 2); else the layers from moe_start on are MoE
    experts_per_token: int = 8
    expert_dim: int = 1024
    moe_start: int = 4
    tau: bool = False  # q and v scaled per head by a token term and a position term (Moondream 3)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_dense(self) -> int:
        """Layers with a dense MLP: the first ones."""
        return min(self.moe_start, self.n_layers) if self.n_experts else self.n_layers


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    patch_size: int = 14
    n_layers: int = 27
    ff_dim: int = 4304
    n_heads: int = 16
    crop_size: int = 378
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192
    ln_eps: float = 1e-5

    @property
    def grid(self) -> int:  # patches per side of a crop
        return self.crop_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


@dataclasses.dataclass(frozen=True)
class RegionConfig:
    """The spatial heads (point / detect): loaded and kept for the skills that use them."""
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    linear_decoders: bool = False  # Moondream 3: a LayerNorm, then one linear layer per decoder (no inner MLP)


@dataclasses.dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()
    region: RegionConfig = RegionConfig()
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    coord_id: int = 5
    size_id: int = 6
    name: str = "moondream2"
    answer_suffixes: int = 2  # how often a query's template ends with its suffix (the reference: 2; Moondream 3: 1)
    # tokens masked in every decode step after the first: the Moondream 2 reference masks answer_id; Moondream 3 none
    decode_banned: tuple[int, ...] = (3,)

    @property
    def prefix_len(self) -> int:
        """Positions of an image prefix: BOS + one per patch of the pooled grid; they attend to each other."""
        return 1 + self.vision.grid ** 2


def param_shapes(cfg: MoondreamConfig) -> Params:
    t, v, r = cfg.text, cfg.vision, cfg.region
    L, D, F, V = t.n_layers, t.dim, t.ff_dim, t.vocab_size
    Lv, E, Fv, P = v.n_layers, v.enc_dim, v.ff_dim, v.proj_inner_dim
    attention = {"ln_w": (L, D), "ln_b": (L, D), "wqkv": (L, D, 3 * D), "bqkv": (L, 3 * D), "wo": (L, D, D),
                 "bo": (L, D)}
    if t.tau:
        H = t.n_heads
        attention.update(tau_wq=(L, 3 * D, H), tau_wv=(L, 3 * D, H), tau_alpha=(L, H))
    Ld = t.n_dense
    dense = {"fc1": (Ld, D, F), "b1": (Ld, F), "fc2": (Ld, F, D), "b2": (Ld, D)}
    text = {"embed": (V, D), "post_ln_w": (D,), "post_ln_b": (D,), "lm_head": (D, V), "lm_head_b": (V,)}
    if t.n_experts:
        Lm, X, Fe = L - Ld, t.n_experts, t.expert_dim
        text.update(layers=attention, dense=dense,
                    moe={"router": (Lm, D, X), "router_b": (Lm, X), "w_gate": (Lm, X, Fe, D), "w_up": (Lm, X, Fe, D),
                         "w_down": (Lm, X, D, Fe)})
    else:
        text["layers"] = {**attention, **dense}
    vision = {
        "patch_w": (v.patch_dim, E), "patch_b": (E,), "pos": (v.grid ** 2, E),
        "layers": {"ln1_w": (Lv, E), "ln1_b": (Lv, E), "wqkv": (Lv, E, 3 * E), "bqkv": (Lv, 3 * E),
                   "wo": (Lv, E, E), "bo": (Lv, E), "ln2_w": (Lv, E), "ln2_b": (Lv, E), "fc1": (Lv, E, Fv),
                   "b1": (Lv, Fv), "fc2": (Lv, Fv, E), "b2": (Lv, E)},
        "post_ln_w": (E,), "post_ln_b": (E,),
        "proj_fc1": (2 * E, P), "proj_b1": (P,), "proj_fc2": (P, D), "proj_b2": (D,),
    }
    region = {
        "coord_features": (1, r.coord_feat_dim // 2), "size_features": (2, r.size_feat_dim // 2),
        "coord_enc_w": (r.coord_feat_dim, D), "coord_enc_b": (D,),
        "size_enc_w": (r.size_feat_dim, D), "size_enc_b": (D,),
    }
    if r.linear_decoders:
        region.update(ln_w=(D,), ln_b=(D,), coord_dec_w=(D, r.coord_out_dim), coord_dec_b=(r.coord_out_dim,),
                      size_dec_w=(D, r.size_out_dim), size_dec_b=(r.size_out_dim,))
    else:
        region.update(coord_dec_fc1=(D, r.inner_dim), coord_dec_b1=(r.inner_dim,),
                      coord_dec_fc2=(r.inner_dim, r.coord_out_dim), coord_dec_b2=(r.coord_out_dim,),
                      size_dec_fc1=(D, r.inner_dim), size_dec_b1=(r.inner_dim,),
                      size_dec_fc2=(r.inner_dim, r.size_out_dim), size_dec_b2=(r.size_out_dim,))
    return {"text": text, "vision": vision, "region": region}


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with statistics in float32, rounded back to x.dtype."""
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mu).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def affine(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """x @ w + b, accumulated in float32, rounded back to x.dtype."""
    return (jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def mlp(x: jax.Array, w1, b1, w2, b2) -> jax.Array:
    h = jax.nn.gelu(affine(x, w1, b1).astype(jnp.float32), approximate=True).astype(x.dtype)
    return affine(h, w2, b2)


def rope(x: jax.Array, positions: jax.Array, cfg: TextConfig) -> jax.Array:
    """RoPE on the first rot_dim dims of each head, halves rotated against each other (the reference's non-interleaved
    form); the rotated dims come out as [real | imaginary] halves where the reference interleaves them, the same
    permutation for q and k, so every q.k product is the same. x [N, H, hd], positions [N]."""
    rd = cfg.rot_dim
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, rd, 2, dtype=np.float32)[: rd // 2] / np.float32(rd)))
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv, jnp.float32)[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    xr, xi, rest = x[..., : rd // 2], x[..., rd // 2: rd], x[..., rd:]
    xr32, xi32 = xr.astype(jnp.float32), xi.astype(jnp.float32)
    out_r, out_i = xr32 * cos - xi32 * sin, xr32 * sin + xi32 * cos
    return jnp.concatenate([out_r.astype(x.dtype), out_i.astype(x.dtype), rest], axis=-1)


def embed_tokens(params: Params, tokens: jax.Array) -> jax.Array:
    return params["text"]["embed"][tokens]


def serving_layout(params: Params) -> Params:
    """The layout the engine serves on the GPU (models/llama.py `unstack_layers` explains why): the text layers'
    matrices as a tuple of per-layer dicts, the two products of the block's one LayerNorm output fused into one
    (Moondream 2), `wqkv_fc1` = [wqkv | fc1] (one weight read, one kernel; left apart, XLA merges the two dots by
    concatenating the weights on every step), their vectors (norms, biases; `bqkv_b1` likewise) kept as [L, X] stacks
    in `params["text"]["layer_vectors"]` (fewer arguments per step; Moondream 3's dense MLPs' in "dense_vectors"), the
    experts as per-layer dicts; the vision layers as a tuple of per-layer dicts (a scan over stacked layers copies each
    layer's weights out of the stack). Already serving params come back unchanged."""
    text, vision = params["text"], params["vision"]
    if isinstance(text["layers"], tuple):
        return params
    stacks = dict(text["layers"])
    if "fc1" in stacks:
        stacks["wqkv_fc1"] = _concat_last(stacks.pop("wqkv"), stacks.pop("fc1"))
        stacks["bqkv_b1"] = _concat_last(stacks.pop("bqkv"), stacks.pop("b1"))
    matrices = {k: a for k, a in stacks.items() if a.ndim == 3}
    vectors = {k: a for k, a in stacks.items() if a.ndim == 2}
    text = {**text, "layers": _per_layer(matrices), "layer_vectors": vectors}
    if "dense" in text:
        dense = text["dense"]
        text["dense"] = _per_layer({k: a for k, a in dense.items() if a.ndim == 3})
        text["dense_vectors"] = {k: a for k, a in dense.items() if a.ndim == 2}
        text["moe"] = _per_layer(text["moe"])
    return {**params, "text": text, "vision": {**vision, "layers": _per_layer(vision["layers"])}}


def _per_layer(stacks: dict) -> tuple[dict, ...]:
    n = next(iter(stacks.values())).shape[0]
    split = {k: (list(a) if isinstance(a, np.ndarray) else _split_leading(a)) for k, a in stacks.items()}
    return tuple({k: split[k][i] for k in stacks} for i in range(n))


def _concat_last(a, b):
    return np.concatenate([a, b], axis=-1) if isinstance(a, np.ndarray) else _concat_jit(a, b)


@jax.jit
def _concat_jit(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.concatenate([a, b], axis=-1)


@jax.jit
def _split_leading(a: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(a[i] for i in range(a.shape[0]))


def text_forward(params: Params, cfg: MoondreamConfig, tokens: jax.Array, positions: jax.Array, kv: Any, attend,
                 embeds: jax.Array | None = None, use_embeds: jax.Array | None = None, matmul=None,
                 moe_backend: str = "expert_centric"):
    """The decoder over a flat batch of N tokens (the engine's `forward`): returns (hidden [N, D] before the final
    LayerNorm, kv). embeds [N, D] with use_embeds [N] bool: those positions take the given embedding (image features)
    instead of their token's. `attend(q, k, v, kv, layer)` as in models/protocol.py. `matmul`: the weight products'
    hook (models/matmul.py; None: plain XLA dots); moe_backend: how MoE layers run (models/moe.py; the default is
    plain JAX). Stacked layers run in a `lax.scan` (Moondream 3: one over the dense layers, one over the MoE layers),
    per-layer ones (`serving_layout`) unrolled."""
    t = cfg.text
    H, hd, ms = t.n_heads, t.head_dim, t.n_dense
    mm = matmul or PlainMatmul()
    x = embed_tokens(params, tokens)
    if embeds is not None:
        x = jnp.where(use_embeds[:, None], embeds.astype(x.dtype), x)

    def linear(v, lp, vec, stacks, index, key, bias):
        """lp[key]: the matrix (for XLA dots); stacks[key][index]: the same as a stack + index (for kernels)."""
        return (mm(v, lp[key], stacks[key], index).astype(jnp.float32) + vec[bias].astype(jnp.float32)).astype(v.dtype)

    def dense_mlp(lp, vec, stacks, index):
        def run(h, f):
            if f is None:
                f = linear(h, lp, vec, stacks, index, "fc1", "b1")
            f = jax.nn.gelu(f.astype(jnp.float32), approximate=True).astype(h.dtype)
            return linear(f, lp, vec, stacks, index, "fc2", "b2")
        return run

    def experts(mp, index):
        return lambda h, f: moe.moe_ffn(h, mp, index, t.experts_per_token, True, moe_backend, "gelu_plus1")

    def layer(x, kv, lp, vec, stacks, index, i, mlp):
        """One block: lp / vec / stacks / index its attention's weights as `linear` takes them, i its index in the
        KV cache, mlp(h, f) its MLP (f: fc1's product when it came fused with qkv's)."""
        h = layer_norm(x, vec["ln_w"], vec["ln_b"], t.ln_eps)
        f = None
        if "wqkv_fc1" in lp:  # (serving_layout, Moondream 2) one product for both branches
            qkv, f = jnp.split(linear(h, lp, vec, stacks, index, "wqkv_fc1", "bqkv_b1"), [3 * t.dim], axis=-1)
        else:
            qkv = linear(h, lp, vec, stacks, index, "wqkv", "bqkv")
        q, k, v = (a.reshape(-1, H, hd) for a in jnp.split(qkv, 3, axis=-1))
        if t.tau:
            q, v = tau_scale(qkv, q, v, lp["tau_wq"], lp["tau_wv"], vec["tau_alpha"], positions)
        o, kv = attend(rope(q, positions, t), rope(k, positions, t), v, kv, i)
        a = linear(o.reshape(-1, t.dim), lp, vec, stacks, index, "wo", "bo")
        return x + a + mlp(h, f), kv

    text = params["text"]
    layers = text["layers"]
    if isinstance(layers, tuple):  # unrolled: the layer index a Python int (no loop control between layers)
        vectors = text["layer_vectors"]
        for i, lp in enumerate(layers):
            vec = {k: a[i] for k, a in vectors.items()}
            one = {k: a[None] for k, a in lp.items()}
            if not t.n_experts:
                mlp = dense_mlp(lp, vec, one, 0)
            elif i < ms:
                dl = text["dense"][i]
                mlp = dense_mlp(dl, {k: a[i] for k, a in text["dense_vectors"].items()}, {k: a[None] for k, a in
                                                                                          dl.items()}, 0)
            else:  # the kernels take a stack and an index: this layer's experts as a stack of one
                mlp = experts(jax.tree_util.tree_map(lambda a: a[None], text["moe"][i - ms]), 0)
            x, kv = layer(x, kv, lp, vec, one, 0, i, mlp)
        return x, kv

    def scan(x, kv, attn, first, mlp_of):
        """The layers first, first + 1, ... (as many as attn's stacks hold) in one lax.scan."""
        n = next(iter(attn.values())).shape[0]

        def body(carry, xs):
            x, kv = carry
            w, j = xs
            return layer(x, kv, w, w, attn, j, first + j, mlp_of(w, j)), None

        (x, kv), _ = jax.lax.scan(body, (x, kv), (attn, jnp.arange(n)))
        return x, kv

    if not t.n_experts:
        return scan(x, kv, layers, 0, lambda w, j: dense_mlp(w, w, layers, j))
    head = jax.tree_util.tree_map(lambda a: a[:ms], layers)
    rest = jax.tree_util.tree_map(lambda a: a[ms:], layers)
    dense = text["dense"]
    x, kv = scan(x, kv, {**head, **dense}, 0, lambda w, j: dense_mlp(w, w, dense, j))
    return scan(x, kv, rest, ms, lambda w, j: experts(text["moe"], j))


def tau_scale(qkv: jax.Array, q: jax.Array, v: jax.Array, wq: jax.Array, wv: jax.Array, alpha: jax.Array,
              positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Moondream 3's per-head scaling of q and v (k unscaled), before RoPE: by tanh(GELU(qkv) @ w) (exact GELU over
    the whole qkv row) plus 1 + sigmoid(alpha * ln(position + 1)) - 1/2. qkv [N, 3D], q / v [N, H, hd]."""
    feat = jax.nn.gelu(qkv.astype(jnp.float32), approximate=False)
    tok_q = jnp.tanh(jnp.dot(feat, wq.astype(jnp.float32)))
    tok_v = jnp.tanh(jnp.dot(feat, wv.astype(jnp.float32)))
    pos = jnp.log(positions.astype(jnp.float32) + 1.0)[:, None]
    tau_pos = 0.5 + jax.nn.sigmoid(alpha.astype(jnp.float32)[None, :] * pos)
    return ((q.astype(jnp.float32) * (tok_q + tau_pos)[..., None]).astype(q.dtype),
            (v.astype(jnp.float32) * (tok_v + tau_pos)[..., None]).astype(v.dtype))


def text_logits(params: Params, cfg: MoondreamConfig, hidden: jax.Array) -> jax.Array:
    p = params["text"]
    h = layer_norm(hidden, p["post_ln_w"], p["post_ln_b"], cfg.text.ln_eps)
    return affine(h, p["lm_head"], p["lm_head_b"]).astype(jnp.float32)


def dense_attend(prefix_len: int):
    """A reference `attend` over a contiguous KV cache (tests, `generate_reference`): kv = (k [L, S, H, hd],
    v [L, S, H, hd], positions of the current tokens [N]) where the current tokens are written at their positions;
    a key is visible iff k_pos <= max(q_pos, prefix_len - 1) and k_pos was written (k_pos <= max position so far)."""

    def attend(q, k, v, kv, layer):
        kc, vc, pos, seen = kv
        kc = kc.at[layer, pos].set(k.astype(kc.dtype))
        vc = vc.at[layer, pos].set(v.astype(vc.dtype))
        S = kc.shape[1]
        k_pos = jnp.arange(S)
        limit = jnp.maximum(pos, prefix_len - 1) if prefix_len else pos
        visible = (k_pos[None, :] <= limit[:, None]) & (k_pos[None, :] < seen)
        s = jnp.einsum("nhd,shd->hns", q.astype(jnp.float32), kc[layer].astype(jnp.float32)) * (q.shape[-1] ** -0.5)
        s = jnp.where(visible[None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("hns,shd->nhd", p, vc[layer].astype(jnp.float32)).astype(q.dtype)
        return o, (kc, vc, pos, seen)

    return attend


def generate_reference(params: Params, cfg: MoondreamConfig, prompt: list[int], image_embeds=None,
                       max_tokens: int = 32, stop: int | None = None) -> list[int]:
    """Greedy decoding the plain way (one contiguous cache, no engine): the reference the engine is tested against.
    image_embeds [729, D] or None: the prompt is then BOS + image + `prompt` with the bidirectional prefix; else
    `prompt` alone, causal. Stops at `stop` (default eos) or max_tokens; `cfg.decode_banned` are masked in every
    decode step after the first, as the reference does."""
    t = cfg.text
    stop = cfg.eos_id if stop is None else stop
    banned = jnp.asarray(cfg.decode_banned, jnp.int32)
    S = t.max_context
    dtype = params["text"]["embed"].dtype
    kc = jnp.zeros((t.n_layers, S, t.n_heads, t.head_dim), dtype)
    kv = (kc, kc)
    prefix_len = cfg.prefix_len if image_embeds is not None else 0
    if image_embeds is not None:
        tokens = [cfg.bos_id] + [0] * (cfg.prefix_len - 1) + list(prompt)
        embeds = jnp.concatenate([jnp.zeros((1, t.dim), dtype), jnp.asarray(image_embeds, dtype),
                                  jnp.zeros((len(prompt), t.dim), dtype)])
        use = np.zeros(len(tokens), bool)
        use[1:cfg.prefix_len] = True
    else:
        tokens, embeds, use = list(prompt), None, None
    attend = dense_attend(prefix_len)

    @jax.jit
    def step(params, tokens, positions, kv, embeds, use):
        n = positions[-1] + 1
        hidden, (k, v, _, _) = text_forward(params, cfg, tokens, positions, (*kv, positions, n), attend, embeds, use)
        return text_logits(params, cfg, hidden[-1:])[0], (k, v)

    pos = jnp.arange(len(tokens), dtype=jnp.int32)
    logits, kv = step(params, jnp.asarray(tokens, jnp.int32), pos, kv, embeds,
                      None if use is None else jnp.asarray(use))
    out, n = [], len(tokens)
    while len(out) < max_tokens:
        tok = int(jnp.argmax(logits))
        if tok == stop:
            break
        out.append(tok)
        logits, kv = step(params, jnp.asarray([tok], jnp.int32), jnp.asarray([n], jnp.int32), kv, None, None)
        logits = logits.at[banned].set(-jnp.inf)
        n += 1
    return out


# ---- the region heads (point / detect) -------------------------------------------------------------------------------
# A spatial skill decodes values, not tokens: from a hidden state (before the final LayerNorm) the coordinate head gives
# logits over `coord_out_dim` bins (value = bin / bins) and the size head two rows of `size_out_dim // 2` log-scale bins
# (value = 2 ** (bin / (bins - 1) * 10 - 10)); the value chosen is fed back as the next position's input embedding
# through the matching encoder (Fourier features, then a linear layer).

def fourier_features(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [N, k] @ w [k, F/2] as the reference computes it ((2 pi x) @ w), then [cos | sin] -> [N, F] float32."""
    f = (2 * np.float32(np.pi) * x.astype(jnp.float32)) @ w.astype(jnp.float32)
    return jnp.concatenate([jnp.cos(f), jnp.sin(f)], axis=-1)


def encode_coordinate(params: Params, coord: jax.Array) -> jax.Array:
    """coord [N] in [0, 1] -> the input embedding [N, D] of a position that holds that coordinate."""
    r = params["region"]
    return affine(fourier_features(coord[:, None], r["coord_features"]).astype(r["coord_enc_w"].dtype),
                   r["coord_enc_w"], r["coord_enc_b"])


def encode_size(params: Params, size: jax.Array) -> jax.Array:
    """size [N, 2] (width, height) -> the input embedding [N, D]."""
    r = params["region"]
    return affine(fourier_features(size, r["size_features"]).astype(r["size_enc_w"].dtype), r["size_enc_w"],
                   r["size_enc_b"])


def _decode(r: Params, hidden: jax.Array, name: str) -> jax.Array:
    """A region decoder: an MLP (Moondream 2) or, where the params have `ln_w`, a LayerNorm then one linear layer."""
    if "ln_w" in r:
        return affine(layer_norm(hidden, r["ln_w"], r["ln_b"], 1e-5), r[f"{name}_dec_w"], r[f"{name}_dec_b"])
    return mlp(hidden, r[f"{name}_dec_fc1"], r[f"{name}_dec_b1"], r[f"{name}_dec_fc2"], r[f"{name}_dec_b2"])


def coordinate_logits(params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [N, D] -> logits [N, coord_out_dim] float32."""
    return _decode(params["region"], hidden, "coord").astype(jnp.float32)


def size_logits(params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [N, D] -> logits [N, 2, size_out_dim // 2] float32 (width's bins, then height's)."""
    return _decode(params["region"], hidden, "size").astype(jnp.float32).reshape(hidden.shape[0], 2, -1)


def coordinate_of(bins: jax.Array, n_bins: int) -> jax.Array:
    """A coordinate bin's value (float32), as the reference divides its argmax by the bin count."""
    return bins.astype(jnp.float32) / np.float32(n_bins)


def size_of(bins: jax.Array, n_bins: int) -> jax.Array:
    """A size bin's value: 2 ** (bin / (n_bins - 1) * 10 - 10) in float32 (sizes 1/1024 .. 1, log-spaced)."""
    return jnp.exp2(bins.astype(jnp.float32) / np.float32(n_bins - 1) * np.float32(10.0) - np.float32(10.0))


@functools.lru_cache(maxsize=8)
def _reference_step(cfg: MoondreamConfig, prefix_len: int):
    """generate_spatial_reference's jitted forward (one per config and prefix: its calls reuse the compiled shapes):
    (tokens, positions, kv, embeds, use) -> (logits of the last position, its hidden [1, D], kv)."""
    attend = dense_attend(prefix_len)

    @jax.jit
    def step(params, tokens, positions, kv, embeds, use):
        hidden, (k, v, _, _) = text_forward(params, cfg, tokens, positions, (*kv, positions, positions[-1] + 1),
                                            attend, embeds, use)
        return text_logits(params, cfg, hidden[-1:])[0], hidden[-1:], (k, v)

    return step


def generate_spatial_reference(params: Params, cfg: MoondreamConfig, prompt: list[int], image_embeds=None,
                               include_size: bool = False, max_objects: int = 50) -> list[tuple[int, ...]]:
    """Point (include_size=False) or detect, greedily and the plain way (one contiguous cache, no engine): the
    reference the engine's spatial rows are tested against. After the prompt, while its argmax token is not eos and
    fewer than max_objects were found: x from the coordinate head on the last hidden state, fed back as an embedding;
    y likewise; for detect the size head's (w, h), fed back; the argmax token of the last position fed decides again.
    Returns one tuple of bins per object: (x, y) or (x, y, w, h)."""
    t = cfg.text
    dtype = params["text"]["embed"].dtype
    kc = jnp.zeros((t.n_layers, t.max_context, t.n_heads, t.head_dim), dtype)
    prefix_len = cfg.prefix_len if image_embeds is not None else 0
    tokens = [cfg.bos_id] + [0] * (prefix_len - 1) + list(prompt) if prefix_len else list(prompt)
    embeds = np.zeros((len(tokens), t.dim), np.float32)
    use = np.zeros(len(tokens), bool)
    if prefix_len:
        embeds[1:prefix_len] = np.asarray(image_embeds, np.float32)
        use[1:prefix_len] = True
    step = _reference_step(cfg, prefix_len)
    logits, hidden, kv = step(params, jnp.asarray(tokens, jnp.int32), jnp.arange(len(tokens), dtype=jnp.int32),
                              (kc, kc), jnp.asarray(embeds, dtype), jnp.asarray(use))
    n, out = len(tokens), []

    def feed(emb):
        nonlocal n, kv
        logits, hidden, kv = step(params, jnp.zeros(1, jnp.int32), jnp.asarray([n], jnp.int32), kv, emb.astype(dtype),
                                  jnp.ones(1, bool))
        n += 1
        return logits, hidden

    nc, ns = cfg.region.coord_out_dim, cfg.region.size_out_dim // 2
    while int(jnp.argmax(logits)) != cfg.eos_id and len(out) < max_objects:
        x = int(jnp.argmax(coordinate_logits(params, hidden)[0]))
        logits, hidden = feed(encode_coordinate(params, coordinate_of(jnp.asarray([x]), nc)))
        y = int(jnp.argmax(coordinate_logits(params, hidden)[0]))
        logits, hidden = feed(encode_coordinate(params, coordinate_of(jnp.asarray([y]), nc)))
        if include_size:
            wh = jnp.argmax(size_logits(params, hidden)[0], axis=-1)
            logits, hidden = feed(encode_size(params, size_of(wh, ns)[None]))
            out.append((x, y, int(wh[0]), int(wh[1])))
        else:
            out.append((x, y))
    return out


def engine_forward(params: Params, cfg: MoondreamConfig, tokens: jax.Array, positions: jax.Array, kv: Any, attend,
                   matmul=None, moe_backend: str = "auto"):
    """`text_forward` as the engine runs it (models/protocol.py): a negative token -(1 + i) is row i of the image
    cache `params["image_cache"]` ([slots, 729, D] flattened; written by `encode_into_cache`), so an image prefix
    rides in an ordinary prefill chunk; a spatial id (image/spatial.py: a point / detect row's decoded coordinate or
    size) is that value's region-encoder embedding."""
    img = (tokens < 0) & (tokens > -spatial.SPATIAL_BASE)
    cache = params["image_cache"].reshape(-1, cfg.text.dim)
    embeds = cache[jnp.where(img, -tokens - 1, 0)]
    use = img
    if "region" in params:  # (the text steps get the region heads too; the encoders' products cost ~nothing: no cond)
        embeds = _spatial_embeds(params, cfg, tokens, embeds)
        use = img | (tokens <= -spatial.SPATIAL_BASE)
    return text_forward(params, cfg, jnp.where(use, 0, tokens), positions, kv, attend, embeds, use, matmul,
                        moe_backend)


def _spatial_embeds(params: Params, cfg: MoondreamConfig, tokens: jax.Array, embeds: jax.Array) -> jax.Array:
    """embeds with each spatial id's position replaced by its value's embedding (coordinate or size encoder)."""
    v = -tokens
    coord = (v >= spatial.X_BASE) & (v < spatial.SIZE_BASE)
    size = v >= spatial.SIZE_BASE
    c_bin = jnp.where(v >= spatial.Y_BASE, v - spatial.Y_BASE, v - spatial.X_BASE)
    c_emb = encode_coordinate(params, coordinate_of(jnp.where(coord, c_bin, 0), cfg.region.coord_out_dim))
    wh = jnp.stack(jnp.divmod(jnp.where(size, v - spatial.SIZE_BASE, 0), spatial.SIZE_SPAN), axis=-1)
    s_emb = encode_size(params, size_of(wh, cfg.region.size_out_dim // 2))
    dtype = embeds.dtype
    return jnp.where(coord[:, None], c_emb.astype(dtype), jnp.where(size[:, None], s_emb.astype(dtype), embeds))


def spatial_tokens(params: Params, cfg: MoondreamConfig, hidden: jax.Array, logits: jax.Array, mode: jax.Array,
                   prev: jax.Array) -> jax.Array:
    """What each spatial row emits this step (image/spatial.py ids), as the reference's point / detect loop decides it
    (`generate_spatial_reference`): hidden [R, D] (before the final LayerNorm), logits [R, V] (unmasked), mode [R]
    (1 point, 2 detect), prev [R] the row's input token (the value it emitted last; a prompt's token for a prefill row).
    After a y (point) or a size (detect), or after the prompt: eos if the argmax token is eos, else the x of a new
    object; after an x: its y; after a detect's y: its (w, h)."""
    v = -prev
    after_x = (v >= spatial.X_BASE) & (v < spatial.Y_BASE)
    after_y = (v >= spatial.Y_BASE) & (v < spatial.SIZE_BASE)
    coord_bin = jnp.argmax(coordinate_logits(params, hidden), axis=-1).astype(jnp.int32)
    wh = jnp.argmax(size_logits(params, hidden), axis=-1).astype(jnp.int32)
    eos = jnp.argmax(logits, axis=-1) == cfg.eos_id
    decide = jnp.where(eos, cfg.eos_id, -(spatial.X_BASE + coord_bin))
    out = jnp.where(after_x, -(spatial.Y_BASE + coord_bin), decide)
    size_id = -(spatial.SIZE_BASE + wh[:, 0] * spatial.SIZE_SPAN + wh[:, 1])
    return jnp.where(after_y & (mode == 2), size_id, out).astype(jnp.int32)

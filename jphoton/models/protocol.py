"""The small protocol a model follows to run in the engine, so researchers can plug in their own JAX model (docs/own-model.md).

A model is a params pytree, a config (num_layers, num_kv_heads, head_dim, vocab_size, max_position_embeddings,
sliding_window, eos_token_ids: a `ModelConfig` with architecture="custom" has them) and two pure functions:

    forward(params, tokens, positions, kv, attend) -> (hidden, kv)
        tokens, positions: int32 of one shape (the engine passes a flat [N]); hidden [..., D]. Per layer i call
        `o, kv = attend(q, k, v, kv, i)` (q [..., Hq, hd], k/v [..., Hkv, hd], RoPE applied; o [..., Hq, hd]), threading kv.
    logits(params, hidden [R, D]) -> float32 logits [R, V]
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jphoton.models import llama, moe, moondream, moondream_vision, tensor_parallel
from jphoton.models import matmul as matmul_hook
from jphoton.models.config import ModelConfig


@dataclasses.dataclass
class JaxModel:
    config: ModelConfig
    params: Any
    forward: Callable
    logits: Callable
    tokenizer: Any = None
    name: str = ""
    # Fewest rows a decode step should have: the engine rounds its decode buckets up to this (padding rows are free:
    # a decode step reads every weight once whatever its row count). 2 where one-row dots would be padded inside every
    # matmul anyway (models/matmul.py): padding the step once instead saves a pad and a slice kernel per matmul.
    min_decode_rows: int = 1
    # forward takes `lora=` (models/lora.py LoraInputs): per-row LoRA adapters (LLM(max_loras=N) needs it)
    supports_lora: bool = False
    # (TensorParallel, Mesh) when forward / logits are one shard's functions (llama_family(tensor_parallel_size=N)):
    # the engine runs its step under shard_map over the mesh; params are placed on it. None: one device.
    tensor_parallel: Any = None
    # How `llama_family` built forward / logits (its keyword options), for a second process to build the same functions
    # over abstract params (engine/compile_worker.py). None: a user's JaxModel, or a tensor-parallel one.
    recipe: dict | None = None
    # An image encoder (`Vision`): the model takes images (Moondream); None: text only.
    vision: Any = None
    # Token ids a decode row never samples (their logits are -inf in every decode row; a prompt's first token, sampled
    # by its prefill row, may be one): Moondream's reference masks its answer token so in every answer step but the first.
    decode_banned_tokens: tuple[int, ...] = ()
    # Spatial skills (point / detect: image/spatial.py): spatial(params, hidden [R, D], logits [R, V], mode [R],
    # prev [R]) -> the ids the spatial rows (mode > 0) emit this step; None: the model has none.
    spatial: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Vision:
    """What the engine needs to run a model's image encoder as a step of its pipeline (engine/images.py).

    encode(params, slot, crops [C, S, S, 3] uint8, pool_rows, pool_cols [C - 1, g, g]) -> params writes one image's
    `embed_rows` embeddings into the image cache inside params (`params["image_cache"]`, [slots, embed_rows, D]),
    which forward reads for negative tokens: token -(1 + slot * embed_rows + j) is embedding j of the image in that
    slot. A prompt's image run and the tokens before it (its first `prefix_len` positions) attend to each other
    bidirectionally. C is padded to one of `crop_buckets` (padding crops have zero pooling weights)."""
    prefix_len: int
    embed_rows: int
    slots: int
    crop_buckets: tuple[int, ...]
    crop_size: int
    patch_size: int
    overlap_margin: int
    max_crops: int
    encode: Callable
    # the top-level params entries forward / logits read (the text steps get only these: each leaf passed costs
    # dispatch time, and the encoder's layers are hundreds of leaves); () = all
    text_keys: tuple[str, ...] = ()
    region_bins: tuple[int, int] = (0, 0)  # the spatial heads' (coordinate bins, size bins per dimension)
    answer_suffixes: int = 2  # how often a query's template ends with its suffix (image/skills.py)


def llama_family(config: ModelConfig, params, tokenizer=None, name: str = "", unroll_layers: bool = False,
                 moe_backend: str = "auto", matmul: str = "auto", fuse: bool = False,
                 tensor_parallel_size: int = 1) -> JaxModel:
    """The built-in families (dense Llama-likes and Qwen3-MoE); `moe_backend` picks how MoE layers run (models/moe.py).

    matmul: how the dense layers' weight matmuls and the LM head run, "xla", "xla-plain", "fused" or "auto"
    (models/matmul.py).
    fuse: put the params in the serving layout (`llama.fuse_params`: one QKV and one gate+up matrix per layer). It
    takes the unfused matrices out of `params["layers"]` as it builds the fused ones (device memory peaks at the
    weights plus one fused group); pass a copy (`{**params, "layers": dict(params["layers"])}`) to keep yours.
    tensor_parallel_size: N > 1 shards the model over the first N devices (models/tensor_parallel.py): params are placed
    on the mesh (already placed leaves stay), and forward / logits become one shard's functions, which the engine runs
    under `shard_map` (`JaxModel.tensor_parallel`); logits come out [R, V/N] per shard."""
    moe.check_backend(moe_backend)
    tp = None
    forward_cfg = config
    if tensor_parallel_size > 1:
        tensor_parallel.check(config, tensor_parallel_size)
        mesh = tensor_parallel.make_mesh(tensor_parallel_size)
        params = tensor_parallel.shard_params(config, params, mesh)
        tp = tensor_parallel.TensorParallel(tensor_parallel_size)
        forward_cfg = tensor_parallel.local_config(config, tensor_parallel_size)
    if fuse:
        params = llama.fuse_params(config, params, consume=True)
    if unroll_layers:  # one array per layer: every layer's GEMMs are one fusion to XLA (docs/step-shapes.md)
        params = llama.unstack_layers(params, consume=True)
    recipe = dict(unroll_layers=unroll_layers, moe_backend=moe_backend, matmul=matmul)
    model = rebuild(config, params, recipe, tp, forward_cfg)
    return dataclasses.replace(model, tokenizer=tokenizer, name=name or config.name,
                               tensor_parallel=(tp, mesh) if tp else None, recipe=None if tp else recipe)


def rebuild(config: ModelConfig, params, recipe: dict, tp=None, forward_cfg: ModelConfig | None = None) -> JaxModel:
    """`llama_family`'s functions over params already in the serving layout (a recipe's options; params may be
    `jax.ShapeDtypeStruct`s: engine/compile_worker.py traces the engine's steps from them)."""
    unroll_layers, moe_backend = recipe["unroll_layers"], recipe["moe_backend"]
    mm = matmul_hook.make(recipe["matmul"], reduce=tp.psum if tp else None)
    forward_cfg = forward_cfg or config

    def forward(params, tokens, positions, kv, attend, lora=None):
        return llama.forward(params, forward_cfg, tokens, positions, kv, attend, unroll=unroll_layers,
                             moe_backend=moe_backend, matmul=mm, lora=lora, tp=tp)

    def logits(params, hidden):
        return llama.lm_head(params, hidden, mm)

    # MoE layers ignore the hook, and a padding row would make a decode step read its top-k experts too
    min_rows = 1 if config.num_experts else mm.min_rows
    return JaxModel(config, params, forward, logits, name=config.name, min_decode_rows=min_rows,
                    supports_lora=not config.num_experts, recipe=dict(recipe))


def moondream_family(config: moondream.MoondreamConfig, params, tokenizer=None, name: str = "",
                     image_slots: int = 32, matmul: str = "auto", unroll_layers: bool = False,
                     vision_attention: str = "auto", moe_backend: str = "auto") -> JaxModel:
    """Moondream 2 or 3 (models/moondream.py) for the engine: its text decoder as forward / logits, its vision encoder as
    `Vision`; `image_slots` images' embeddings stay on the device (the image cache: a repeated image skips the
    encoder). matmul: the text layers' weight products (models/matmul.py; its kind or a hook); unroll_layers: the
    text layers unrolled over per-layer params (`moondream.serving_layout`); vision_attention: "xla", "cudnn" or
    "auto" (cuDNN's flash attention on a GPU with 16-bit weights, else the plain einsums); moe_backend: how Moondream
    3's MoE layers run (models/moe.py)."""
    t, v = config.text, config.vision
    moe.check_backend(moe_backend)
    dtype = params["text"]["embed"].dtype
    if vision_attention == "auto":
        on_gpu = jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2
        vision_attention = "cudnn" if on_gpu else "xla"
    if vision_attention not in ("xla", "cudnn"):
        raise ValueError(f"vision_attention must be 'auto', 'xla' or 'cudnn', got {vision_attention!r}")
    logging.getLogger("jphoton").info("Moondream vision attention: %s", vision_attention)
    params = {**params, "image_cache": jnp.zeros((image_slots, v.grid ** 2, t.dim), dtype)}
    if unroll_layers:
        params = moondream.serving_layout(params)
    mm = matmul_hook.make(matmul, dense_gemv=True)  # (its layers: plain products only, with biases)
    mc = ModelConfig(architecture="custom", vocab_size=t.vocab_size, hidden_size=t.dim, intermediate_size=t.ff_dim,
                     num_layers=t.n_layers, num_heads=t.n_heads, num_kv_heads=t.n_heads, head_dim=t.head_dim,
                     max_position_embeddings=t.max_context, bos_token_id=config.bos_id,
                     eos_token_ids=(config.eos_id,), name=name or config.name)
    buckets = tuple(sorted({b for b in (2, 5, 9, v.max_crops + 1) if b <= v.max_crops + 1}))

    def forward(params, tokens, positions, kv, attend):
        return moondream.engine_forward(params, config, tokens, positions, kv, attend, mm, moe_backend)

    def logits(params, hidden):
        return moondream.text_logits(params, config, hidden)

    def spatial(params, hidden, logits, mode, prev):
        return moondream.spatial_tokens(params, config, hidden, logits, mode, prev)

    def encode(params, slot, crops, rows, cols):
        return moondream_vision.encode_into_cache(params, config, slot, crops, rows, cols, vision_attention)

    vision = Vision(prefix_len=config.prefix_len, embed_rows=v.grid ** 2, slots=image_slots, crop_buckets=buckets,
                    crop_size=v.crop_size, patch_size=v.patch_size, overlap_margin=v.overlap_margin,
                    max_crops=v.max_crops, encode=encode, text_keys=("text", "image_cache", "region"),
                    region_bins=(config.region.coord_out_dim, config.region.size_out_dim // 2),
                    answer_suffixes=config.answer_suffixes)
    # (a padding row would make a MoE decode step read its top-k experts too)
    return JaxModel(mc, params, forward, logits, tokenizer=tokenizer, name=name or config.name, vision=vision,
                    decode_banned_tokens=config.decode_banned, min_decode_rows=1 if t.n_experts else mm.min_rows,
                    spatial=spatial)

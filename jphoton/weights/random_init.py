"""`random:NAME[:key=value...]`: random weights of a real model's shape, built on the device (no download).

Every GPU benchmark uses these: the embedded model is too large to carry to the GPU machine, and throughput does not
depend on weight values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jphoton.config import ModelConfig, RopeScaling
from jphoton.models.llama import param_shapes

_LLAMA3_SCALING = RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,), name="random:smollm2-135m"),
    "llama3.2-1b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131072, tie_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        name="random:llama3.2-1b"),
    "llama3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128009), name="random:llama3-8b"),
    # Qwen/Qwen3-30B-A3B's config.json: every layer MoE (decoder_sparse_step 1, no mlp_only_layers), 128 experts of
    # 768, top-8 renormalised; intermediate_size 6144 would only size dense layers, of which it has none.
    "qwen3-30b-a3b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_embeddings=False, qk_norm=True, bos_token_id=151643,
        eos_token_ids=(151643, 151645), num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, name="random:qwen3-30b-a3b"),
}

_OVERRIDES = {"layers": "num_layers", "vocab": "vocab_size", "context": "max_position_embeddings"}


def parse_random_spec(spec: str) -> ModelConfig:
    """`random:llama3.2-1b:layers=4:vocab=49152` -> ModelConfig."""
    parts = spec.split(":")
    if parts[0] != "random" or len(parts) < 2:
        raise ValueError(f"bad random model spec {spec!r}; expected random:NAME[:key=value...]")
    name = parts[1]
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(sorted(PRESETS))}")
    changes = {}
    for part in parts[2:]:
        key, _, value = part.partition("=")
        if key not in _OVERRIDES or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad option {part!r} in {spec!r}; options: "
                             f"{', '.join(k + '=N' for k in _OVERRIDES)} (N >= 1)")
        changes[_OVERRIDES[key]] = int(value)
    return PRESETS[name].replace(name=spec, **changes)


def random_params(cfg: ModelConfig, dtype, seed: int = 0) -> dict:
    """Normal(0, 0.02) matrices, unit norms, zero biases; each leaf is generated on the device by its own small jit so
    the peak memory stays one leaf above the weights."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, shape), key in zip(leaves, keys, strict=True):
        name = path[-1].key
        kind = "ones" if name.endswith("norm") else "zeros" if name.startswith("b") else "normal"
        out.append(_random_leaf(key, tuple(shape), jnp.dtype(dtype), kind))
    return jax.tree_util.tree_unflatten(treedef, out)


_SLICED_ABOVE = 2**30  # float32 bytes of a leaf above which it is filled in blocks of leading indices


def _random_leaf(key, shape, dtype, kind):
    """Large leaves (stacked experts: 19 GB each for Qwen3-30B-A3B) are written a block of leading indices at a time
    into one donated buffer, so building them never holds a float32 copy of the whole leaf."""
    row = 4 * math.prod(shape[1:])
    if kind != "normal" or len(shape) < 2 or row * shape[0] <= _SLICED_ABOVE:
        return _make_leaf(key, shape, dtype, kind)
    out = _make_leaf(key, shape, dtype, "zeros")
    step = max(1, _SLICED_ABOVE // row)
    for i, start in enumerate(range(0, shape[0], step)):
        out = _set_rows(out, jnp.int32(start), jax.random.fold_in(key, i), min(step, shape[0] - start))
    return out


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _set_rows(out, start, key, rows):
    part = (0.02 * jax.random.normal(key, (rows, *out.shape[1:]), jnp.float32)).astype(out.dtype)
    return jax.lax.dynamic_update_slice_in_dim(out, part, start, 0)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _make_leaf(key, shape, dtype, kind):
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

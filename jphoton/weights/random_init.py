"""`random:NAME[:key=value...]`: random weights of a real model's shape, built on the device (no download).

Every GPU benchmark uses these: the embedded model is too large to carry to the GPU machine, and throughput does not
depend on weight values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphoton.models import tensor_parallel as tp
from jphoton.models.config import ModelConfig, RopeScaling
from jphoton.models.llama import FUSIONS, param_shapes

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
    "llama3-70b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128009), name="random:llama3-70b"),
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


def random_params(cfg: ModelConfig, dtype, seed: int = 0, *, fused: bool = False, per_layer: bool = False,
                  mesh=None) -> dict:
    """Normal(0, 0.02) matrices, unit norms, zero biases, made on the device(s) a layer at a time: the peak is the
    weights plus one layer's leaf, however large the model (a Llama-3-70B shape on two 80 GB GPUs).

    The values depend only on (seed, leaf, layer): the same seed is the same model in any layout. fused, per_layer:
    build the serving layout directly (models/llama.py `fuse_params`, `unstack_layers`), which would otherwise need a
    second copy of a fused group or stack at once. mesh: build each leaf sharded for tensor parallelism
    (models/tensor_parallel.py); random bits are generated per shard (threefry is partitionable), so the values are the
    unsharded model's."""
    shapes = param_shapes(cfg)
    root = jax.random.key(seed)
    dt = jnp.dtype(dtype)
    ids: dict[tuple[str, str], int] = {}
    for group, value in shapes.items():
        for name in (value if isinstance(value, dict) else (None,)):
            ids[group, name] = len(ids)

    def leaf(group, name, shape, layer):
        key = jax.random.fold_in(root, ids[group, name])
        if layer is not None:
            key = jax.random.fold_in(key, layer)
        kind = "ones" if (name or group).endswith("norm") else "zeros" if (name or "").startswith("b") else "normal"
        if mesh is None:
            return _make_leaf(key, shape, dt, kind, None)
        g, n = (group, name) if name is not None else ("", group)
        axis, columns = tp.leaf_rule(g, n)
        if tp.column_order(cfg, mesh.size, columns) is not None:  # replicated KV heads: made whole, then reordered
            return tp.place(cfg, mesh, g, n, _make_leaf(key, shape, dt, kind, None))
        return _make_leaf(key, shape, dt, kind, NamedSharding(mesh, tp.spec(len(shape), axis)))

    def layer_leaf(group, name, shape, layer):
        parts = FUSIONS.get(name) if fused and group == "layers" else None
        if parts is None:
            return leaf(group, name, shape, layer)
        arrays = [leaf(group, p, shapes[group][p][1:], layer) for p in parts]
        return tp.concat_shards(arrays) if mesh is not None else jnp.concatenate(arrays, axis=-1)

    out: dict = {}
    for group, value in shapes.items():
        if not isinstance(value, dict):
            out[group] = leaf(group, None, tuple(value), None)
            continue
        names = dict(value)
        if fused and group == "layers":
            for f, parts in FUSIONS.items():
                if all(p in names for p in parts):
                    width = sum(names[p][-1] for p in parts)
                    names[f] = (*names[parts[0]][:-1], width)
                    for p in parts:
                        del names[p]
        L = next(iter(names.values()))[0]
        stack_names = names
        if per_layer:  # matrices one array per layer; the layers' vectors stay stacked (llama.unstack_layers)
            stack_names = {n: s for n, s in names.items() if group == "layers" and len(s) == 2}
            out[group] = tuple({n: layer_leaf(group, n, tuple(s[1:]), i) for n, s in names.items()
                                if n not in stack_names} for i in range(L))
            if not stack_names:
                continue
        stacked = {}
        for n, s in stack_names.items():
            buf = None
            for i in range(L):
                part = layer_leaf(group, n, tuple(s[1:]), i)
                if buf is None:
                    buf = _stack_buffer(part, L)
                buf = _set_layer(buf, jnp.int32(i), part)
            stacked[n] = buf
        out["layer_vectors" if per_layer else group] = stacked
    return out


def _stack_buffer(part: jax.Array, layers: int) -> jax.Array:
    """Zeros [layers, *part.shape], sharded as the layer `part` is (on its leading axis: not at all)."""
    sharding = part.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec, *([None] * (part.ndim - len(sharding.spec)))))
    return tp.zeros((layers, *part.shape), part.dtype, sharding)


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_layer(buf, i, part):
    return jax.lax.dynamic_update_index_in_dim(buf, part.astype(buf.dtype), i, 0)


@functools.cache
def _leaf_fn(shape, dtype, kind, sharding):
    def make(key):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


def _make_leaf(key, shape, dtype, kind, sharding):
    return _leaf_fn(tuple(shape), dtype, kind, sharding)(key)

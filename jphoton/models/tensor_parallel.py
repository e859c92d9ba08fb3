"""Tensor parallelism over `jax.sharding`: one host process drives N local devices.

Megatron's layout, with the model code run per shard under `jax.shard_map` (the Pallas kernels see their shard's
arrays as they would a smaller model's): column-parallel wqkv and w_gate_up (a fused matrix is the concatenation of
each part's shard), row-parallel wo and w_down (one all-reduce per sublayer in the activation dtype,
`TensorParallel.psum`), KV heads with the q heads that read them (replicated with fewer KV heads than shards), the
vocabulary sharded (logits stay sharded), MoE split inside every expert. Leaf rules go by parameter name (models/llama.py
`param_shapes`), so they serve both layouts, stacked or per-layer; a leaf whose columns must be reordered first is
permuted before it is placed (`place`). Layout and why: docs/tensor-parallel.md, "Layout".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphoton.models.config import ModelConfig

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The per-shard view the model code runs under (inside `shard_map` over `axis`)."""

    size: int
    axis: str = AXIS

    def psum(self, x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, self.axis)

    def index(self) -> jax.Array:
        return jax.lax.axis_index(self.axis)

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """Vocabulary-parallel lookup: this shard's rows [V/N, D] answer its tokens, the others give zeros, one
        all-reduce adds them (exact: one non-zero term per element)."""
        rows = table.shape[0]
        local = tokens - self.index() * rows
        mine = (local >= 0) & (local < rows)
        x = jnp.where(mine[..., None], table[jnp.clip(local, 0, rows - 1)], 0)
        return self.psum(x)

    def gather_vocab(self, logits: jax.Array) -> jax.Array:
        """[R, V/N] per shard -> [R, V] on every shard (the filtered and second samplers' inputs)."""
        return jax.lax.all_gather(logits, self.axis, axis=logits.ndim - 1, tiled=True)


def check(cfg: ModelConfig, n: int) -> None:
    """ValueError unless the model shards n ways."""
    if n == 1:
        return
    problems = []
    if cfg.num_heads % n:
        problems.append(f"num_heads {cfg.num_heads}")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        problems.append(f"num_kv_heads {cfg.num_kv_heads} (nor is {n} a multiple of it)")
    if cfg.dense_layers and cfg.intermediate_size % n:
        problems.append(f"intermediate_size {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % n:
        problems.append(f"moe_intermediate_size {cfg.moe_intermediate_size}")
    if cfg.vocab_size % n:
        problems.append(f"vocab_size {cfg.vocab_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={n} does not divide this model's {', '.join(problems)}")


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config one shard's code runs with: its heads, its slice of the MLPs and of the vocabulary."""
    if n == 1:
        return cfg
    return cfg.replace(num_heads=cfg.num_heads // n, num_kv_heads=max(cfg.num_kv_heads // n, 1),
                       intermediate_size=cfg.intermediate_size // n,
                       moe_intermediate_size=cfg.moe_intermediate_size // n, vocab_size=cfg.vocab_size // n)


def kv_heads(cfg: ModelConfig, n: int) -> int:
    """KV heads of the paged pool across all shards (more than the model's when they are replicated)."""
    return max(cfg.num_kv_heads, n)


def make_mesh(n: int) -> Mesh:
    devices = jax.devices()
    if n > len(devices):
        hint = " (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)" if devices[0].platform == "cpu" else ""
        raise ValueError(f"tensor_parallel_size={n} but only {len(devices)} {devices[0].platform} device(s) are "
                         f"visible{hint}")
    return Mesh(np.array(devices[:n]), (AXIS,))


# ---- which axis of each leaf is sharded, and how its columns are reordered first ---------------------------------
_COLUMNS = {"wq": None, "bq": None, "wk": "kv", "wv": "kv", "bk": "kv", "bv": "kv", "wqkv": "qkv", "bqkv": "qkv",
            "w_gate": None, "w_up": None, "w_gate_up": "gate_up", "lm_head": None}
_ROWS = {"wo", "w_down", "embed"}


def leaf_rule(group: str, name: str) -> tuple[int | None, str | None]:
    """(sharded axis counted from the end, or None: replicated; column reordering) for a leaf of `group`."""
    if group == "moe":  # [.., E, F, D] gate/up and [.., E, D, F] down: F is sharded; the router is replicated
        return {"w_gate": (-2, None), "w_up": (-2, None), "w_down": (-1, None)}.get(name, (None, None))
    if name in _COLUMNS:
        return -1, _COLUMNS[name]
    if name in _ROWS:
        return -2, None
    return None, None


def spec(ndim: int, axis: int | None) -> P:
    if axis is None:
        return P()
    parts = [None] * ndim
    parts[ndim + axis] = AXIS
    return P(*parts)


def _path_names(path) -> tuple[str, str]:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return (keys[0] if len(keys) > 1 else ""), keys[-1]


def param_specs(params) -> object:
    """PartitionSpecs for a params pytree (any layout: stacked or per-layer, fused or not)."""
    def one(path, a):
        group, name = _path_names(path)
        return spec(a.ndim, leaf_rule(group, name)[0])

    return jax.tree_util.tree_map_with_path(one, params)


def column_order(cfg: ModelConfig, n: int, kind: str | None) -> np.ndarray | None:
    """Column indices that put a column-parallel leaf in shard order (shard s's columns contiguous), or None where
    the order already is (each part's heads, or the MLP's F, split into n contiguous slices)."""
    hd, Hkv = cfg.head_dim, cfg.num_kv_heads
    replicated = n > Hkv

    def kv_cols(s):  # the KV head columns shard s holds
        if replicated:
            h = s // (n // Hkv)
            return np.arange(h * hd, (h + 1) * hd)
        per = Hkv // n * hd
        return np.arange(s * per, (s + 1) * per)

    if kind == "kv":
        return np.concatenate([kv_cols(s) for s in range(n)]) if replicated else None
    if kind == "qkv":
        q, kv = cfg.q_size, cfg.kv_size
        ql = q // n
        return np.concatenate([np.concatenate([np.arange(s * ql, (s + 1) * ql), q + kv_cols(s), q + kv + kv_cols(s)])
                               for s in range(n)])
    if kind == "gate_up":
        F = cfg.intermediate_size
        fl = F // n
        return np.concatenate([np.concatenate([np.arange(s * fl, (s + 1) * fl), F + np.arange(s * fl, (s + 1) * fl)])
                               for s in range(n)])
    return None


def place(cfg: ModelConfig, mesh: Mesh, group: str, name: str, a) -> jax.Array:
    """One leaf (host or device array) put on the mesh with its sharding, its columns reordered first if its rule says
    so. A fused wqkv / w_gate_up is taken to be in the unsharded model's [q | k | v] / [gate | up] order (a host-side
    fuse); a device array already placed on the mesh is returned as it is (`concat_shards` builds fused matrices in
    shard order)."""
    axis, kind = leaf_rule(group, name)
    sharding = NamedSharding(mesh, spec(a.ndim, axis))
    if isinstance(a, jax.Array) and a.sharding.is_equivalent_to(sharding, a.ndim):
        return a
    if axis is not None and (order := column_order(cfg, mesh.size, kind)) is not None:
        a = np.take(a, order, axis=-1) if isinstance(a, np.ndarray) else _take_columns(a, order)
    return jax.device_put(a, sharding)


@jax.jit
def _take_columns(a, order):
    return jnp.take(a, order, axis=-1)


def shard_params(cfg: ModelConfig, params, mesh: Mesh):
    """Every leaf of a params pytree `place`d on the mesh (leaves already placed stay as they are). Fused matrices must
    be in the unsharded order ([q | k | v]): shard before fusing (`llama.fuse_params` then concatenates shard-wise)."""
    def one(path, a):
        group, name = _path_names(path)
        return place(cfg, mesh, group, name, a)

    return jax.tree_util.tree_map_with_path(one, params)


def zeros(shape: tuple, dtype, sharding) -> jax.Array:
    """Zeros made where `sharding` places them (each shard on its device; nothing built on the host first), by one
    cached program per (shape, dtype, sharding): engine buffers and stacked random layers compile it once."""
    return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.cache
def _zeros_fn(shape: tuple, dtype, sharding):
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def is_sharded(a) -> bool:
    """A device array split over a mesh of more than one device."""
    return (isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and a.sharding.mesh.size > 1
            and any(p is not None for p in a.sharding.spec))


def concat_shards(arrays: list[jax.Array]) -> jax.Array:
    """Concatenate arrays sharded on their last axis shard by shard: shard s of the result is [a_s | b_s | ...], the
    fused layout of column-parallel parts (module docstring). No communication."""
    sharding = arrays[0].sharding
    return _concat_fn(sharding.mesh, sharding.spec, len(arrays))(*arrays)


@functools.cache
def _concat_fn(mesh: Mesh, spec_: P, count: int):
    body = jax.shard_map(lambda *xs: jnp.concatenate(xs, axis=-1), mesh=mesh, in_specs=(spec_,) * count,
                         out_specs=spec_)
    return jax.jit(body)

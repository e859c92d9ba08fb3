"""Multi-LoRA for the dense Llama family: every row of a step may use a different adapter (or none), in one program.

A fixed number of adapter slots (`max_loras`) of rank up to R, in four target groups (qkv, o, gate_up, down: one per
input the layer multiplies). A step adds `((x @ A) where onehot) @ B` to each group's product: two dense GEMMs over
every slot, so each adapter is read once a step and the slot is data (loads never recompile). Each group's A lives in
its base weight as extra columns (`INLINE`, `extend_params`), which the base program never reads. The mask selects, so
a row without an adapter gets exactly 0 and another slot's NaN never reaches it. `delta_reference` is the per-row
oracle. Pure functions here; slot bookkeeping: engine/loras.py; PEFT files: jphoton/weights/peft.py.
Layout: docs/models.md, "LoRA layout"; numbers: docs/decisions.md, "Multi-LoRA".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.models.config import ModelConfig

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGETS = tuple(t for targets in GROUPS.values() for t in targets)
INLINE = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}  # each group's A rides in this weight


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every LoRA target module of a dense Llama-family layer."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (D, cfg.q_size), "k_proj": (D, cfg.kv_size), "v_proj": (D, cfg.kv_size),
            "o_proj": (cfg.q_size, D), "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


def group_shapes(cfg: ModelConfig, num_slots: int, rank: int) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Per group: (A shape, B shape) of one layer."""
    dims = target_dims(cfg)
    out = {}
    for g, targets in GROUPS.items():
        cols = num_slots * len(targets) * rank
        out[g] = ((dims[targets[0]][0], cols), (cols, sum(dims[t][1] for t in targets)))
    return out


class LoraInputs(NamedTuple):
    """What a LoRA step hands the model: the slot weights (per-layer tuple, or stacked [L, ...], like the params'
    `layers`) and each token's slot (int32, -1 = none)."""

    weights: Any
    token_slots: jax.Array
    rank: int


def init_weights(cfg: ModelConfig, num_slots: int, rank: int, dtype, per_layer: bool) -> Any:
    """All-zero slot weights (no adapter loaded) as numpy arrays; per_layer: a tuple of per-layer dicts (the unrolled
    layer loop's layout, llama.unstack_layers), else one dict of [L, ...] stacks. Each group: (A, B), A None for the
    `INLINE` groups (their A lives in the params, `extend_params`)."""
    shapes = group_shapes(cfg, num_slots, rank)
    L = cfg.num_layers

    def zeros(shape, group, is_a):
        return None if is_a and group in INLINE else np.zeros(shape, dtype)

    if per_layer:
        return tuple({g: (zeros(a, g, True), zeros(b, g, False)) for g, (a, b) in shapes.items()} for _ in range(L))
    return {g: (zeros((L, *a), g, True), zeros((L, *b), g, False)) for g, (a, b) in shapes.items()}


def base_columns(cfg: ModelConfig) -> dict[str, int]:
    """Columns of each `INLINE` weight before the LoRA columns start."""
    return {"wqkv": cfg.q_size + 2 * cfg.kv_size, "wo": cfg.hidden_size, "w_gate_up": 2 * cfg.intermediate_size,
            "w_down": cfg.hidden_size}


def extend_params(cfg: ModelConfig, params: dict, num_slots: int, rank: int) -> None:
    """Append each `INLINE` group's zero A columns to the serving layout's wqkv and w_gate_up, in place (each old
    matrix is dropped as its extended copy replaces it: the peak is the weights plus one matrix). ValueError unless
    the params are in the fused serving layout."""
    layers = params["layers"]
    per_layer = layers if isinstance(layers, (tuple, list)) else [layers]
    for lp in per_layer:
        for group, key in INLINE.items():
            if key not in lp:
                raise ValueError("LoRA needs the params in the fused serving layout (llama_family(fuse=True))")
            w = lp[key]
            cols = num_slots * len(GROUPS[group]) * rank
            if isinstance(w, np.ndarray):
                lp[key] = np.concatenate([w, np.zeros((*w.shape[:-1], cols), w.dtype)], axis=-1)
            else:
                lp[key] = jnp.concatenate([w, jnp.zeros((*w.shape[:-1], cols), w.dtype)], axis=-1)
            del w


def slot_blocks(cfg: ModelConfig, adapter, rank: int) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """One adapter's share of every layer, in float32: per layer and group, A [in, n*rank] and B [n*rank, out] (scaling
    folded into B, absent targets zero, lower ranks zero-padded). adapter: weights/peft.py `PeftAdapter` (None: zeros)."""
    dims = target_dims(cfg)
    layers = []
    for layer in range(cfg.num_layers):
        groups = {}
        for g, targets in GROUPS.items():
            n = len(targets)
            a = np.zeros((dims[targets[0]][0], n * rank), np.float32)
            b = np.zeros((n * rank, sum(dims[t][1] for t in targets)), np.float32)
            col = 0
            for t_i, t in enumerate(targets):
                pair = adapter.weights.get((layer, t)) if adapter is not None else None
                if pair is not None:
                    la, lb = pair  # PEFT layout: lora_A [r, in], lora_B [out, r]
                    r = la.shape[0]
                    a[:, t_i * rank:t_i * rank + r] = la.T
                    b[t_i * rank:t_i * rank + r, col:col + dims[t][1]] = lb.T * adapter.scaling
                col += dims[t][1]
            groups[g] = (a, b)
        layers.append(groups)
    return layers


def write_slot(weights: Any, slot: jax.Array, blocks: Any) -> Any:
    """`weights` with slot `slot` (a traced int: one program for every slot) replaced by `blocks` (`slot_blocks`, in the
    same per-layer or stacked form as `weights`, cast to its dtype). Jitted with `weights` donated: in place."""

    def put(w, block, axis):
        start = [0] * w.ndim
        start[axis] = slot * block.shape[axis]
        return jax.lax.dynamic_update_slice(w, block.astype(w.dtype), start)

    def put_a(w, block, axis):
        return None if w is None else put(w, block, axis)

    if isinstance(weights, (tuple, list)):
        return tuple({g: (put_a(lw[g][0], lb[g][0], 1), put(lw[g][1], lb[g][1], 0)) for g in lw}
                     for lw, lb in zip(weights, blocks, strict=True))
    return {g: (put_a(weights[g][0], blocks[g][0], 2), put(weights[g][1], blocks[g][1], 1)) for g in weights}


def write_inline(params: dict, slot: jax.Array, blocks: Any, base: dict[str, int]) -> dict:
    """`params` with slot `slot`'s A columns of the `INLINE` groups replaced (they start at base[key] + slot * width
    in wqkv / w_gate_up). Jitted with `params` donated: in place; every other leaf passes through untouched."""

    def put(lp, lb):
        lp = dict(lp)
        for group, key in INLINE.items():
            w, block = lp[key], lb[group][0]
            start = [0] * w.ndim
            start[-1] = base[key] + slot * block.shape[-1]
            lp[key] = jax.lax.dynamic_update_slice(w, block.astype(w.dtype), start)
        return lp

    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return {**params, "layers": tuple(put(lp, lb) for lp, lb in zip(layers, blocks, strict=True))}
    return {**params, "layers": put(layers, blocks)}


def stack_blocks(blocks: list[dict]) -> dict:
    """Per-layer `slot_blocks` -> one [L, ...] stack per group (the stacked layout's form)."""
    return {g: (np.stack([lb[g][0] for lb in blocks]), np.stack([lb[g][1] for lb in blocks])) for g in blocks[0]}


def layer_weights(weights: Any, i) -> dict:
    """Layer i's groups from either layout (i a Python int, or a traced index for a stack)."""
    if isinstance(weights, (tuple, list)):
        return weights[i]
    return jax.tree.map(lambda a: a[i], weights)


def slot_mask(token_slots: jax.Array, columns: int, width: int, dtype) -> jax.Array:
    """The [N, columns] row-to-slot mask that keeps each row's own adapter columns (column c belongs to slot
    c // width; slot -1, no adapter, keeps none)."""
    owner = jnp.arange(columns, dtype=jnp.int32) // width
    return (token_slots.reshape(-1)[:, None] == owner[None, :]).astype(dtype)


def group_width(group: str, rank: int) -> int:
    """Columns of one slot in a group's A."""
    return len(GROUPS[group]) * rank


def delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """The group's LoRA update for rows x [..., in]: ((x @ A) where mask) @ B (`expand`), [..., out]."""
    shrunk = jnp.dot(x.reshape(-1, x.shape[-1]), a, preferred_element_type=jnp.float32)
    return expand(shrunk, b, mask, x.dtype).reshape(*x.shape[:-1], b.shape[-1])


def expand(shrunk: jax.Array, b: jax.Array, mask: jax.Array, dtype) -> jax.Array:
    """(shrunk [..., C] where mask, else 0) @ B [C, out] in `dtype` (fp32 accumulation): the update from a shrink computed
    elsewhere (an `INLINE` group's extra columns of the base product). Isolation: the mask *selects* (a NaN or inf
    in another slot's columns is never multiplied by 0 into this row), and a row whose mask keeps no column (no
    adapter) gets exactly 0, whatever B holds, so its product is the base model's bit for bit."""
    lead = shrunk.shape[:-1]
    keep = mask != 0
    s2 = jnp.where(keep, shrunk.reshape(-1, shrunk.shape[-1]).astype(jnp.float32), 0.0)
    out = jnp.dot(s2.astype(dtype), b, preferred_element_type=jnp.float32)
    out = jnp.where(jnp.any(keep, axis=-1, keepdims=True), out, 0.0).astype(dtype)
    return out.reshape(*lead, b.shape[-1])


def delta_reference(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array, group: str,
                    rank: int) -> jax.Array:
    """The same update row by row: gather each row's own slot block of A and B (the oracle for `delta`)."""
    width = len(GROUPS[group]) * rank
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    slots = token_slots.reshape(-1)

    def one(row, slot):
        s = jnp.maximum(slot, 0)
        a_s = jax.lax.dynamic_slice_in_dim(a, s * width, width, axis=1).astype(jnp.float32)
        b_s = jax.lax.dynamic_slice_in_dim(b, s * width, width, axis=0).astype(jnp.float32)
        return jnp.where(slot >= 0, (row @ a_s) @ b_s, 0.0)

    return jax.vmap(one)(x2, slots).reshape(*x.shape[:-1], b.shape[-1])

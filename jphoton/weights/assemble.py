"""Turn per-tensor host arrays into the stacked params pytree, with shape checks and one cast to the target dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.models import tensor_parallel as tp
from jphoton.models.config import ModelConfig
from jphoton.models.llama import layer_groups, param_shapes


def assemble_params(cfg: ModelConfig, top: dict[str, np.ndarray], per_layer: dict[str, dict[int, np.ndarray]],
                    dtype, source: str, mesh=None) -> dict:
    """`top` holds embed / final_norm / lm_head; `per_layer[name][i]` holds layer i's tensor, already in our layout,
    where name is `attn_norm`, `wq`, ... for the `layers` stack and `group.name` (e.g. `moe.w_gate`) for the other
    stacked groups (MoE models), i being the decoder layer index either way. mesh: place each tensor straight onto its
    tensor-parallel shards (models/tensor_parallel.py), never whole on one device."""
    if mesh is not None:
        tp.check(cfg, mesh.size)
    shapes = param_shapes(cfg)
    groups = layer_groups(cfg)
    want = {name if g == "layers" else f"{g}.{name}": (g, name) for g in groups if g in shapes for name in shapes[g]}
    missing = [k for k in shapes if k not in groups and k not in top]
    missing += [f"layers.{k}" if "." not in k else k for k in want if k not in per_layer]
    extra = [k for k in top if k not in shapes or k in groups]
    extra += [f"layers.{k}" if "." not in k else k for k in per_layer if k not in want]
    if missing or extra:
        raise ValueError(f"{source}: checkpoint does not match the {cfg.architecture} config: "
                         f"missing {missing}, unexpected {extra}")

    def put(name: str, arr: np.ndarray, want: tuple) -> jax.Array:
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, config implies {tuple(want)}")
        # The cast happens on device: one host->device copy in the checkpoint's own precision.
        if mesh is not None:
            group, _, leaf = name.rpartition(".")
            return tp.place(cfg, mesh, group, leaf, arr).astype(dtype)
        return jnp.asarray(arr).astype(dtype)

    params = {k: put(k, top[k], shapes[k]) for k in shapes if k not in groups}
    for key, (g, name) in want.items():
        got, layers = per_layer[key], groups[g]
        absent = [i for i in layers if i not in got]
        if absent or len(got) != len(layers):
            extra_layers = sorted(set(got) - set(layers))
            raise ValueError(f"{source}: {g}.{name} missing for layers {absent}"
                             f"{f', unexpected for layers {extra_layers}' if extra_layers else ''}")
        params.setdefault(g, {})[name] = put(f"{g}.{name}", np.stack([got[i] for i in layers]), shapes[g][name])
    return params

"""Turn per-tensor host arrays into the stacked params pytree, with shape checks and one cast to the target dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.config import ModelConfig
from jphoton.models.llama import param_shapes


def assemble_params(cfg: ModelConfig, top: dict[str, np.ndarray], per_layer: dict[str, dict[int, np.ndarray]],
                    dtype, source: str) -> dict:
    """`top` holds embed / final_norm / lm_head; `per_layer[name][i]` holds layer i's tensor, already in our layout."""
    shapes = param_shapes(cfg)
    missing = [k for k in shapes if k != "layers" and k not in top]
    missing += [f"layers.{k}" for k in shapes["layers"] if k not in per_layer]
    extra = [k for k in top if k not in shapes] + [f"layers.{k}" for k in per_layer if k not in shapes["layers"]]
    if missing or extra:
        raise ValueError(f"{source}: checkpoint does not match the {cfg.architecture} config: "
                         f"missing {missing}, unexpected {extra}")

    def put(name: str, arr: np.ndarray, want: tuple) -> jax.Array:
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, config implies {tuple(want)}")
        # The cast happens on device: one host->device copy in the checkpoint's own precision.
        return jnp.asarray(arr).astype(dtype)

    params = {k: put(k, top[k], shapes[k]) for k in shapes if k != "layers"}
    layers = {}
    for name, want in shapes["layers"].items():
        got = per_layer[name]
        absent = [i for i in range(cfg.num_layers) if i not in got]
        if absent or len(got) != cfg.num_layers:
            raise ValueError(f"{source}: layers.{name} missing for layers {absent or sorted(got)}")
        layers[name] = put(f"layers.{name}", np.stack([got[i] for i in range(cfg.num_layers)]), want)
    params["layers"] = layers
    return params

"""HF checkpoint directories: config.json + *.safetensors (single file or sharded with an index)."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
from safetensors import SafetensorError, safe_open

from jphoton.models.config import ModelConfig
from jphoton.weights.assemble import assemble_params

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our name, transpose?)
_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")
# Qwen3-MoE: the router, and the experts either one tensor per expert (the Hub's checkpoints) or fused per layer
# ([E, 2F, D] gate+up and [E, D, F] down, the layout transformers 5 keeps in memory).
_ROUTER = "mlp.gate.weight"
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = {"mlp.experts.gate_up_proj": "gate_up", "mlp.experts.down_proj": "down"}


def is_hf_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_config(path: pathlib.Path) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    return ModelConfig.from_hf(hf, name=path.name)


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{path}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (pickled .bin checkpoints are not loaded, by design)")
    return files


def load_hf_dir(path: pathlib.Path, dtype, progress: bool = False, mesh=None) -> tuple[ModelConfig, dict]:
    cfg = read_config(path)
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    top: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, int], dict[int, np.ndarray]] = {}  # (gate|up|down, layer) -> {expert: [out, in]}
    unexpected = []
    moe = bool(cfg.num_experts)
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():
                    m = _LAYER_KEY.match(key)
                    sub = m.group(2) if m else ""
                    if m and sub in _LAYER_MAP:
                        name, transpose = _LAYER_MAP[sub]
                        if moe and name in ("w_gate", "w_up", "w_down"):
                            name = f"dense_mlp.{name}"
                        t = f.get_tensor(key)
                        per_layer.setdefault(name, {})[int(m.group(1))] = t.T if transpose else t
                    elif moe and sub == _ROUTER:
                        per_layer.setdefault("moe.router", {})[int(m.group(1))] = f.get_tensor(key).T
                    elif moe and (e := _EXPERT.match(sub)):
                        experts.setdefault((e.group(2), int(m.group(1))), {})[int(e.group(1))] = f.get_tensor(key)
                    elif moe and sub in _FUSED_EXPERTS:
                        _add_fused_experts(per_layer, _FUSED_EXPERTS[sub], int(m.group(1)), f.get_tensor(key), cfg, key)
                    elif key == "model.embed_tokens.weight":
                        top["embed"] = f.get_tensor(key)
                    elif key == "model.norm.weight":
                        top["final_norm"] = f.get_tensor(key)
                    elif key == "lm_head.weight":
                        top["lm_head"] = f.get_tensor(key).T
                    elif not _IGNORED.search(key):
                        unexpected.append(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: corrupt or truncated safetensors file ({e})") from None
    for (kind, layer), by_expert in experts.items():
        if sorted(by_expert) != list(range(cfg.num_experts)):
            raise ValueError(f"{path}: layer {layer} has {kind}_proj for experts {sorted(by_expert)[:8]}..., expected "
                             f"0..{cfg.num_experts - 1}")
        shapes = {a.shape for a in by_expert.values()}
        if len(shapes) != 1:
            raise ValueError(f"{path}: layer {layer} {kind}_proj experts differ in shape: {sorted(shapes)}")
        per_layer.setdefault(f"moe.w_{kind}", {})[layer] = np.stack([by_expert[i] for i in range(cfg.num_experts)])
    if unexpected:
        raise ValueError(f"{path}: tensors this {cfg.architecture} config does not explain: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    if cfg.tie_embeddings and "lm_head" in top:
        # Some tied checkpoints still store a copy of the head; it must equal the embedding to be ignorable.
        if not np.array_equal(top["lm_head"].T, top["embed"]):
            raise ValueError(f"{path}: config ties embeddings but lm_head.weight differs from the embedding")
        del top["lm_head"]
    return cfg, assemble_params(cfg, top, per_layer, dtype, source=str(path), mesh=mesh)


def _add_fused_experts(per_layer, kind: str, layer: int, t: np.ndarray, cfg: ModelConfig, key: str) -> None:
    E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = (E, 2 * F, D) if kind == "gate_up" else (E, D, F)
    if t.shape != want:
        raise ValueError(f"tensor {key} has shape {t.shape}, config implies {want}")
    if kind == "gate_up":
        per_layer.setdefault("moe.w_gate", {})[layer] = t[:, :F]
        per_layer.setdefault("moe.w_up", {})[layer] = t[:, F:]
    else:
        per_layer.setdefault("moe.w_down", {})[layer] = t

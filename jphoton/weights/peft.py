"""HF PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`, read into numpy (engine: models/lora.py).

Plain LoRA only: q/k/v/o/gate/up/down projections of the decoder layers, any rank (the engine's max_lora_rank caps it),
scaling lora_alpha / r (or / sqrt(r) with use_rslora). Anything that would need more than a low-rank update of those
products (DoRA, modules_to_save, embedding or LM-head targets, biases, per-module ranks) is refused with a clear error,
never loaded half-way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import numpy as np
from safetensors import SafetensorError, safe_open

from jphoton.config import ModelConfig
from jphoton.models.lora import TARGETS, target_dims

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")


@dataclasses.dataclass
class PeftAdapter:
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]  # (layer, target) -> (lora_A [r, in], lora_B [out, r])
    source: str = ""


def _fail(path, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {why}")


def read_peft_config(path: pathlib.Path) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise _fail(path, "no adapter_config.json (expected a HF PEFT adapter directory)")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(path, f"adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _fail(path, "adapter_config.json is not a JSON object")
    return config


def _check_config(path, config: dict, max_rank: int) -> tuple[int, float, set[str]]:
    """(rank, scaling, targets) of a plain-LoRA config; ValueError for anything else."""
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise _fail(path, f"peft_type {kind!r} is not supported (plain LoRA only)")
    unsupported = {
        "use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)", "layers_to_transform": "layers_to_transform",
        "trainable_token_indices": "trainable tokens", "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA",
        "megatron_config": "Megatron LoRA", "layer_replication": "layer replication",
        "alora_invocation_tokens": "activated LoRA (aLoRA)", "arrow_config": "Arrow routing",
        "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA", "velora_config": "VeLoRA",
        "use_bdlora": "block-diagonal LoRA", "target_parameters": "target_parameters",
        "fan_in_fan_out": "fan_in_fan_out (transposed weights)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise _fail(path, f"{what} is not supported (plain LoRA only)")
    if config.get("bias", "none") != "none":
        raise _fail(path, f"bias={config['bias']!r} is not supported (bias='none' only)")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _fail(path, f"rank {r} exceeds max_lora_rank={max_rank} (start the engine with a larger max_lora_rank)")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(path, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [t for t in TARGETS if re.fullmatch(targets, f"model.layers.0.self_attn.{t}")
                   or re.fullmatch(targets, f"model.layers.0.mlp.{t}")] if targets != "all-linear" else list(TARGETS)
    if not targets:
        raise _fail(path, "target_modules is empty")
    names = {str(t).rsplit(".", 1)[-1] for t in targets}
    bad = sorted(names - set(TARGETS))
    if bad:
        raise _fail(path, f"target modules {bad} are not supported (supported: {', '.join(TARGETS)})")
    return r, float(scaling), names


def load_peft_adapter(path: str | pathlib.Path, cfg: ModelConfig, max_rank: int) -> PeftAdapter:
    """Read and check a PEFT LoRA adapter for a model of config `cfg`; ValueError names what does not fit."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise _fail(path, "not a directory")
    if cfg.num_experts:
        raise _fail(path, "LoRA is supported for dense Llama-family models only, not MoE")
    rank, scaling, targets = _check_config(path, read_peft_config(path), max_rank)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise _fail(path, "no adapter_model.safetensors (pickled adapter_model.bin is not loaded, by design)")
    dims = target_dims(cfg)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    try:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise _fail(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder projection")
                layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
                if target not in TARGETS:
                    raise _fail(path, f"tensor {key!r}: target {target!r} is not supported")
                if layer >= cfg.num_layers:
                    raise _fail(path, f"tensor {key!r}: the model has {cfg.num_layers} layers")
                parts.setdefault((layer, target), {})[ab] = np.asarray(f.get_tensor(key), np.float32)
    except (SafetensorError, OSError) as e:
        raise _fail(path, f"corrupt or truncated adapter_model.safetensors ({e})") from None
    weights = {}
    for (layer, target), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"layer {layer} {target}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        d_in, d_out = dims[target]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise _fail(path, f"layer {layer} {target}: lora_A {a.shape}, lora_B {b.shape}; expected "
                              f"{(rank, d_in)} and {(d_out, rank)} for rank {rank} on this model")
        if target not in targets:
            raise _fail(path, f"layer {layer} {target}: weights for a module not in target_modules")
        weights[(layer, target)] = (a, b)
    if not weights:
        raise _fail(path, "adapter_model.safetensors holds no LoRA weights")
    return PeftAdapter(rank, scaling, weights, str(path))

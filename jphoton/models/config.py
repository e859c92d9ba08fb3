"""ModelConfig: the static description of a decoder, hashable so jitted functions can close over it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "custom")  # custom: a user model (models/protocol.py)

# HF `architectures[0]` / `model_type` -> our architecture name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `llama3` rescales low frequencies (Llama 3.1+); `factors` divides each frequency by an
    explicit factor (what llama.cpp stores as `rope_freqs.weight` in Llama 3 GGUFs)."""

    kind: str  # "llama3" | "linear" | "factors"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama checkpoints with attention_bias)
    o_bias: bool = False  # Llama's attention_bias also covers o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    sliding_window: int | None = None  # Mistral v0.1: a key is visible iff q_pos - k_pos < window
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means a dense model. A layer is MoE iff it is not in
    # mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF's rule); the other layers use a dense MLP of
    # intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to one
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"model config: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step < 1:
                raise ValueError("model config: moe_intermediate_size and decoder_sparse_step must be positive")

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers (empty for a dense model)."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a dense MLP (all of them for a dense model)."""
        return tuple(i for i in range(self.num_layers) if not self.is_moe_layer(i))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling"):
            rs = d["rope_scaling"]
            d["rope_scaling"] = RopeScaling(**{**rs, "freq_factors": tuple(rs.get("freq_factors", ()))})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["mlp_only_layers"] = tuple(d.get("mlp_only_layers", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Parse a HF `config.json` dict; accepts both `rope_theta`/`rope_scaling` and transformers 5's `rope_parameters`."""
        arch = None
        for a in hf.get("architectures") or ():
            arch = _HF_ARCHITECTURES.get(a)
            if arch is None:
                raise ValueError(f"unknown architecture {a!r} in config.json; supported: "
                                 f"{', '.join(sorted(_HF_ARCHITECTURES))}")
        if arch is None:
            arch = _HF_MODEL_TYPES.get(hf.get("model_type", ""))
        if arch is None:
            raise ValueError(f"unknown architecture: config.json has architectures={hf.get('architectures')!r}, "
                             f"model_type={hf.get('model_type')!r}")
        try:
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            rope = dict(hf.get("rope_parameters") or {})
            legacy = hf.get("rope_scaling") or {}
            theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
            if not rope.get("rope_type") or rope.get("rope_type") == "default":
                rope = {**rope, **legacy}
            sliding = None
            if arch == "mistral" or hf.get("use_sliding_window"):
                sliding = hf.get("sliding_window")
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=_parse_hf_rope_scaling(rope),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
                o_bias=arch in ("llama", "mistral", "qwen3", "qwen3_moe") and bool(hf.get("attention_bias", False)),
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
                **_parse_hf_moe(hf, arch),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required key {e.args[0]!r}") from None


def _parse_hf_moe(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    if arch != "qwen3_moe":
        return {}
    return dict(
        num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
    )


def _parse_hf_rope_scaling(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")

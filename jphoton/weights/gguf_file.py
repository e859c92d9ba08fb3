"""GGUF files (llama architecture): metadata -> ModelConfig, every tensor type gguf-py dequantizes, Q/K unpermuted, and
the tokenizer rebuilt from the metadata (a byte-level BPE with its merges, special tokens and pre-tokenizer)."""

from __future__ import annotations

import logging
import pathlib
import re
from typing import Any

import gguf
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from jphoton.models.config import ModelConfig, RopeScaling
from jphoton.text.tokenizer import Tokenizer
from jphoton.weights.assemble import assemble_params

log = logging.getLogger("jphoton.weights")

SUPPORTED_ARCHITECTURES = ("llama",)
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_MAP = {  # GGUF name inside a block -> (our name, transpose from [out, in] to [in, out]?)
    "attn_norm.weight": ("attn_norm", False),
    "ffn_norm.weight": ("mlp_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}


def open_gguf(path: pathlib.Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError, struct.error, IndexError... on a damaged file
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


# Pre-tokenizer regexes of the GGUF `tokenizer.ggml.pre` values we rebuild (as in llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    if pre in ("llama3", "llama-bpe", "llama-v3", "qwen2"):
        split = _LLAMA3_SPLIT if pre != "qwen2" else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2, llama-bpe, qwen2)")


def read_tokenizer(reader: gguf.GGUFReader) -> Tokenizer | None:
    """The tokenizer in the GGUF metadata, rebuilt; None if it has none or is not a byte-level BPE ('gpt2')."""
    model = field(reader, "tokenizer.ggml.model")
    if model is None:
        return None
    if model != "gpt2":
        log.warning("GGUF tokenizer model %r is not rebuilt (only byte-level BPE, 'gpt2', is); "
                    "the model will take token ids only", model)
        return None
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special; USER_DEFINED (4) are added tokens matched verbatim in text.
    added = [AddedToken(t, special=(ty == 3), normalized=False)
             for t, ty in zip(tokens, types, strict=True) if ty in (3, 4)]
    tok.add_tokens(added)

    def tok_str(key):
        i = field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    return Tokenizer(tok, bos_token=tok_str("tokenizer.ggml.bos_token_id"),
                     eos_token=tok_str("tokenizer.ggml.eos_token_id"),
                     chat_template=field(reader, "tokenizer.chat_template"),
                     add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)))


def read_config(reader: gguf.GGUFReader, path: pathlib.Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: unknown architecture {arch!r} in GGUF (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    p = f"{arch}."
    try:
        hidden = int(field(reader, p + "embedding_length"))
        heads = int(field(reader, p + "attention.head_count"))
        kv_heads = int(field(reader, p + "attention.head_count_kv", heads))
        n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
        vocab = int(field(reader, p + "vocab_size", 0) or n_tokens or _tensor(reader, "token_embd.weight").shape[1])
        head_dim = int(field(reader, p + "attention.key_length", 0) or field(reader, p + "rope.dimension_count", 0)
                       or hidden // heads)
        scaling = None
        if "rope_freqs.weight" in names:  # Llama 3.1+: llama.cpp stores the per-frequency divisors as a tensor
            scaling = RopeScaling(kind="factors",
                                  freq_factors=tuple(float(x) for x in _dequantize(_tensor(reader, "rope_freqs.weight"))))
        elif field(reader, p + "rope.scaling.type") == "linear":
            scaling = RopeScaling(kind="linear", factor=float(field(reader, p + "rope.scaling.factor")))
        eos = [field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        return ModelConfig(
            architecture="llama",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(field(reader, p + "feed_forward_length")),
            num_layers=int(field(reader, p + "block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(field(reader, p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(field(reader, p + "context_length", 4096)),
            tie_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(sorted({int(e) for e in eos if e is not None})),
            name=str(field(reader, "general.name", path.stem)),
        )
    except (TypeError, KeyError) as e:
        raise ValueError(f"{path}: GGUF metadata is missing a required field ({e})") from None


def _tensor(reader: gguf.GGUFReader, name: str):
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(name)


def _dequantize(t) -> np.ndarray:
    """Float32 array in numpy order (GGUF lists dims fastest-first; numpy shape is the reverse)."""
    try:
        out = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name}: type {t.tensor_type.name} cannot be dequantized ({e})") from None
    except (ValueError, IndexError) as e:
        raise ValueError(f"GGUF tensor {t.name}: corrupt data ({e})") from None
    return np.asarray(out, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (it permutes for its interleaved RoPE); w is [out, in] or [out]."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def load_gguf(path: pathlib.Path, dtype, progress: bool = False, mesh=None):
    """-> (ModelConfig, params, Tokenizer or None)."""
    reader = open_gguf(path)
    cfg = read_config(reader, path)
    tokenizer = read_tokenizer(reader)
    top: dict[str, np.ndarray] = {}
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    unexpected = []
    tensors = reader.tensors
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"dequantizing {path.name}", unit="tensor", leave=False)
    for t in tensors:
        m = _BLOCK.match(t.name)
        if m and m.group(2) in _LAYER_MAP:
            name, transpose = _LAYER_MAP[m.group(2)]
            w = _dequantize(t)
            if name in ("wq", "bq"):
                w = unpermute_qk(w, cfg.num_heads)
            elif name in ("wk", "bk"):
                w = unpermute_qk(w, cfg.num_kv_heads)
            per_layer.setdefault(name, {})[int(m.group(1))] = w.T if transpose else w
        elif t.name == "token_embd.weight":
            top["embed"] = _dequantize(t)
        elif t.name == "output_norm.weight":
            top["final_norm"] = _dequantize(t)
        elif t.name == "output.weight":
            top["lm_head"] = _dequantize(t).T
        elif t.name != "rope_freqs.weight":
            unexpected.append(t.name)
    if unexpected:
        raise ValueError(f"{path}: tensors the llama architecture does not explain: {unexpected[:8]}")
    log.info("GGUF %s: %d tensors dequantized to float32", path.name, len(reader.tensors))
    return cfg, assemble_params(cfg, top, per_layer, dtype, source=str(path), mesh=mesh), tokenizer

"""Test helper: write a loaded Llama model as a llama.cpp-style GGUF (Q/K rows permuted, optional quantization).

It mirrors what llama.cpp's converter does, so loading the file back must give the original model."""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np

from jphoton.models.layers import rope_inv_freq


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation for its interleaved RoPE (the inverse of what the loader undoes)."""
    out = w.shape[0]
    return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: pathlib.Path, cfg, params, *, qtype=gguf.GGMLQuantizationType.F32,
                     tokenizer_dir: pathlib.Path | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    if tokenizer_dir is not None:
        tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.get)
        special = {t["content"] for t in tj["added_tokens"] if t["special"]}
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(vocab["<s>"])
        w.add_eos_token_id(vocab["</s>"])
        w.add_chat_template(json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"])
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":
        base = rope_inv_freq(cfg.replace(rope_scaling=None))
        w.add_tensor("rope_freqs.weight", (base / rope_inv_freq(cfg)).astype(np.float32))

    def add(name, arr, quantize=True):
        arr = np.ascontiguousarray(np.asarray(arr, np.float32))
        if quantize and arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    lp = {k: np.asarray(v) for k, v in params["layers"].items()}
    add("token_embd.weight", params["embed"])
    add("output_norm.weight", params["final_norm"])
    if "lm_head" in params:
        add("output.weight", np.asarray(params["lm_head"]).T)
    for i in range(cfg.num_layers):
        add(f"blk.{i}.attn_norm.weight", lp["attn_norm"][i])
        add(f"blk.{i}.ffn_norm.weight", lp["mlp_norm"][i])
        add(f"blk.{i}.attn_q.weight", permute_qk(lp["wq"][i].T, cfg.num_heads))
        add(f"blk.{i}.attn_k.weight", permute_qk(lp["wk"][i].T, cfg.num_kv_heads))
        add(f"blk.{i}.attn_v.weight", lp["wv"][i].T)
        add(f"blk.{i}.attn_output.weight", lp["wo"][i].T)
        add(f"blk.{i}.ffn_gate.weight", lp["w_gate"][i].T)
        add(f"blk.{i}.ffn_up.weight", lp["w_up"][i].T)
        add(f"blk.{i}.ffn_down.weight", lp["w_down"][i].T)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

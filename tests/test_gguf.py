"""GGUF loading: Q/K unpermutation, quantized types, llama3 rope factors, tokenizer rebuilt from metadata."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from jphoton.models.llama import reference_logits
from jphoton.weights import load_model
from jphoton.weights.gguf_file import unpermute_qk

from conftest import FIXTURES, tiny_reference
from gguf_writer import write_llama_gguf


def test_unpermute_inverts_llama_cpp_permutation():
    from gguf_writer import permute_qk

    w = np.random.default_rng(0).normal(size=(4 * 16, 8))
    assert np.array_equal(unpermute_qk(permute_qk(w, 4), 4), w)
    assert not np.array_equal(permute_qk(w, 4), w)


def _logits(model, family):
    ref = tiny_reference(family)
    return reference_logits(model.params, model.config, [np.concatenate([p, t[:-1]]) for p, t, _ in ref]), ref


@pytest.mark.parametrize("family", ["llama2", "llama3", "smollm2"])
def test_f32_gguf_equals_hf_checkpoint(tmp_path, tiny_models, family):
    hf_model = tiny_models(family)
    path = tmp_path / f"{family}.gguf"
    write_llama_gguf(path, hf_model.config, hf_model.params)
    g = load_model(path, "float32", cache=False)
    assert g.loaded_from == "GGUF"
    assert g.config.tie_embeddings == hf_model.config.tie_embeddings
    ours, ref = _logits(g, family)
    for o, (_, _, logits) in zip(ours, ref, strict=True):
        assert np.abs(o - logits).max() / np.abs(logits).max() < 1e-4


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16,
                                   gguf.GGMLQuantizationType.BF16])
def test_quantized_types_dequantize_close_to_source(tmp_path, tiny_models, qtype):
    hf_model = tiny_models("llama2")
    path = tmp_path / "q.gguf"
    write_llama_gguf(path, hf_model.config, hf_model.params, qtype=qtype)
    g = load_model(path, "float32", cache=False)
    for name in ("wq", "wk", "w_down"):
        a, b = np.asarray(g.params["layers"][name]), np.asarray(hf_model.params["layers"][name])
        assert np.abs(a - b).max() / np.abs(b).max() < 1e-2, name


def test_tokenizer_rebuilt_from_gguf_metadata(tmp_path, tiny_models):
    """The llama3 fixture's trained BPE written as GGUF tokens + merges must tokenize exactly as HF's tokenizer."""
    hf_model = tiny_models("llama2")
    path = tmp_path / "tok.gguf"
    write_llama_gguf(path, hf_model.config, hf_model.params, tokenizer_dir=FIXTURES / "tiny" / "llama3")
    g = load_model(path, "float32", cache=False)
    ref = json.loads((FIXTURES / "tiny" / "llama3" / "tokenizer_reference.json").read_text())
    for text, ids in zip(ref["texts"], ref["text_ids"], strict=True):
        assert g.tokenizer.encode(text) == ids
        assert g.tokenizer.decode(ids) == text
    assert g.tokenizer.encode_chat(ref["conversation"]) == ref["chat_ids"]


def test_load_tokenizer_reads_no_weights(tmp_path, tiny_models, monkeypatch):
    """`load_tokenizer`: a GGUF's tokenizer from its metadata, or from a cached conversion once there is one (the file
    is not opened again); a HF directory's; none for random weights."""
    from jphoton.weights import gguf_file, load_tokenizer, store

    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path / "converted")
    hf_model = tiny_models("llama2")
    path = tmp_path / "tok.gguf"
    write_llama_gguf(path, hf_model.config, hf_model.params, tokenizer_dir=FIXTURES / "tiny" / "llama3")
    ref = json.loads((FIXTURES / "tiny" / "llama3" / "tokenizer_reference.json").read_text())
    from_metadata = load_tokenizer(path)
    load_model(path, "bfloat16")  # caches a conversion (bf16: any dtype's serves)
    monkeypatch.setattr(gguf_file, "open_gguf", lambda p: pytest.fail("opened the GGUF file again"))
    for tok in (from_metadata, load_tokenizer(path), load_tokenizer(FIXTURES / "tiny" / "llama3")):
        assert [tok.encode(t) for t in ref["texts"]] == ref["text_ids"]
    assert load_tokenizer("random:smollm2-135m:layers=1") is None
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")


def test_second_load_of_a_gguf_hits_the_conversion_cache(tmp_path, tiny_models, monkeypatch):
    monkeypatch.setenv("JPHOTON_CACHE_DIR", str(tmp_path / "cache"))
    hf_model = tiny_models("llama2")
    path = tmp_path / "c.gguf"
    write_llama_gguf(path, hf_model.config, hf_model.params)
    first = load_model(path, "float32")
    second = load_model(path, "float32")
    assert first.loaded_from == "GGUF" and second.loaded_from.startswith("GGUF (cached")
    for name, a in first.params["layers"].items():
        assert np.array_equal(np.asarray(a), np.asarray(second.params["layers"][name])), name
    path.write_bytes(path.read_bytes())  # a changed file (new mtime) must not be served from the cache
    assert load_model(path, "float32").loaded_from == "GGUF"

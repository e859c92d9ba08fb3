"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) against HF transformers float32 on the same file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.models.llama import reference_logits

from conftest import FIXTURES


@pytest.fixture(scope="module")
def reference():
    ref = np.load(FIXTURES / "embedded" / "reference.npz")
    prompts = json.loads((FIXTURES / "embedded" / "prompts.json").read_text())
    return [dict(p, **{k: ref[f"{k}_{i}"] for k in ("prompt", "tokens", "top_ids", "top_logits", "first_logits")})
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def our_logits(embedded_llm, reference):
    m = embedded_llm.model
    return reference_logits(m.params, m.config, [np.concatenate([r["prompt"], r["tokens"][:-1]]) for r in reference])


def test_fixture_covers_chat_and_raw(reference):
    kinds = [r["kind"] for r in reference]
    assert kinds.count("chat") >= 3 and kinds.count("raw") >= 3
    assert all(len(r["tokens"]) >= 24 for r in reference)


def test_tokenizer_and_chat_template_match_hf(embedded_llm, reference):
    for r in reference:
        if r["kind"] == "chat":
            ids = embedded_llm.encode_chat([{"role": "user", "content": r["text"]}])
        else:
            ids = embedded_llm.tokenizer.encode(r["text"])
        assert ids == r["prompt"].tolist(), r["text"]


def test_first_step_logits_match_hf(our_logits, reference):
    for ours, r in zip(our_logits, reference, strict=True):
        ref = r["first_logits"]
        err = np.abs(ours[len(r["prompt"]) - 1] - ref).max() / np.abs(ref).max()
        assert err <= 1e-4, (r["text"], err)


def test_logits_match_hf_at_every_position(our_logits, reference):
    """HF's top-16 logits at every prompt and generated position, compared at the same token ids."""
    for ours, r in zip(our_logits, reference, strict=True):
        picked = np.take_along_axis(ours, r["top_ids"], axis=-1)
        err = np.abs(picked - r["top_logits"]).max() / np.abs(r["top_logits"]).max()
        assert err <= 1e-4, (r["text"], err)
        assert (ours.argmax(-1) == r["top_ids"][:, 0]).all()


def test_greedy_tokens_match_hf(embedded_llm, reference):
    n = len(reference[0]["tokens"])
    outs = embedded_llm.generate([{"prompt_token_ids": r["prompt"].tolist()} for r in reference],
                                 SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for out, r in zip(outs, reference, strict=True):
        assert out.token_ids == r["tokens"].tolist(), r["text"]
        assert out.text == embedded_llm.tokenizer.decode(r["tokens"])


def test_capital_of_france(embedded_llm):
    [out] = embedded_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                              SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>, an EOS id
    assert out.token_ids[-1] in embedded_llm.config.eos_token_ids
    assert "<|im_end|>" not in out.text

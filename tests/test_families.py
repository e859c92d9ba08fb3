"""Every Llama-family variant against HF transformers (float32): logits at every position and greedy tokens.

Each family also loses its distinguishing feature in a test, which must then break the match: a loader or layer that
ignored the feature would be caught."""

from __future__ import annotations

import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.models.llama import reference_logits

from conftest import TINY_FAMILIES, make_llm, tiny_reference

TOL = 1e-4  # max|Δ| / max|ref|


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def logits_error(model, cfg=None, params=None) -> float:
    cfg, params = cfg or model.config, params or model.params
    ref = tiny_reference(model.source.split("/")[-1])
    ours = reference_logits(params, cfg, [np.concatenate([prompt, tokens[:-1]]) for prompt, tokens, _ in ref])
    return max(rel_err(o, logits) for o, (_, _, logits) in zip(ours, ref, strict=True))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logits_match_hf_at_every_position(tiny_models, family):
    assert logits_error(tiny_models(family)) <= TOL


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_tokens_match_hf(family):
    from conftest import FIXTURES

    llm = make_llm(str(FIXTURES / "tiny" / family), warmup=False)
    ref = tiny_reference(family)
    params = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref], params)
    for out, (prompt, tokens, _) in zip(outs, ref, strict=True):
        assert out.prompt_token_ids == prompt.tolist()
        assert out.token_ids == tokens.tolist()
        assert out.finish_reason == "length"
        assert (out.text is None) == (llm.tokenizer is None)


def _drop(params, *names):
    layers = {k: v for k, v in params["layers"].items() if k not in names}
    return {**params, "layers": layers}


# family -> (what is removed, function (cfg, params) -> (cfg, params) without it)
ABLATIONS = {
    "qwen2": ("qkv bias", lambda c, p: (c.replace(qkv_bias=False), _drop(p, "bq", "bk", "bv"))),
    "qwen3": ("q/k RMSNorm", lambda c, p: (c.replace(qk_norm=False), _drop(p, "q_norm", "k_norm"))),
    "llama3": ("llama3 RoPE scaling", lambda c, p: (c.replace(rope_scaling=None), p)),
    "llama2": ("untied LM head", lambda c, p: (c.replace(tie_embeddings=True),
                                               {k: v for k, v in p.items() if k != "lm_head"})),
    "mistral": ("sliding window", lambda c, p: (c.replace(sliding_window=None), p)),
    # SmolLM2's own mark is its RoPE base (100000): a loader falling back to the default 10000 must be caught.
    "smollm2": ("rope_theta from the config", lambda c, p: (c.replace(rope_theta=10000.0), p)),
}


@pytest.mark.parametrize("family", sorted(ABLATIONS))
def test_dropping_the_distinguishing_feature_breaks_the_match(tiny_models, family):
    what, ablate = ABLATIONS[family]
    model = tiny_models(family)
    cfg, params = ablate(model.config, model.params)
    err = logits_error(model, cfg, params)
    assert err > 100 * TOL, f"{family}: removing {what} should break the match, error only {err:.2e}"

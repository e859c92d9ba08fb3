"""Shared fixtures. The embedded model is loaded once per session; converted-model caches go to a temp dir."""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TINY_FAMILIES = ("llama2", "llama3", "smollm2", "mistral", "qwen2", "qwen3")

# Before jphoton is imported anywhere: keep the test session's conversion cache out of the user's home.
os.environ.setdefault("JPHOTON_CACHE_DIR", tempfile.mkdtemp(prefix="jphoton-test-cache-"))


# Small bucket sets keep compiles few on 2 CPU cores; every test engine shares them.
ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=128, decode_buckets=(1, 8),
                   prefill_buckets=((2, 64),))
_LIVE_LLMS = []


def make_llm(model=None, **kwargs):
    """An LLM with the test bucket sets, checked for leaked KV pages after every test."""
    from jphoton import LLM

    llm = LLM(model, **{"dtype": "float32", **ENGINE_ARGS, **kwargs})
    _LIVE_LLMS.append(llm)
    return llm


@pytest.fixture(autouse=True)
def no_leaked_pages():
    yield
    for llm in _LIVE_LLMS:
        stats = llm.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"], f"KV pages leaked: {stats}"
        assert not llm.engine.sequences, "sequences still live after the test"
        assert not llm.has_unfinished_requests()


@pytest.fixture(scope="session")
def embedded_llm():
    return make_llm()  # the default loop: pipelined, depth 2


@pytest.fixture(scope="session")
def embedded_d1():
    return make_llm(pipeline_depth=1)  # the blocking loop


@pytest.fixture(scope="session")
def tiny_models():
    """family -> LoadedModel (float32), loaded lazily and kept for the session."""
    from jphoton.weights import load_model

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_model(FIXTURES / "tiny" / family, "float32")
        return cache[family]

    return get


def tiny_reference(family):
    import numpy as np

    ref = np.load(FIXTURES / "tiny" / family / "reference.npz")
    n = len([k for k in ref.files if k.startswith("prompt_")])
    return [(ref[f"prompt_{i}"], ref[f"tokens_{i}"], ref[f"logits_{i}"]) for i in range(n)]

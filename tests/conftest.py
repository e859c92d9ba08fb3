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


@pytest.fixture(scope="session")
def embedded_llm():
    from jphoton import LLM

    return LLM(dtype="float32")


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

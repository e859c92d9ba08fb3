"""jphoton: a JAX/Pallas LLM inference engine."""

from jphoton.params import Completion, SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM is imported on first use, so that importing a host-side module (jphoton.params, jphoton.sequence, the
    # scheduler) does not import jax and the whole engine with it (tests/test_imports.py)
    if name == "LLM":
        from jphoton.api import LLM

        return LLM
    raise AttributeError(f"module 'jphoton' has no attribute {name!r}")

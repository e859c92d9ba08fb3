"""jphoton: a JAX/Pallas LLM inference engine.

The public names load on first use, so that importing a host-side module (`jphoton.engine.scheduler`,
`jphoton.sequence`, ...) does not import jax.
"""

import importlib

_PUBLIC = {
    "LLM": "jphoton.api",
    "Stream": "jphoton.api",
    "AsyncLLM": "jphoton.async_llm",
    "EngineConfig": "jphoton.engine.config",
    "Buckets": "jphoton.engine.config",
    "Kernels": "jphoton.engine.config",
    "Limits": "jphoton.engine.config",
    "NoFreeLoraSlot": "jphoton.engine.loras",
    "JaxModel": "jphoton.models.protocol",
    "SamplingParams": "jphoton.params",
    "Completion": "jphoton.params",
    "Delta": "jphoton.sequence",
    "RequestOutput": "jphoton.sequence",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jphoton' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PUBLIC])

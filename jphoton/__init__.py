"""jphoton: a JAX/Pallas LLM inference engine.

The public names load on first use, so that importing a host-side module (`jphoton.engine.scheduler`,
`jphoton.sequence`, ...) does not import jax.
"""

import importlib
import os
import sys

# XLA's one-shot all-reduce kernel (on by default on GPU in jax 0.11) gives every all-reduce of every compiled
# program its own scratch buffers outside JAX's memory pool: ~1 GiB a GPU per program of a 70B model under tensor
# parallelism (161 all-reduces), which ran two 80 GB GPUs out of memory; off, the step is no slower
# (docs/decisions.md). XLA reads this flag from the environment when JAX starts its GPU backend, not per program,
# so it is set here, before that; a user's own setting of it is kept.
ONE_SHOT_FLAG = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel"
if ONE_SHOT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {ONE_SHOT_FLAG}=false".strip()
    # too late if JAX started its backends before this import (the runner warns under tensor parallelism); looked up
    # without importing jax, which host-side modules must not
    _bridge = sys.modules.get("jax._src.xla_bridge")
    ONE_SHOT_FLAG_LATE = bool(_bridge and getattr(_bridge, "backends_are_initialized", lambda: False)())
else:
    ONE_SHOT_FLAG_LATE = False

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
    "SpatialParams": "jphoton.params",
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

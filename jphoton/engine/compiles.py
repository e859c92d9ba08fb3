"""Count XLA compilations from JAX's own monitoring events (never from a counter the engine bumps itself).

A backend compile and a persistent-cache hit both mean "a new executable was needed"; after warm-up neither may happen.
"""

from __future__ import annotations

import os
import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_installed = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE:
        with _lock:
            _count += 1


def _on_event(event: str, **kwargs) -> None:
    global _count
    if event == _CACHE_HIT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _installed = True


def num_compiles() -> int:
    """Process-wide count since install()."""
    return _count


def enable_persistent_cache(directory: str) -> None:
    """Keep compiled executables on disk, so the second start-up of a bucketed engine skips most compiles. A directory
    the user already configured wins; ours is made private (mode 0700)."""
    if jax.config.jax_compilation_cache_dir:
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)  # (JAX would make it 0755; LLM's lies in cache_dir(), private)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


"""Helpers every kernel file here shares: where a kernel runs (Triton on a GPU, interpret mode elsewhere), power-of-two
tile sizes, and one log line per distinct kernel call shape (which path ran, never per step)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np


def use_interpret(interpret: bool | None) -> bool:
    """Interpret mode unless asked otherwise or running on a GPU backend."""
    if interpret is not None:
        return interpret
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes must be powers of two."""
    return 1 << max(int(n) - 1, 0).bit_length()


_logged: set = set()


def log_once(log: logging.Logger, key, msg: str, *args) -> None:
    """log.info(msg, *args) the first time `key` is seen: kernels are traced per shape, so this says once per compiled
    shape which path ran."""
    if key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


# A Python-int layer index is compiled into the kernel (benchmarks turn this off to compare).
STATIC_LAYER = True


def layer_operands(layer) -> tuple[int | None, list[jax.Array]]:
    """How a kernel over a stacked weight [L, ...] gets its layer index: a Python int (the engine's unrolled layer
    loop) is compiled in, so the first weight address is known at kernel start; a traced index (a `scan`) becomes a
    [1] int32 operand that every program loads first, one memory round trip (~0.5-1 us) before any weight load can
    issue. Returns (the static index or None, the operands to pass first)."""
    if STATIC_LAYER and isinstance(layer, (int, np.integer)):
        return int(layer), []
    return None, [jnp.asarray(layer, jnp.int32).reshape(1)]


def with_layer(kernel, static_layer: int | None):
    """A Pallas kernel body from kernel(layer, *refs): the static index, or the one read from the first ref."""
    if static_layer is not None:
        return lambda *refs: kernel(jnp.int32(static_layer), *refs)
    return lambda layer_ref, *refs: kernel(layer_ref[0], *refs)

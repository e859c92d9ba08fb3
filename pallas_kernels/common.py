"""Helpers every kernel file here shares: where a kernel runs (Triton on a GPU, interpret mode elsewhere), power-of-two
tile sizes, and one log line per distinct kernel call shape (which path ran, never per step)."""

from __future__ import annotations

import logging

import jax


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

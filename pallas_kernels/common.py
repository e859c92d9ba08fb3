"""Helpers every kernel file here shares: where a kernel runs (Triton on a GPU, interpret mode elsewhere), power-of-two
tile sizes, one log line per distinct kernel call shape (which path ran, never per step), and `traced_once`."""

from __future__ import annotations

import inspect
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


def traced_once(fn):
    """A kernel entry point as a `jax.jit` whose keyword-only options are static and whose positional arguments (arrays,
    and `layer`: a Python int becomes a traced scalar) are not. A layer loop calls a kernel once per layer with equal
    shapes; JAX would trace each call's kernel body and lower it to Triton anew (~0.15 s a call on the H100 host, most of
    a step shape's Python trace, which holds the GIL while the engine serves). Through the jit, one program traces and
    lowers it once and calls it per layer; XLA inlines the calls, so the compiled program is unchanged."""
    static = [name for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    return jax.jit(fn, static_argnames=static)

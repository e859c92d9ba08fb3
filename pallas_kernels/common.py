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


# ----------------------------------------------------------------------------------------------------------------------
# "The last program finishes": split work that needs a whole sum (split-K, split attention) merged inside the kernel
# instead of by a second kernel. Every program stores its partial, then arrives at a counter; the one that arrives
# last (an atomic add's old value) merges the partials and resets the counter, so a kernel leaves its counters zero.
# The hope: the merge kernels this replaces cost ~1.2-2 us each on the H100, mostly launch and ramp. Measured there
# (RESULTS.md, 2026-11-24 22:25-22:57), a finish costs more: ~3.7 us at one level (barrier, atomic round trip, partials
# reloaded from L2 on the last program's critical path), ~6 us at two. The engine's default paths do not use it.


def arrive_last(counters_ref, index, arrivals: int, finish, *, interpret: bool) -> None:
    """Arrive at counters_ref[index]; the program that makes it `arrivals` runs finish() after resetting it to 0.

    The barrier first: the atomic is issued by one thread of the program, and its release ordering only covers the
    stores of that thread, so all threads' partial stores must be ordered before it (Triton inserts no barrier for
    global memory). The atomic is acquire-release at GPU scope (jax's Triton lowering), so the last program's loads see
    every earlier arrival's stores."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    index = jnp.asarray(index, jnp.int32)  # a Python int would not index in interpret mode
    if not interpret:  # interpret mode runs programs one after another (and has no barrier primitive)
        plgpu.debug_barrier()
    old = plgpu.atomic_add(counters_ref, (index,), jnp.int32(1))

    @pl.when(old == arrivals - 1)
    def _():
        # every arrival is in, so nothing races this; an add because interpret mode has no atomic exchange
        plgpu.atomic_add(counters_ref, (index,), jnp.int32(-arrivals))
        finish()


def triton_call(kernel, name: str, grid, out_shape, args, aliases: dict, config, interpret: bool):
    """pl.pallas_call on the Triton backend with `config`'s num_warps / num_stages, quiet about jax 0.11's deprecation
    warning for that backend (once per trace)."""
    import warnings

    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        return pl.pallas_call(
            kernel, grid=grid, out_shape=out_shape, input_output_aliases=aliases, interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages), name=name,
        )(*args)


def grid_barrier(counters_ref, index, programs: int) -> None:
    """Wait until all `programs` programs of the grid have reached this point, on counters_ref[index] (arrivals) and
    [index + 1] (departures), both zero before and left zero after. GPU only (interpret mode runs programs one after
    another: a barrier there never opens), and only for a grid whose programs are all resident at once (<= one per SM),
    else it deadlocks.

    Arrive: a CTA barrier (every thread's earlier stores ordered before the arrival), then an acquire-release atomic
    add at GPU scope; spin on atomic reads until all have arrived; a CTA barrier again so that every thread's later
    loads are ordered after the acquire. Depart: the last program to leave resets both counters (nobody spins by
    then). Measured on the H100: 1.35 us per barrier, against 1.15-2.3 us per kernel boundary (benchmarks/probes/
    grid_barrier.py, RESULTS.md 2026-11-25): no cheaper than a boundary in general."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    arrivals, departures = jnp.int32(index), jnp.int32(index + 1)
    plgpu.debug_barrier()
    plgpu.atomic_add(counters_ref, (arrivals,), jnp.int32(1))
    jax.lax.while_loop(lambda seen: seen < programs,
                       lambda _: plgpu.atomic_add(counters_ref, (arrivals,), jnp.int32(0)), jnp.int32(0))
    plgpu.debug_barrier()
    old = plgpu.atomic_add(counters_ref, (departures,), jnp.int32(1))

    @pl.when(old == programs - 1)
    def _():
        plgpu.atomic_add(counters_ref, (arrivals,), jnp.int32(-programs))
        plgpu.atomic_add(counters_ref, (departures,), jnp.int32(-programs))


class Semaphores:
    """Zeroed int32 counters for `arrive_last` kernels, made once per traced step and threaded from kernel to kernel
    (each takes the array as an aliased input and returns it, zero again), so a step pays one small memset instead of
    one per kernel. Trace-local: create one per forward trace, never keep one across traces."""

    SIZE = 4096

    def __init__(self):
        self._array = None

    def take(self, n: int):
        import jax.numpy as jnp

        if n > self.SIZE:  # a kernel wider than the shared array gets zeros of its own
            return jnp.zeros((n,), jnp.int32)
        if self._array is None:
            self._array = jnp.zeros((self.SIZE,), jnp.int32)
        return self._array

    def give(self, array) -> None:
        if array.shape == (self.SIZE,):
            self._array = array

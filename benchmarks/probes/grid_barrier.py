"""What a persistent decode kernel would pay for its synchronisation, against what a kernel boundary costs now.

A megakernel that runs several decoder layers' small steps in one launch (the remaining route to the B=1 floor,
RESULTS.md 2026-11-24) replaces each kernel boundary with a grid-wide barrier. This probe measures both on the GPU:

  boundary: a chain of N trivial kernels, each reading the previous one's output: Pallas Triton kernels (no PDL in
            jax 0.11.2) and XLA loop fusions (kept apart by optimization barriers); us per kernel = slope over N (128 vs 640
            kernels in one jit call, so that device time, not dispatch, is timed).
  barrier:  one Pallas Triton kernel of P programs (all resident: P <= SMs x programs per SM) passing B grid
            barriers: each program arrives at an int32 counter (acq-rel atomic add after a CTA barrier) and spins on
            it (atomic reads) until all P have arrived; us per barrier = slope over B (64 vs 576).

    python benchmarks/probes/grid_barrier.py [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _time_us(f, *args, reps: int = 200) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 1e6 * best


def _pallas_step(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 1.0001 + 1.0

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=plgpu.CompilerParams(num_warps=4))(x)


def chain(kind: str, n: int):
    def f(x):
        for _ in range(n):
            if kind == "pallas":
                x = _pallas_step(x)
            else:
                x = jax.lax.optimization_barrier(jnp.sin(x) * 1.0001 + 1.0)
        return x
    return jax.jit(f)


def _barrier_kernel(c_ref, o_ref, *, programs, barriers):
    del o_ref  # aliased to c_ref: the counter comes back as the output
    for i in range(barriers):
        plgpu.debug_barrier()  # every thread's earlier stores ordered before the arrival
        plgpu.atomic_add(c_ref, (jnp.int32(0),), jnp.int32(1))
        target = jnp.int32((i + 1) * programs)
        jax.lax.while_loop(lambda seen, target=target: seen < target,
                           lambda _: plgpu.atomic_add(c_ref, (jnp.int32(0),), jnp.int32(0)), jnp.int32(0))


def barrier_kernel(programs: int, barriers: int, warps: int):
    kernel = functools.partial(_barrier_kernel, programs=programs, barriers=barriers)

    def f(c):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
            return pl.pallas_call(kernel, grid=(programs,), out_shape=jax.ShapeDtypeStruct(c.shape, c.dtype),
                                  input_output_aliases={0: 0},
                                  compiler_params=plgpu.CompilerParams(num_warps=warps))(c)
    return jax.jit(lambda: f(jnp.zeros((16,), jnp.int32)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "boundary": {}, "barrier": []}
    x = jnp.ones((2, 2048), jnp.float32)
    for kind in ("pallas", "xla"):
        t = {n: _time_us(chain(kind, n), x, reps=20) for n in (128, 640)}
        per = (t[640] - t[128]) / 512
        res["boundary"][kind] = {"us_by_n": t, "us_per_kernel": per}
        print(f"boundary {kind:>6}: {per:.2f} us per kernel (chain of 128 / 640: {t[128]:.1f} / {t[640]:.1f} us)",
              flush=True)
    for programs, warps in ((66, 4), (132, 4), (132, 8), (264, 4)):
        t = {}
        for b in (64, 576):
            f = barrier_kernel(programs, b, warps)
            t[b] = _time_us(f, reps=20)
            count = int(f()[0])
            assert count == programs * b, (programs, b, count)  # every program passed every barrier
        per = (t[576] - t[64]) / 512
        res["barrier"].append({"programs": programs, "warps": warps, "us_by_barriers": t, "us_per_barrier": per})
        print(f"barrier  P={programs:<4} w{warps}: {per:.2f} us per grid barrier (64 / 576 barriers: {t[64]:.1f} / "
              f"{t[576]:.1f} us)", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

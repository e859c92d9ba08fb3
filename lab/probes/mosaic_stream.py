"""Does a persistent Pallas Mosaic GPU kernel stream weights across a data dependency for free? A probe for the
decode megakernel route (RESULTS.md, 2026-11-25).

One kernel of P = 128 CTAs streams 4 matrices of the down-projection size (8192 x 2048 bf16, 33.6 MB) through one
TMA pipeline (`plgpu.emit_pipeline`, [64, 128] tiles, `stages` in flight): each CTA owns 64 rows of every matrix and
adds its tiles into a register accumulator. Tiles [64, 128] x 4 or 8 stages, [64, 256] x 4, [64, 128] x 12. Variants:
  no barrier             one continuous stream (the best a persistent kernel can do);
  grid barrier between   every CTA signals a global semaphore after each matrix and waits for all P (a data
                         dependency between matrices, as between a layer's matmuls), the pipeline's prefetch still
                         in flight across it;
  one kernel per matrix  4 launches (a kernel boundary per dependency);
  XLA jnp.sum            XLA's own read of each matrix, one kernel each.
Reports us per matrix against the floor (bytes / 3.11 TB/s) and the error of the sums.

    python lab/probes/mosaic_stream.py --bench        # GPU (jax 0.11.2)
    python lab/probes/mosaic_stream.py --interpret    # CPU: the stream without barrier, Mosaic GPU interpret mode
"""
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def make(nmat, P, RP, C, TR, TC, stages, sync, interpret=False):
    """A kernel summing, per CTA p, the [TR, TC] tiles of rows p*RP.. of nmat matrices [nmat, P*RP, C] -> [P, TR, TC]
    float32; with `sync`, a grid barrier (global semaphore) after each matrix but the last."""
    RT, CT = RP // TR, C // TC
    T = RT * CT  # tiles per matrix per CTA
    N = nmat * T

    def body(w_gmem, o_gmem):
        p = lax.axis_index("p")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if sync else None

        def idx(t):
            m, i = lax.div(t, T), lax.rem(t, T)
            return (m, p * RT + lax.div(i, CT), lax.rem(i, CT))

        def pipe_body(idxs, w_smem, acc):
            (t,) = idxs
            acc = acc + w_smem[0].astype(jnp.float32)
            if sync:
                @pl.when((lax.rem(t + 1, T) == 0) & (t + 1 < N))
                def _():
                    pl.semaphore_signal(sem)
                    pl.semaphore_wait(sem, value=lax.div(t + 1, T) * P, decrement=False)
            return acc

        zeros = jnp.zeros((TR, TC), jnp.float32)
        if not interpret:  # the interpreter has no layout_cast
            zeros = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
        acc = plgpu.emit_pipeline(pipe_body, grid=(N,), in_specs=[plgpu.BlockSpec((1, TR, TC), idx)],
                                  max_concurrent_steps=stages, init_carry=zeros)(w_gmem)
        o_gmem[p] = acc

    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw = dict(interpret=InterpretGPUParams())
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((P, TR, TC), jnp.float32), grid=(P,), grid_names=("p",),
                        **kw)


def _ref(w, P, RP, C, TR, TC):
    return w.astype(jnp.float32).reshape(w.shape[0], P, RP // TR, TR, C // TC, TC).sum(axis=(0, 2, 4))


def interpret_check():
    nmat, P, RP, C, TR, TC = 2, 2, 64, 256, 64, 128
    w = jax.random.normal(jax.random.key(0), (nmat, P * RP, C), jnp.float32).astype(jnp.bfloat16)
    out = jax.jit(make(nmat, P, RP, C, TR, TC, 2, False, interpret=True))(w)
    print("interpret, no barrier: max error", float(jnp.abs(out - _ref(w, P, RP, C, TR, TC)).max()))


def bench():
    R, nmat, P, RP, C = 6, 4, 128, 64, 2048
    ws = [jax.random.normal(jax.random.key(i), (nmat, P * RP, C), jnp.float32).astype(jnp.bfloat16) for i in range(R)]
    ws1 = [w[m:m + 1] + 0 for w in ws for m in range(nmat)]  # separate arrays: a slice fed to a kernel is copied
    mbytes = P * RP * C * 2

    def timeit(f, args):  # us per matrix; R x nmat matrices per jit call
        jax.block_until_ready(f(*args))
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                out = f(*args)
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - t0) / 10)
        return best * 1e6 / (R * nmat)

    res = {}
    for TR, TC, stages in ((64, 128, 4), (64, 128, 8), (64, 256, 4), (64, 128, 12)):
        for sync in (False, True):
            k = make(nmat, P, RP, C, TR, TC, stages, sync)
            f = jax.jit(lambda ws, k=k: [k(w) for w in ws])
            ref = _ref(ws[0], P, RP, C, TR, TC)
            err = float(jnp.abs(f(ws)[0] - ref).max() / jnp.abs(ref).max())
            name = (f"[{TR},{TC}] x{stages}: one kernel, 4 matrices, "
                    f"{'grid barrier between' if sync else 'no barrier'}")
            res[name] = (timeit(f, (ws,)), err)
        k1 = make(1, P, RP, C, TR, TC, stages, False)
        res[f"[{TR},{TC}] x{stages}: one kernel per matrix"] = (
            timeit(jax.jit(lambda ws1, k1=k1: [k1(w) for w in ws1]), (ws1,)), None)
    xr = jax.jit(lambda ws1: [jnp.sum(w, dtype=jnp.float32) for w in ws1])
    res["XLA jnp.sum per matrix"] = (timeit(xr, (ws1,)), None)
    floor = mbytes / 3.11e12 * 1e6
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: matrix {P * RP}x{C} bf16 = {mbytes / 1e6:.1f} MB, "
          f"floor {floor:.2f} us at 3.11 TB/s")
    for name, (us, err) in res.items():
        print(f"{name:60} {us:7.2f} us/matrix  (+{us - floor:5.2f} over floor)"
              + ("" if err is None else f"  err {err:.1e}"))


if __name__ == "__main__":
    interpret_check() if "--interpret" in sys.argv else bench()

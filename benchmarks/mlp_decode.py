"""The decode MLP of Llama-3.2-1B (D 2048, F 8192, bf16): the engine's two-kernel path (the SwiGLU GEMV, then XLA's
down GEMM and the residual add) against the fused MLP kernel (pallas_kernels/mlp_decode.py: one kernel, its
down-projection partials summed into the residual add), per layer, with a config sweep of the fused kernel.

    python benchmarks/mlp_decode.py --m 2 8 32 --out /tmp/mlp.json
    python benchmarks/mlp_decode.py --smoke        # tiny shapes on the CPU (interpret mode)

Fused modes (MlpConfig.mode): "barrier" (gate+up with SwiGLU for the whole F, a grid barrier, the down projection as
a split-K GEMV, in one launch) and "columns" (no barrier: each program's columns straight into its rows of Wd). The
fused paths share one zeroed counter array per jit call, as in the engine step, and it must come back zero.

Timing as in decode_matmul.py: one jit runs the MLP 16 times over 16 layers' weights (so the weights come from HBM,
not L2), each layer's output feeding the next layer's input; us per layer = wall / 16 over repeated jit calls. TB/s =
weight bytes (gate+up + down) / time, beside the read bandwidth of a `jnp.sum` measured in the same run. err = max|out
- ref| / max|ref| of the first layer against `swiglu_mlp_reference`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import sys

import jax

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import device_info, read_bandwidth, write_json  # noqa: E402
from benchmarks.decode_matmul import _normal, _rel_err, _time  # noqa: E402
from jphoton.models.matmul import two_row_dot  # noqa: E402
from pallas_kernels.common import Semaphores  # noqa: E402
from pallas_kernels.gemv import gemv  # noqa: E402
from pallas_kernels.mlp_decode import MlpConfig, swiglu_mlp, swiglu_mlp_reference  # noqa: E402

LAYERS = 16


def sweep_configs(limit: int) -> list[MlpConfig]:
    base = MlpConfig()
    knobs = [dict(prefetch=0), dict(prefetch=4), dict(block_n=128), dict(block_k=256), dict(num_warps=8),
             dict(num_stages=4), dict(block_f=128), dict(block_n=32),
             dict(mode="columns", block_n=256, num_stages=4)]
    return [base] + [MlpConfig(**{**base.__dict__, **k}) for k in knobs][:max(0, limit - 1)]


def _fused(h, wgu, wd, i, *, config, interpret, sems=None):
    return swiglu_mlp(h, wgu, wd, i, config=config, semaphores=sems, interpret=interpret)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--m", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--max-configs", type=int, default=13)
    ap.add_argument("--time-per-config", type=float, default=0.3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
    D, F = (64, 96) if args.smoke else (2048, 8192)
    interpret = True if args.smoke else None
    info = device_info()
    print(info, flush=True)
    bw = read_bandwidth(0.01 if args.smoke else 4.0, reps=2 if args.smoke else 10)
    print(f"read bandwidth (jnp.sum, bf16): {bw / 1e12:.2f} TB/s", flush=True)
    key = jax.random.key(0)
    kg, kd, kx = jax.random.split(key, 3)
    wgu = _normal(kg, (LAYERS, D, 2 * F))
    wd = _normal(kd, (LAYERS, F, D))
    weight_bytes = (D * 2 * F + F * D) * 2
    rows = []

    def chain(mlp, counters=False):
        """h <- h + mlp(h) over the 16 layers, each waiting for the previous one as in the model; the fused kernel
        shares one zeroed counter array per call (as in the engine step) and returns it (it must come back zero)."""
        def f(h, wgu, wd):
            sems = Semaphores() if counters else None
            for i in range(LAYERS):
                h = h + (mlp(h, wgu, wd, i, sems=sems) if counters else mlp(h, wgu, wd, i))
            return (h, sems.take(2)) if counters else h
        return jax.jit(f)

    def two_kernels(h, wgu, wd, i):
        return two_row_dot(gemv(h, wgu, i, glu=True, interpret=interpret), wd[i])

    for m in args.m:
        h = _normal(jax.random.fold_in(kx, m), (m, D)) * 20
        ref = swiglu_mlp_reference(h, wgu, wd, 0)
        paths = {"two kernels (SwiGLU GEMV + XLA down)": two_kernels}
        for c in sweep_configs(1 if args.smoke else args.max_configs):
            paths[f"fused {c.short()}"] = functools.partial(_fused, config=c, interpret=interpret)
        for name, mlp in paths.items():
            row = {"M": m, "path": name}
            try:
                err = _rel_err(jax.jit(functools.partial(mlp, i=0))(h, wgu, wd), ref)
                fused = name.startswith("fused")
                f = chain(mlp, counters=fused)
                if fused:
                    ctr = f(h, wgu, wd)[1]
                    row["counters_zero"] = not bool(jax.device_get(ctr).any())
                    assert row["counters_zero"], f"counters left {ctr}"
                us = _time(f, (h, wgu, wd), LAYERS, args.time_per_config, 200)
                row.update(us=us, tb_s=weight_bytes / us / 1e6, frac_read_bw=weight_bytes / (us * 1e-6) / bw, err=err)
                print(f"M={m:<3} {name:<44} {us:8.2f} us  {row['tb_s']:.2f} TB/s ({100 * row['frac_read_bw']:.0f}% "
                      f"of read)  err {err:.1e}", flush=True)
            except Exception as e:  # a config the compiler rejects: record, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print(f"M={m:<3} {name:<44} FAILED {row['error']}", flush=True)
            rows.append(row)
            gc.collect()
    if args.out:
        write_json(args.out, {"info": info, "read_bw_tb_s": bw / 1e12, "args": vars(args), "rows": rows})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

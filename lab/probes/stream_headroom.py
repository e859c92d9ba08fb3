"""How close can one kernel per matrix get to the read bandwidth at the sizes of a 1B decode layer? A headroom check
for the decode GEMVs: XLA's own full reduction (`jnp.sum`, a pure read) of each Llama-3.2-1B weight matrix, timed as
the GEMVs are in decode_matmul.py (16 different matrices chained in one jit call, so each comes from HBM and each
kernel pays its boundary), beside the engine's kernel for that matrix at M=2 in the same run.

If the pure read of a matrix takes about as long as its GEMV, the GEMV has no headroom left at that size: what
remains above the floor is ramp, tail and the boundary, which no better GEMV removes.

    python lab/probes/stream_headroom.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from benchmarks.common import device_info, read_bandwidth  # noqa: E402
from jphoton.models.matmul import two_row_dot  # noqa: E402
from lab.decode_matmul import _normal, _time  # noqa: E402
from pallas_kernels.gemv import gemv  # noqa: E402

LAYERS = 16
SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    info = device_info()
    bw = read_bandwidth(4.0, reps=10)
    print(info, f"read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    key = jax.random.key(0)
    for name, (K, N) in SHAPES.items():
        key, kw, kx = jax.random.split(key, 3)
        w = _normal(kw, (LAYERS, K, N))
        x = _normal(kx, (2, K))
        nbytes = K * N * 2

        def pure_read(w):
            s = jnp.float32(0)
            for i in range(LAYERS):  # each sum depends on the last, so XLA cannot merge them into one kernel
                s = jnp.sum(w[i] * (1 + 0 * s).astype(w.dtype), dtype=jnp.float32) + s
            return s

        def engine(x, w, glu=name == "gate_up"):  # the engine's kernel at 2 rows ("fused": GEMV for gate+up)
            out = []
            for i in range(LAYERS):
                if glu:
                    out.append(gemv(x, w, i, glu=True))
                else:
                    out.append(two_row_dot(x, w[i]))
            return out

        row = {"matrix": name, "bytes": nbytes, "floor_us": 1e6 * nbytes / bw}
        row["pure_read_us"] = _time(jax.jit(pure_read), (w,), LAYERS, 0.5, 200)
        row["engine_kernel_us"] = _time(jax.jit(engine), (x, w), LAYERS, 0.5, 200)
        rows.append(row)
        print(f"{name:8} {nbytes / 1e6:6.1f} MB  floor {row['floor_us']:6.2f} us  pure read {row['pure_read_us']:6.2f} us"
              f"  engine kernel (M=2) {row['engine_kernel_us']:6.2f} us", flush=True)
        del w
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"info": info, "read_bw_tb_s": bw / 1e12, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

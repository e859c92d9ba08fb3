"""Compile the filtered sampler's Pallas kernel for an H100 without a GPU and report what ptxas says of it (registers,
spill bytes) and the Triton layout conversions in it: a free first look at a kernel variant before device time.

The kernel's Triton IR comes from this tree's jax (lowered for CUDA on the CPU); it is compiled by the `triton` wheel
(3.9 was used; XLA's own Triton inside jaxlib differs, so treat the numbers as a guide) in a separate venv, and the
PTX assembled by the wheel's newer ptxas:

    python -m venv /tmp/trivenv && /tmp/trivenv/bin/pip install triton
    python lab/probes/triton_offline.py --trivenv /tmp/trivenv [--rows 32] [--kw '{"block": 4096}']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 3)[0])

COMPILE = r"""
import re, sys, triton
from triton.backends.compiler import GPUTarget
k = triton.compile(sys.argv[1], target=GPUTarget("cuda", 90, 32), options={"num_warps": int(sys.argv[2]), "num_stages": 1})
open(sys.argv[1] + ".ptx", "w").write(k.asm["ptx"])
print("convert_layout ops:", k.asm["ttgir"].count("convert_layout"), " shared bytes:", k.metadata.shared)
"""


def triton_ir(rows: int, vocab: int, kw: dict) -> str:
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    orig = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        res = orig(*a, **k)
        captured.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    from pallas_kernels.filtered_sample import filtered_sample

    z = jnp.zeros((rows, vocab))
    fn = jax.jit(lambda s, y, k, p: filtered_sample(s, y, k, p, interpret=False, **kw))
    fn.trace(z, z, jnp.zeros(rows, jnp.int32), jnp.full(rows, 0.9)).lower(lowering_platforms=("cuda",))
    return captured[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trivenv", required=True)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--programs", type=int, default=4, help="programs a row (the H100's at 32 rows: 4)")
    ap.add_argument("--kw", default="{}", help="more filtered_sample arguments, as JSON")
    a = ap.parse_args()
    kw = {"programs": a.programs, **json.loads(a.kw)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.ttir")
        with open(path, "w") as f:
            f.write(triton_ir(a.rows, a.vocab, kw))
        py = os.path.join(a.trivenv, "bin", "python")
        env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
        out = subprocess.run([py, "-c", COMPILE, path, str(kw.get("num_warps", 16))], capture_output=True, text=True,
                             env=env)
        print(out.stdout.strip() or out.stderr[-2000:])
        bins = subprocess.run([py, "-c", "import triton, os; print(os.path.dirname(triton.__file__))"],
                              capture_output=True, text=True).stdout.strip() + "/backends/nvidia/bin"
        ptxas = next(os.path.join(bins, n) for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bins, n)))
        res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path + ".ptx", "-o", os.devnull], capture_output=True,
                             text=True)
        print("\n".join(line.strip() for line in res.stderr.splitlines() if "spill" in line or "registers" in line))


if __name__ == "__main__":
    main()

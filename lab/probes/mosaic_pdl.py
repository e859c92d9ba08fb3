"""Does XLA launch a Pallas Mosaic GPU kernel with programmatic dependent launch (frontend attribute xla.pdl_launch)?
Compiles `kernel(x @ w)` for a trivial Mosaic GPU kernel (`plgpu.kernel`, a copy), with and without
`griddepcontrol_wait` in it, beside the same with a Pallas Triton kernel (+1), and prints each custom call's PDL mark
from the compiled HLO and whether the result is right. GPU only.

    python lab/probes/mosaic_pdl.py
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as mgpu
from jax.experimental.pallas import triton as plgpu


def mosaic_kernel(x_ref, o_ref, *, wait):
    """A copy through SMEM (TMA in, TMA out); with `wait`, after griddepcontrol.wait (a no-op without PDL)."""
    if wait:
        mgpu.griddepcontrol_wait()

    def scoped(smem, barrier):
        mgpu.copy_gmem_to_smem(x_ref, smem, barrier)
        mgpu.barrier_wait(barrier)
        mgpu.commit_smem()
        mgpu.copy_smem_to_gmem(smem, o_ref)
        mgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, mgpu.SMEM((8, 256), jnp.float32), mgpu.Barrier(num_arrivals=1))


def triton_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def build(kind: str):
    out = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    if kind == "triton":
        call = pl.pallas_call(triton_kernel, out_shape=out, compiler_params=plgpu.CompilerParams(num_warps=4))
    else:  # jax 0.11: Mosaic GPU kernels through plgpu.kernel (pallas_call has no Mosaic GPU rule there)
        call = mgpu.kernel(functools.partial(mosaic_kernel, wait=kind == "mosaic+wait"), out_type=out)
    return jax.jit(lambda x, w: call(jnp.dot(x, w, preferred_element_type=jnp.float32)))


def main() -> None:
    x = jnp.ones((8, 2048), jnp.bfloat16)
    w = jnp.ones((2048, 256), jnp.bfloat16)
    for kind in ("triton", "mosaic", "mosaic+wait"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f = build(kind)
                text = f.lower(x, w).compile().as_text()
                value = f(x, w)
            ok = bool(jnp.all(value == (2049.0 if kind == "triton" else 2048.0)))
        except Exception as e:  # report and go on: the probe asks what each path does
            import traceback

            print(f"{kind:12} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=-4)
            continue
        for line in text.splitlines():
            if " custom-call(" in line or ("kind=kCustom" in line and " fusion(" in line):
                target = re.search(r'custom_call_target="([^"]+)"', line)
                print(f"{kind:12} result_ok={ok} pdl={'yes' if 'xla.pdl_launch' in line else 'no'} "
                      f"{line.split('=')[0].strip()[:40]:40} {target[1] if target else ''}", flush=True)


if __name__ == "__main__":
    main()

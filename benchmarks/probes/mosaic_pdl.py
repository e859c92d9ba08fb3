"""Does XLA launch a Pallas Mosaic GPU kernel with programmatic dependent launch (frontend attribute xla.pdl_launch)?
Compiles `kernel(x @ w)` for a trivial Mosaic GPU kernel, with and without `griddepcontrol_wait` in it, beside the same
with a Pallas Triton kernel, and prints each custom call's PDL mark from the compiled HLO. GPU only.

    python benchmarks/probes/mosaic_pdl.py
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
    if wait:
        mgpu.griddepcontrol_wait()
    o_ref[...] = x_ref[...] + 1.0


def triton_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def build(kind: str):
    out = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    if kind == "triton":
        call = pl.pallas_call(triton_kernel, out_shape=out, compiler_params=plgpu.CompilerParams(num_warps=4))
    else:
        call = pl.pallas_call(functools.partial(mosaic_kernel, wait=kind == "mosaic+wait"), out_shape=out,
                              compiler_params=mgpu.CompilerParams())
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
            ok = bool(jnp.all(value == 2049.0))
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

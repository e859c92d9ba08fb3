"""The fused decode MLP kernel (pallas_kernels/mlp_decode.py) against its jnp reference, in Pallas interpret mode on
the CPU (the kernel code the GPU compiles): fresh random inputs, sizes that leave partial tiles in every dimension,
stacked weights with a traced layer index, and the two-GEMV path's rounding in bf16."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv import gemv
from pallas_kernels.mlp_decode import MlpConfig, swiglu_mlp, swiglu_mlp_partials, swiglu_mlp_reference


def rel_err(ours, ref) -> float:
    ref = np.asarray(ref, np.float32)
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


def _inputs(m, d, f, *, layers=None, dtype=jnp.float32):
    rng = np.random.default_rng()  # fresh inputs every run
    lead = (layers,) if layers else ()
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    w_gate_up = jnp.asarray(0.1 * rng.standard_normal(lead + (d, 2 * f)), dtype)
    w_down = jnp.asarray(0.1 * rng.standard_normal(lead + (f, d)), dtype)
    return x, w_gate_up, w_down


@pytest.mark.parametrize("mode", ["barrier", "columns"])
@pytest.mark.parametrize("m,d,f,config", [
    (2, 128, 256, MlpConfig(block_f=64, block_k=32, block_n=32)),  # barrier: 4 programs, 4 column blocks x 1 split
    (3, 200, 150, MlpConfig(block_f=32, block_k=32, block_n=128)),  # D, F divide no block: masked tiles everywhere;
    # barrier: 5 programs, 2 column blocks x 2 splits (one program idle in the down phase)
])
def test_fused_mlp_matches_reference(m, d, f, config, mode):
    config = dataclasses.replace(config, mode=mode)
    x, w_gate_up, w_down = _inputs(m, d, f)
    parts = swiglu_mlp_partials(x, w_gate_up, w_down, config=config)
    assert parts.shape[1:] == (m, d) and parts.dtype == jnp.float32
    if mode == "columns":
        assert parts.shape[0] == -(-f // config.block_f)
    # fp32 everywhere: the kernel and the reference differ only in summation order
    assert rel_err(jnp.sum(parts, 0), swiglu_mlp_reference(x, w_gate_up, w_down)) < 1e-5


def test_fused_mlp_bf16_stacked_traced_layer_matches_two_gemvs():
    """bf16 weights stacked [L, ...] at a traced layer: the same result as the engine's two-kernel path (the SwiGLU
    GEMV, then the down GEMV), up to fp32 summation order and one bf16 rounding of the output."""
    x, w_gate_up, w_down = _inputs(5, 256, 192, layers=3, dtype=jnp.bfloat16)
    cfg = MlpConfig(block_f=64, block_k=64, block_n=128)
    out = jax.jit(lambda x, a, b, i: swiglu_mlp(x, a, b, i, config=cfg))(x, w_gate_up, w_down, jnp.int32(1))
    assert out.dtype == jnp.bfloat16 and out.shape == (5, 256)
    two = gemv(gemv(x, w_gate_up, 1, glu=True), w_down, 1)
    ref = swiglu_mlp_reference(x, w_gate_up, w_down, 1)
    assert rel_err(out, ref) < 1e-2 and rel_err(out, two) < 1e-2
    # and not trivially: another layer's weights give a different answer
    assert rel_err(out, swiglu_mlp_reference(x, w_gate_up, w_down, 2)) > 0.5


def test_fused_mlp_rejects_bad_shapes():
    x, w_gate_up, w_down = _inputs(2, 64, 32)
    with pytest.raises(ValueError, match="w_gate_up must be"):
        swiglu_mlp_partials(x, w_gate_up[:, :-1], w_down)
    with pytest.raises(ValueError, match="need `layer`"):
        swiglu_mlp_partials(x, w_gate_up[None], w_down[None])
    with pytest.raises(ValueError, match="rows"):
        swiglu_mlp_partials(jnp.zeros((65, 64)), w_gate_up, w_down)
    with pytest.raises(ValueError, match="power of two"):
        MlpConfig(block_f=48)
    with pytest.raises(ValueError, match="mode"):
        MlpConfig(mode="rows")

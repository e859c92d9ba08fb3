"""The residual add + RMSNorm kernel (pallas_kernels/add_rms_norm.py) against its jnp reference in interpret mode
(the code the GPU compiles): fresh random inputs, bf16 and fp32, a width that is not a power of two (masked tiles),
one or several split-K partials, a stacked weight read at a traced layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference

pytestmark = pytest.mark.usefixtures("drop_compiled_programs_after_each_test")


@pytest.mark.parametrize("m,d,s,dtype", [(2, 256, 4, jnp.bfloat16), (3, 200, 1, jnp.float32), (2, 130, 3, jnp.float32),
                                         (5, 96, 8, jnp.bfloat16)])
def test_add_rms_norm_matches_the_reference(m, d, s, dtype):
    rng = np.random.default_rng()
    h = jnp.asarray(rng.standard_normal((m, d)), dtype)
    parts = jnp.asarray(rng.standard_normal((s, m, d)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal((4, d)), dtype)
    f = jax.jit(lambda h, p, w, layer: add_rms_norm(h, p, w, layer, eps=1e-5, interpret=True))
    h2, normed = f(h, parts, w, jnp.int32(2))
    ref_h, ref_n = add_rms_norm_reference(h, parts, w, 2, eps=1e-5)
    assert h2.dtype == dtype and normed.dtype == dtype and normed.shape == (m, d)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16: one rounding step apart where the sum orders differ
    np.testing.assert_allclose(np.asarray(h2, np.float32), np.asarray(ref_h, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(ref_n, np.float32), rtol=2 * tol, atol=2 * tol)
    # the layer index picks the weight: another layer's differs
    other = add_rms_norm_reference(h, parts, w, 0, eps=1e-5)[1]
    assert np.abs(np.asarray(other, np.float32) - np.asarray(normed, np.float32)).max() > 1e-2


def test_add_rms_norm_rejects_misshaped_inputs():
    h = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match="partials|parts"):
        add_rms_norm(h, jnp.zeros((1, 3, 8)), jnp.ones(8), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(h, jnp.zeros((1, 2, 8)), jnp.ones(9), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="layer"):
        add_rms_norm(h, jnp.zeros((1, 2, 8)), jnp.ones((3, 8)), eps=1e-6, interpret=True)


def test_add_rms_norm_lowers_to_triton_at_the_1b_shape():
    """The GPU lowering (Pallas -> Triton IR) at Llama-3.2-1B's width and the down GEMV's 8 partials, without a GPU."""
    h = jax.ShapeDtypeStruct((2, 2048), jnp.bfloat16)
    parts = jax.ShapeDtypeStruct((8, 2, 2048), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 2048), jnp.bfloat16)
    fn = jax.jit(lambda h, p, w, layer: add_rms_norm(h, p, w, layer, eps=1e-5, interpret=False))
    text = fn.trace(h, parts, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text

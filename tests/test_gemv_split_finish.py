"""The split-K GEMVs finished by their last program (pallas_kernels/gemv_split_finish.py: QKV + RoPE, output projection
+ residual + RMSNorm) against the model's XLA path, in interpret mode on the CPU (the kernel code the GPU compiles):
fresh random inputs, several splits, masked edges, a traced layer index; the counters come back zero."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import Semaphores
from pallas_kernels.gemv import GemvConfig
from pallas_kernels.gemv_split_finish import qkv_rope, qkv_rope_reference, residual_norm, residual_norm_reference


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bf16: one rounding step apart where the XLA path rounds an intermediate the kernel keeps (or vice versa)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=tol)


# (M, K, Hq, Hkv, hd, config, bias, dtype)
QKV_CASES = [
    (3, 256, 4, 2, 32, GemvConfig(block_n=32, block_k=32, split=4), True, jnp.bfloat16),
    (16, 200, 4, 1, 16, GemvConfig(block_n=64, block_k=64, split=3), False, jnp.float32),  # K masked, 4 heads a block
    (2, 128, 8, 2, 64, None, False, jnp.bfloat16),  # the default config
]


@pytest.mark.parametrize("m,k,hq,hkv,hd,cfg,bias,dtype", QKV_CASES)
def test_qkv_rope_matches_the_xla_path(m, k, hq, hkv, hd, cfg, bias, dtype):
    rng = np.random.default_rng()
    n = (hq + 2 * hkv) * hd
    x, w = _normal(rng, (m, k), dtype), _normal(rng, (3, k, n), dtype, 0.05)
    b = _normal(rng, (3, n), dtype, 0.1) if bias else None
    pos = jnp.asarray(rng.integers(0, 4000, m), jnp.int32)
    inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, hd, 2) / hd), jnp.float32)
    shape = dict(num_heads=hq, num_kv_heads=hkv, head_dim=hd)

    def f(x, w, b, layer, pos):
        sems = Semaphores()
        out = qkv_rope(x, w, layer, pos, inv, bias=b, semaphores=sems, config=cfg, interpret=True, **shape)
        return out, sems.take(1)

    out, counters = jax.jit(f)(x, w, b, jnp.int32(1), pos)
    assert out.shape == (m, hq + 2 * hkv, hd) and out.dtype == dtype
    assert not np.asarray(counters).any()
    _close(out, qkv_rope_reference(x, w, 1, pos, inv, bias=b, **shape), dtype)


# (M, K, D, config, dtype)
RESIDUAL_CASES = [
    (3, 256, 96, GemvConfig(block_n=32, block_k=64, split=3), jnp.bfloat16),  # D not a multiple of the block
    (16, 300, 64, GemvConfig(block_n=16, block_k=32, split=4), jnp.float32),  # K masked, 4 column blocks
    (2, 512, 128, None, jnp.bfloat16),
]


@pytest.mark.parametrize("m,k,d,cfg,dtype", RESIDUAL_CASES)
def test_residual_norm_matches_the_xla_path(m, k, d, cfg, dtype):
    rng = np.random.default_rng()
    h, y = _normal(rng, (m, d), dtype), _normal(rng, (m, k), dtype)
    w, g = _normal(rng, (3, k, d), dtype, 0.05), _normal(rng, (3, d), dtype, 0.1) + 1

    def f(h, y, w, g, layer):
        sems = Semaphores()
        h2, normed = residual_norm(h, y, w, layer, g, eps=1e-5, semaphores=sems, config=cfg, interpret=True)
        return h2, normed, sems.take(1)

    h2, normed, counters = jax.jit(f)(h, y, w, g, jnp.int32(2))
    assert not np.asarray(counters).any()
    want_h, want_n = residual_norm_reference(h, y, w, 2, g, eps=1e-5)
    _close(h2, want_h, dtype)
    _close(normed, want_n, dtype)


def test_bad_inputs_raise():
    x, w = jnp.zeros((2, 64)), jnp.zeros((1, 64, 96))
    inv, pos = jnp.zeros(8), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        qkv_rope(x, w, 0, pos, inv, num_heads=2, num_kv_heads=1, head_dim=24, interpret=True)
    with pytest.raises(ValueError, match="positions"):
        qkv_rope(x, jnp.zeros((1, 64, 64)), 0, jnp.zeros(3, jnp.int32), inv, num_heads=2, num_kv_heads=1,
                 head_dim=16, interpret=True)
    with pytest.raises(ValueError, match="rows"):
        residual_norm(jnp.zeros((17, 96)), jnp.zeros((17, 64)), w, 0, jnp.ones((1, 96)), eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="norm"):
        residual_norm(jnp.zeros((2, 96)), x, w, 0, jnp.ones((1, 95)), eps=1e-5, interpret=True)


def test_both_lower_to_triton_at_the_1b_shapes():
    """The GPU lowering (Pallas -> Triton IR, atomics and barrier included) at Llama-3.2-1B's shapes, without a GPU."""
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    f = jax.jit(lambda x, w, layer, pos, inv: qkv_rope(x, w, layer, pos, inv, num_heads=32, num_kv_heads=8,
                                                        head_dim=64, interpret=False))
    args = S((2, 2048), bf), S((16, 2048, 3072), bf), S((), jnp.int32), S((2,), jnp.int32), S((32,), jnp.float32)
    assert "triton" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    f = jax.jit(lambda h, y, w, layer, g: residual_norm(h, y, w, layer, g, eps=1e-5, interpret=False))
    args = S((2, 2048), bf), S((2, 8192), bf), S((16, 8192, 2048), bf), S((), jnp.int32), S((16, 2048), bf)
    assert "triton" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

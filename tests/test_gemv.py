"""The decode GEMV kernel (pallas_kernels/gemv.py) against the jnp reference, in Pallas interpret mode on the CPU (the
same kernel code the GPU compiles): fresh random inputs, odd sizes (masked tiles), split-K, both modes, both layouts,
stacked weights with a traced layer index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv import MAX_ROWS, GemvConfig, default_config, gemv, gemv_reference

pytestmark = pytest.mark.usefixtures("drop_compiled_programs_after_each_test")


def rel_err(ours, ref) -> float:
    ref = np.asarray(ref, np.float32)
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


def _inputs(m, k, n, *, transposed=False, layers=None, dtype=jnp.float32):
    rng = np.random.default_rng()  # fresh inputs every run
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    wshape = (n, k) if transposed else (k, n)
    w = jnp.asarray(0.05 * rng.standard_normal(((layers,) if layers else ()) + wshape), dtype)
    return x, w


# (M, K, N, config): odd K/N (masked loads), splits that do not divide the chunks, and scaled-down Llama shapes.
CASES = [
    (1, 300, 200, None),
    (3, 257, 131, GemvConfig(mode="fma", block_n=32, block_k=64, split=3)),
    (16, 300, 200, GemvConfig(block_n=64, block_k=64, split=2)),
    (32, 190, 77, GemvConfig(block_n=32, block_k=32, split=4, unroll=True)),
    (1, 256, 384, GemvConfig(mode="fma", block_n=64, block_k=64, split=2, unroll=True)),  # "qkv" 2048x3072 / 8
    (16, 1024, 256, None),  # "down" 8192x2048 / 8: default config splits K
    (32, 256, 2048, GemvConfig(block_n=128, block_k=128)),  # "gate_up" 2048x16384 / 8
]


@pytest.mark.parametrize("m,k,n,config", CASES)
def test_gemv_matches_reference(m, k, n, config):
    x, w = _inputs(m, k, n)
    assert rel_err(gemv(x, w, config=config), gemv_reference(x, w)) < 1e-5


@pytest.mark.parametrize("mode", ["fma", "dot"])
def test_transposed_stacked_with_traced_layer_and_fp32_out(mode):
    """The LM-head case: a tied embedding [N, K] used as W^T, logits in float32 from bf16 inputs; and a stacked weight
    indexed by a traced layer inside jit."""
    m = 3 if mode == "fma" else 8
    x, w = _inputs(m, 96, 203, transposed=True, layers=3, dtype=jnp.bfloat16)
    cfg = GemvConfig(mode=mode, block_n=32, block_k=32, split=2)
    f = jax.jit(lambda x, w, layer: gemv(x, w, layer, transposed=True, out_dtype=jnp.float32, config=cfg))
    out = f(x, w, jnp.int32(2))
    assert out.dtype == jnp.float32 and out.shape == (m, 203)
    ref = gemv_reference(x, w, 2, transposed=True, out_dtype=jnp.float32)
    assert rel_err(out, ref) < 1e-2  # bf16 operands, fp32 accumulation in both; only the summation order differs


def test_bf16_output_dtype_and_default_config_limits():
    x, w = _inputs(4, 128, 64, dtype=jnp.bfloat16)
    out = gemv(x, w)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, gemv_reference(x, w)) < 2e-2
    for m in (1, 8, 32, MAX_ROWS):  # the table's split keeps >= 4 chunks per split and fills the SMs when it can
        for k, n in ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)):
            c = default_config(m, k, n)
            assert k // c.split >= 4 * c.block_k
    with pytest.raises(ValueError):
        gemv(jnp.zeros((MAX_ROWS + 1, 8)), jnp.zeros((8, 8)))
    with pytest.raises(ValueError):
        GemvConfig(block_n=48)


@pytest.mark.parametrize("m,k,n,config", [(2, 300, 200, GemvConfig(block_n=64, block_k=64, split=3)),
                                          (5, 256, 96, GemvConfig(block_n=32, block_k=64, split=1))])
def test_partials_are_the_split_k_sums(m, k, n, config):
    """partials=True: float32 [split, M, N] partial products (split 1 included) that sum to the product; a stacked
    weight at a traced layer."""
    x, w = _inputs(m, k, n, layers=3, dtype=jnp.bfloat16)
    parts = jax.jit(lambda x, w, layer: gemv(x, w, layer, partials=True, config=config))(x, w, jnp.int32(1))
    assert parts.dtype == jnp.float32 and parts.shape == (config.split, m, n)
    ref = gemv_reference(x, w, 1, out_dtype=jnp.float32)
    assert rel_err(parts.sum(0), ref) < 1e-5
    if config.split > 1:  # each partial covers only its K range: none is the whole product
        assert rel_err(parts[0], ref) > 1e-2
    with pytest.raises(ValueError, match="glu"):
        gemv(x, w, 1, glu=True, partials=True)


@pytest.mark.parametrize("m,k,n,config", [(1, 300, 100, None), (5, 256, 96, GemvConfig(block_n=32, block_k=64, split=4)),
                                          (2, 128, 200, GemvConfig(block_n=64, block_k=32, mode="fma"))])
def test_swiglu_epilogue_matches_the_reference(m, k, n, config):
    """glu: a fused [K, 2N] gate|up weight (stacked, traced layer) -> silu(x @ gate) * (x @ up) [M, N]; a config
    asking for split-K or the fma mode is overridden (the activation needs whole sums), odd N masks the tiles."""
    x, w = _inputs(m, k, 2 * n, layers=3)
    layer = jnp.int32(2)
    out = jax.jit(lambda x, w, layer: gemv(x, w, layer, glu=True, config=config, interpret=True))(x, w, layer)
    ref = gemv_reference(x, w, layer, glu=True)
    assert out.shape == (m, n)
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="glu"):
        gemv(x, w[:, :, :-1], layer, glu=True, interpret=True)


@pytest.mark.parametrize("glu", [False, True])
def test_gemv_lowers_to_triton_at_the_1b_shapes(glu):
    """The GPU lowering (Pallas -> Triton IR) of the gate+up GEMV at Llama-3.2-1B's shape, checked without a GPU."""
    x = jax.ShapeDtypeStruct((2, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((16, 2048, 16384), jnp.bfloat16)
    fn = jax.jit(lambda x, w, layer: gemv(x, w, layer, glu=glu, interpret=False))
    text = fn.trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_a_layer_loop_traces_and_lowers_each_kernel_once():
    """`traced_once` (pallas_kernels/common.py): a program that calls the GEMV, the add + RMSNorm and the paged
    attention kernels once per layer holds each Triton kernel once (called per layer), not once per layer: a step
    shape's Python trace no longer grows with the layer count."""
    from pallas_kernels.add_rms_norm import add_rms_norm
    from pallas_kernels.paged_decode_attention import paged_decode_attention

    L, dt = 6, jnp.bfloat16

    def layers(x, w, norms, qkv, k_pool, v_pool, table, ctx):
        for i in range(L):
            x, _ = add_rms_norm(x, gemv(x, w[i], partials=True, interpret=False), norms, i, eps=1e-6, interpret=False)
            out, (k_pool, v_pool) = paged_decode_attention(qkv, k_pool, v_pool, i, table, ctx, page_size=16,
                                                           new_kv="packed", interpret=False)
            qkv = qkv + out.sum()  # (each layer reads the last: one kernel variant for every layer)
        return x, qkv, k_pool, v_pool  # (an unused output would make the last call a pruned variant)

    S = jax.ShapeDtypeStruct
    args = (S((2, 256), dt), S((L, 256, 256), dt), S((L, 256), dt), S((2, 8 + 4, 64), dt),
            S((L, 64 * 16, 2, 64), dt), S((L, 64 * 16, 2, 64), dt), S((2, 8), jnp.int32), S((2,), jnp.int32))
    text = jax.jit(layers).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # (18 before: three kernels in each of 6 layers)
    assert text.count("call @gemv(") == text.count("call @add_rms_norm(") == L

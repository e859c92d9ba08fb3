"""The Pallas paged prefill attention kernel (interpret mode on the CPU: the same kernel code the GPU compiles) against
its float32 reference and the engine's plain-JAX attention, and its Triton lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphoton.engine.attention import paged_attention_static
from pallas_kernels.paged_prefill_attention import (
    PagedPrefillConfig,
    default_config,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)


def make_inputs(seed, *, T, Hq, Hkv, hd, page_size, P, dtype, starts, lens, layers=3, spare_pages=2):
    """A pool with random contents; each row owns the pages of positions < start + len at random places (shuffled
    block tables); the rest of its table, and every padding row's, points at the trash page (the last one)."""
    rng = np.random.default_rng(seed)
    R = len(starts)
    num_pages = R * P + spare_pages
    slots = (num_pages + 1) * page_size
    k = jnp.asarray(rng.standard_normal((layers, slots, Hkv, hd)), dtype)
    v = jnp.asarray(rng.standard_normal((layers, slots, Hkv, hd)), dtype)
    q = jnp.asarray(rng.standard_normal((R, T, Hq, hd)), dtype)
    perm = rng.permutation(num_pages)
    table = np.full((R, P), num_pages, np.int32)
    used = 0
    for r, (s, n) in enumerate(zip(starts, lens, strict=True)):
        pages = -(-(s + n) // page_size)
        table[r, :pages] = perm[used:used + pages]
        used += pages
    return q, k, v, jnp.asarray(table), jnp.asarray(starts, jnp.int32), jnp.asarray(lens, jnp.int32)


# (Hq, Hkv, hd, page_size, P, dtype, config, window). Rows: a whole first chunk, a later chunk (keys before it), a
# short chunk far in, a chunk shorter than T, a padding row (length 0).
CASES = {
    "g4_f32": (8, 2, 16, 4, 12, jnp.float32, PagedPrefillConfig(tile_rows=16, block_kv=16), None),
    "g3_hd24_page3_default": (6, 2, 24, 3, 16, jnp.float32, None, None),
    "g4_f32_window": (8, 2, 16, 4, 12, jnp.float32, PagedPrefillConfig(tile_rows=16, block_kv=16), 5),
    "g3_bf16_tile32": (9, 3, 16, 4, 12, jnp.bfloat16, PagedPrefillConfig(tile_rows=32, block_kv=16), None),
    "g1_f32": (4, 4, 16, 4, 12, jnp.float32, PagedPrefillConfig(tile_rows=16, block_kv=32), None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    Hq, Hkv, hd, ps, P, dtype, cfg, window = CASES[name]
    starts, lens = [0, 10, 29, 3, 0], [10, 10, 4, 7, 0]
    q, k, v, table, s, n = make_inputs(len(name), T=10, Hq=Hq, Hkv=Hkv, hd=hd, page_size=ps, P=P, dtype=dtype,
                                       starts=starts, lens=lens)
    out = paged_prefill_attention(q, k, v, 1, table, s, n, page_size=ps, sliding_window=window, config=cfg,
                                  interpret=True)
    ref = paged_prefill_attention_reference(q, k, v, 1, table, s, n, page_size=ps, sliding_window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol, rtol=tol)
    live = np.arange(10)[None, :] < np.asarray(lens)[:, None]
    assert not np.asarray(out, np.float32)[~live].any()  # past each row's length (and padding rows): zeros


@pytest.mark.parametrize("jit", [False, True])
def test_image_prefix_matches_reference(jit):
    """prefix (an image's positions, attending bidirectionally) as an array, given eagerly and traced inside a jit (the
    engine's step; a prefix once passed as a static option failed there, on the GPU only)."""
    starts, lens, prefix = [0, 10, 29, 3, 0], [10, 10, 4, 7, 0], [8, 12, 31, 0, 0]
    q, k, v, table, s, n = make_inputs(5, T=10, Hq=8, Hkv=2, hd=16, page_size=4, P=12, dtype=jnp.float32,
                                       starts=starts, lens=lens)
    cfg, pre = PagedPrefillConfig(tile_rows=16, block_kv=16), jnp.asarray(prefix, jnp.int32)

    def run(pre):
        return paged_prefill_attention(q, k, v, 1, table, s, n, page_size=4, prefix=pre, config=cfg, interpret=True)

    out = (jax.jit(run) if jit else run)(pre)
    ref = paged_prefill_attention_reference(q, k, v, 1, table, s, n, page_size=4, prefix=pre)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    causal = paged_prefill_attention_reference(q, k, v, 1, table, s, n, page_size=4)
    assert not np.allclose(np.asarray(ref[0, :8]), np.asarray(causal[0, :8]))  # (the prefix changes what rows see)


def test_traced_layer_and_jit():
    """layer as a traced scalar inside jit (the engine's scanned layer loop)."""
    q, k, v, table, s, n = make_inputs(3, T=8, Hq=8, Hkv=2, hd=16, page_size=4, P=6, dtype=jnp.float32,
                                       starts=[0, 5], lens=[8, 3])
    cfg = PagedPrefillConfig(tile_rows=16, block_kv=16)
    fn = jax.jit(lambda layer: paged_prefill_attention(q, k, v, layer, table, s, n, page_size=4, config=cfg,
                                                       interpret=True))
    for layer in (0, 2):
        ref = paged_prefill_attention_reference(q, k, v, layer, table, s, n, page_size=4)
        np.testing.assert_allclose(np.asarray(fn(jnp.int32(layer))), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_engine_static_attention(window):
    """For prefill rows the oracle is the engine's plain-JAX attention over a context bucket (live queries)."""
    starts, lens = [0, 9, 2], [7, 7, 0]
    q, k, v, table, s, n = make_inputs(5, T=7, Hq=6, Hkv=2, hd=16, page_size=4, P=8, dtype=jnp.float32,
                                       starts=starts, lens=lens)
    pos = s[:, None] + jnp.arange(7)[None, :]
    with jax.default_matmul_precision("float32"):  # a GPU's default for float32 dots is TF32 (~1e-3)
        ref = np.asarray(paged_prefill_attention_reference(q, k, v, 2, table, s, n, page_size=4,
                                                           sliding_window=window))
        eng = np.asarray(paged_attention_static(q, k, v, 2, table, pos, s + n, page_size=4, num_pages=8,
                                                sliding_window=window))
    live = np.arange(7)[None, :] < np.asarray(lens)[:, None]
    np.testing.assert_allclose(ref[live], eng[live], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 128, 32, 8, 64), (4, 128, 9, 3, 64), (1, 512, 32, 8, 128)])
def test_kernel_lowers_to_triton(shape):
    """The GPU lowering (Pallas -> Triton IR) at real attention shapes (Llama-3.2-1B, SmolLM2, 8B), without a GPU."""
    R, T, Hq, Hkv, hd = shape
    dt = jnp.bfloat16
    pool = jax.ShapeDtypeStruct((16, 65 * 16, Hkv, hd), dt)
    ints = jax.ShapeDtypeStruct((R,), jnp.int32)
    args = (jax.ShapeDtypeStruct((R, T, Hq, hd), dt), pool, pool, jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((R, 64), jnp.int32), ints, ints)
    fn = jax.jit(lambda *a: paged_prefill_attention(*a, page_size=16, sliding_window=100, interpret=False))
    assert "triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_default_config():
    assert default_config(4).tile_rows == 64  # 16 positions of a Llama-3.2-1B group
    assert default_config(3).tile_rows == 64
    assert default_config(16).tile_rows // 16 >= 8


def test_bad_inputs_raise():
    q, k, v, table, s, n = make_inputs(0, T=4, Hq=4, Hkv=2, hd=16, page_size=4, P=2, dtype=jnp.float32,
                                       starts=[0, 1], lens=[4, 2])
    call = dict(page_size=4, interpret=True)
    with pytest.raises(ValueError, match="chunk of query tokens"):
        paged_prefill_attention(q[:, 0], k, v, 0, table, s, n, **call)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_prefill_attention(q[:, :, :3], k, v, 0, table, s, n, **call)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_prefill_attention(q, k, v.astype(jnp.bfloat16), 0, table, s, n, **call)
    with pytest.raises(ValueError, match="q_len"):
        paged_prefill_attention(q, k, v, 0, table, s, n[:1], **call)
    with pytest.raises(ValueError, match="q_start must be integers"):
        paged_prefill_attention(q, k, v, 0, table, s.astype(jnp.float32), n, **call)
    with pytest.raises(ValueError, match="hold one query"):
        paged_prefill_attention(jnp.zeros((2, 4, 64, 16)), k, v, 0, table, s, n,
                                config=PagedPrefillConfig(tile_rows=16), **call)
    with pytest.raises(ValueError, match="power of two"):
        PagedPrefillConfig(block_kv=24)

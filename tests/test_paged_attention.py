"""The Pallas paged decode attention kernel (interpret mode on the CPU: the same kernel code the GPU compiles) against
its float32 jnp reference on fresh random pools, the reference against the engine's plain-JAX paged attention, the
kernel's lowering to Triton IR, and the engine end to end with attention="pallas"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.engine.attention import paged_attention_static
from pallas_kernels.paged_decode_attention import (
    PagedDecodeConfig,
    default_config,
    paged_decode_attention,
    paged_decode_attention_reference,
)

from conftest import FIXTURES, make_llm

pytestmark = pytest.mark.usefixtures("drop_compiled_programs_after_each_test")


def make_inputs(seed, *, R, Hq, Hkv, hd, page_size, P, dtype, lengths, layers=3, spare_pages=3):
    """A pool with random contents; each row owns len/page_size pages at random places (shuffled block tables); the
    rest of its table, and every padding row's, points at the shared trash page (the last page)."""
    rng = np.random.default_rng(seed)
    num_pages = R * P + spare_pages
    slots = (num_pages + 1) * page_size
    k = jnp.asarray(rng.standard_normal((layers, slots, Hkv, hd)), dtype)
    v = jnp.asarray(rng.standard_normal((layers, slots, Hkv, hd)), dtype)
    q = jnp.asarray(rng.standard_normal((R, Hq, hd)), dtype)
    perm = rng.permutation(num_pages)
    table = np.full((R, P), num_pages, np.int32)  # trash page
    used = 0
    for r, n in enumerate(lengths):
        pages = -(-n // page_size)
        table[r, :pages] = perm[used:used + pages]
        used += pages
    return q, k, v, jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


# (Hq, Hkv, hd, page_size, P, dtype, config, window). Lengths per case: 0, 1, a page boundary, two pages, the whole
# table, and random ones; the splits cut the rows into several runs each.
CASES = {
    "g1_f32_s1": (4, 4, 16, 4, 6, jnp.float32, PagedDecodeConfig(block_tokens=16, splits=1), None),
    "g4_bf16_s3": (8, 2, 16, 4, 20, jnp.bfloat16, PagedDecodeConfig(block_tokens=16, splits=3), None),
    "odd_h6kv2_hd24_page3": (6, 2, 24, 3, 7, jnp.float32, PagedDecodeConfig(block_tokens=16, splits=2), None),
    "g4_f32_window": (8, 2, 16, 4, 8, jnp.float32, PagedDecodeConfig(block_tokens=16, splits=2), 9),
    "g4_bf16_default_config": (8, 2, 32, 8, 6, jnp.bfloat16, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    Hq, Hkv, hd, ps, P, dtype, cfg, window = CASES[name]
    full = P * ps
    rng = np.random.default_rng(len(name))
    lengths = [0, 1, ps, 2 * ps + 1, full, *rng.integers(1, full + 1, size=2)]
    q, k, v, table, ctx = make_inputs(list(CASES).index(name), R=len(lengths), Hq=Hq, Hkv=Hkv, hd=hd, page_size=ps, P=P,
                                      dtype=dtype, lengths=lengths)
    layer = jnp.int32(1)  # traced under jit, as in the engine's layer scan
    kernel = jax.jit(lambda q, k, v, layer, t, c: paged_decode_attention(
        q, k, v, layer, t, c, page_size=ps, sliding_window=window, config=cfg, interpret=True))
    out = kernel(q, k, v, layer, table, ctx)
    ref = paged_decode_attention_reference(q, k, v, layer, table, ctx, page_size=ps, sliding_window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    assert not out[0].any(), "a row with ctx_len 0 must give zeros"
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(out, np.asarray(ref), atol=tol, rtol=tol)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["g1_f32_s1", "g4_bf16_s3", "odd_h6kv2_hd24_page3", "g4_f32_window"])
def test_kernel_writes_the_current_token_and_attends_to_it(name, packed):
    """new_kv: the kernel takes each row's current key/value from its inputs (not the pool) and stores them at the
    row's position ctx_len - 1 in place; pools and output must equal a scatter followed by the reference. packed: q,
    k and v of the token in one [R, Hq + 2 Hkv, hd] array."""
    Hq, Hkv, hd, ps, P, dtype, cfg, window = CASES[name]
    full = P * ps
    lengths = [0, 1, ps, 2 * ps + 1, full, 5]
    q, k, v, table, ctx = make_inputs(11 + len(name), R=len(lengths), Hq=Hq, Hkv=Hkv, hd=hd, page_size=ps, P=P,
                                      dtype=dtype, lengths=lengths)
    rng = np.random.default_rng(5)
    k_new = jnp.asarray(rng.standard_normal((len(lengths), Hkv, hd)), dtype)
    v_new = jnp.asarray(rng.standard_normal((len(lengths), Hkv, hd)), dtype)
    layer = jnp.int32(2)
    if packed:
        kernel = jax.jit(lambda q, k, v, layer, t, c, kn, vn: paged_decode_attention(
            jnp.concatenate([q, kn, vn], axis=1), k, v, layer, t, c, page_size=ps, sliding_window=window,
            new_kv="packed", config=cfg, interpret=True))
    else:
        kernel = jax.jit(lambda q, k, v, layer, t, c, kn, vn: paged_decode_attention(
            q, k, v, layer, t, c, page_size=ps, sliding_window=window, new_kv=(kn, vn), config=cfg, interpret=True))
    out, (k_out, v_out) = kernel(q, k, v, layer, table, ctx, k_new, v_new)
    assert out.shape == q.shape
    k_want, v_want = np.array(k), np.array(v)
    for r, n in enumerate(lengths):
        if n:
            slot = int(table[r, (n - 1) // ps]) * ps + (n - 1) % ps
            k_want[2, slot], v_want[2, slot] = np.asarray(k_new[r]), np.asarray(v_new[r])
    np.testing.assert_array_equal(np.asarray(k_out), k_want)
    np.testing.assert_array_equal(np.asarray(v_out), v_want)
    ref = paged_decode_attention_reference(q, jnp.asarray(k_want), jnp.asarray(v_want), layer, table, ctx,
                                           page_size=ps, sliding_window=window)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), atol=tol, rtol=tol)


def test_max_pages_bounds_the_keys_looked_at():
    q, k, v, table, ctx = make_inputs(3, R=2, Hq=4, Hkv=2, hd=16, page_size=4, P=6, dtype=jnp.float32,
                                      lengths=[24, 9])
    cfg = PagedDecodeConfig(block_tokens=16, splits=2)
    out = paged_decode_attention(q, k, v, 0, table, ctx, page_size=4, max_pages=3, config=cfg, interpret=True)
    ref = paged_decode_attention_reference(q, k, v, 0, table, jnp.minimum(ctx, 12), page_size=4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_engine_static_attention(window):
    """For decode rows (one query at position ctx_len - 1) the oracle is the engine's plain-JAX attention."""
    lengths = [0, 1, 4, 13, 32]
    q, k, v, table, ctx = make_inputs(7, R=len(lengths), Hq=6, Hkv=2, hd=16, page_size=4, P=8, dtype=jnp.float32,
                                      lengths=lengths)
    ref = paged_decode_attention_reference(q, k, v, 2, table, ctx, page_size=4, sliding_window=window)
    eng = paged_attention_static(q[:, None], k, v, 2, table, (ctx - 1)[:, None], ctx, page_size=4, num_pages=8,
                                 sliding_window=window)[:, 0]
    np.testing.assert_allclose(np.asarray(ref)[1:], np.asarray(eng)[1:], atol=1e-5, rtol=1e-5)
    assert not np.asarray(ref)[0].any()


@pytest.mark.parametrize("splits", [1, 8])
def test_kernel_lowers_to_triton(splits):
    """The GPU lowering (Pallas -> Triton IR) at the Llama-3.2-1B attention shape, checked without a GPU."""
    dt = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((4, 32, 64), dt), jax.ShapeDtypeStruct((16, 65 * 16, 8, 64), dt),
            jax.ShapeDtypeStruct((16, 65 * 16, 8, 64), dt), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((4, 64), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    fn = jax.jit(lambda *a: paged_decode_attention(*a, page_size=16, sliding_window=100,
                                                   config=PagedDecodeConfig(splits=splits), interpret=False))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    new = jax.ShapeDtypeStruct((4, 8, 64), dt)
    fn = jax.jit(lambda *a: paged_decode_attention(*a[:6], page_size=16, new_kv=a[6:],
                                                   config=PagedDecodeConfig(splits=splits), interpret=False))
    assert "triton" in fn.trace(*args, new, new).lower(lowering_platforms=("cuda",)).as_text()


def test_default_config():
    assert default_config(1, 8, 8192).splits >= 32  # >= 2 programs per SM of an H100 at B=1
    assert default_config(128, 8, 8192).splits == 1
    assert default_config(1, 8, 16).splits == 1
    for rows, ctx in ((1, 512), (8, 2048), (32, 8192)):
        cfg = default_config(rows, 8, ctx)
        assert cfg.splits * 2 * cfg.block_tokens <= ctx


def test_bad_inputs_raise():
    q, k, v, table, ctx = make_inputs(0, R=2, Hq=4, Hkv=2, hd=16, page_size=4, P=2, dtype=jnp.float32, lengths=[1, 2])
    call = dict(page_size=4, interpret=True)
    with pytest.raises(ValueError, match="one query token"):
        paged_decode_attention(q[:, None], k, v, 0, table, ctx, **call)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(q[:, :3], k, v, 0, table, ctx, **call)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :8], k, v, 0, table, ctx, **call)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_decode_attention(q, k, v.astype(jnp.bfloat16), 0, table, ctx, **call)
    with pytest.raises(ValueError, match="page_size"):
        paged_decode_attention(q, k, v, 0, table, ctx, page_size=3, interpret=True)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(q, k, v, 0, table[:1], ctx, **call)
    with pytest.raises(ValueError, match="ctx_len"):
        paged_decode_attention(q, k, v, 0, table, ctx.astype(jnp.float32), **call)
    with pytest.raises(ValueError, match="max_pages"):
        paged_decode_attention(q, k, v, 0, table, ctx, max_pages=3, **call)
    with pytest.raises(ValueError, match="power of two"):
        PagedDecodeConfig(block_tokens=24)


@pytest.mark.parametrize("matmul", [None, "fused"])
@pytest.mark.parametrize("family", ["mistral"])  # GQA 2, sliding window 16 (crossed by the prompts below)
def test_engine_pallas_decode_matches_default_path(family, matmul):
    """attention="pallas" end to end on the CPU (interpret mode): decode rows through the decode kernel, prefill rows
    through the prefill kernel, no step with a context bucket; greedy tokens equal the default (dynamic) path's.
    matmul "fused" (the GPU default, its GEMVs in interpret mode) with unrolled layers: the kernels beside the matmul
    kernels, layer index a Python int."""
    from conftest import tiny_reference

    ref = tiny_reference(family)
    prompts = [{"prompt_token_ids": p.tolist()} for p, _, _ in ref]
    params = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
    extra = {"matmul": matmul, "unroll_layers": True} if matmul else {}
    llm = make_llm(str(FIXTURES / "tiny" / family), warmup=False, attention="pallas", **extra)
    assert llm.engine.runner.static.pallas_attention and not llm.engine.scheduler.config.context_buckets
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [t.tolist() for _, t, _ in ref]
    shapes = set(llm.engine.runner.packer._layouts)
    assert any(s.decode_rows and not s.prefill_rows and s.ctx_pages == 0 for s in shapes)
    assert any(s.prefill_rows for s in shapes) and not any(s.ctx_pages for s in shapes)


def test_engine_pallas_prefill_chunks_and_cached_prefix():
    """Prefill rows through the kernel where they start past 0: a 70-token prompt in 16- and 32-token chunks (each
    chunk attends to the earlier ones' pages), then a prompt whose first 48 tokens come from the prefix cache, with
    Mistral's sliding window (16) crossed; greedy tokens equal the dynamic loop's, step by step the same plan."""
    rng = np.random.default_rng(3)
    a = rng.integers(1, 200, 70).tolist()
    b = a[:48] + rng.integers(1, 200, 21).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = {}
    for attention in ("pallas", "dynamic"):
        llm = make_llm(str(FIXTURES / "tiny" / "mistral"), warmup=False, attention=attention,
                       prefill_buckets=((1, 16), (2, 32)), max_num_batched_tokens=64)
        runs[attention] = [llm.generate([{"prompt_token_ids": p}], params)[0].token_ids for p in (a, b)]
        assert llm.stats()["prefix_hit_tokens"] >= 48
    assert runs["pallas"] == runs["dynamic"]

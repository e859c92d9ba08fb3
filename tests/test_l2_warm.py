"""L2 warming from spare programs (pallas_kernels/l2_warm.py): the warm programs read exactly the rows they are given
(their digest against jnp), and an attention kernel that warms gives the same outputs and pool writes as one that
does not; its Triton lowering at the 1B shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from test_paged_attention import make_inputs

from pallas_kernels import l2_warm
from pallas_kernels.paged_decode_attention import PagedDecodeConfig, paged_decode_attention


@pytest.mark.parametrize("parts", [1, 3, 5])
def test_warm_programs_read_their_rows(parts):
    rng = np.random.default_rng(parts)
    a = jnp.asarray(rng.standard_normal((3, 40 * l2_warm.ROW)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((3, 16, l2_warm.ROW)), jnp.bfloat16)
    views = [l2_warm.as_rows(a, None), l2_warm.as_rows(b, 7 * l2_warm.ROW * 2)]  # all 40 rows of a, 7 of b's 16
    assert [n for _, n in views] == [40, 7]
    limits = tuple(n for _, n in views)

    def kernel(layer_ref, a_ref, b_ref, out_ref):
        l2_warm.warm((a_ref, b_ref), limits, layer_ref[0], pl.program_id(0), parts, out_ref)

    layer = jnp.asarray([2], jnp.int32)
    out = pl.pallas_call(kernel, grid=(parts,), interpret=True,
                         out_shape=jax.ShapeDtypeStruct((parts, l2_warm.ROW), jnp.float32))(layer, *(v for v, _ in views))
    want = l2_warm.reference_digest(views, 2, parts)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_as_rows_skips_what_it_cannot_view():
    assert l2_warm.as_rows(jnp.zeros((2, 3, 100)), None) is None  # 300 elements a layer: not a multiple of ROW
    assert l2_warm.as_rows(jnp.zeros((2, l2_warm.ROW)), 16) is None  # the limit is less than a row


def test_attention_that_warms_matches_attention_that_does_not():
    Hq, Hkv, hd, ps, P = 8, 2, 16, 4, 8
    lengths = [0, 1, 9, 32]
    q, k, v, table, ctx = make_inputs(7, R=len(lengths), Hq=Hq, Hkv=Hkv, hd=hd, page_size=ps, P=P,
                                      dtype=jnp.bfloat16, lengths=lengths)
    rng = np.random.default_rng(1)
    kn = jnp.asarray(rng.standard_normal((len(lengths), 2 * Hkv, hd)), jnp.bfloat16)
    packed = jnp.concatenate([q, kn], axis=1)
    weights = jnp.asarray(rng.standard_normal((3, 4, 2 * l2_warm.ROW)), jnp.bfloat16)
    cfg = PagedDecodeConfig(block_tokens=16, splits=2)

    @functools.partial(jax.jit, static_argnames="warm")
    def run(packed, k, v, table, ctx, weights, warm):
        return paged_decode_attention(packed, k, v, jnp.int32(1), table, ctx, page_size=ps, new_kv="packed",
                                      config=cfg, interpret=True,
                                      warm=((weights, None),) if warm else (), warm_programs=5 if warm else None)

    plain = run(packed, k, v, table, ctx, weights, False)
    warmed = run(packed, k, v, table, ctx, weights, True)
    for x, y in zip(jax.tree.leaves(plain), jax.tree.leaves(warmed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_attention_that_warms_lowers_to_triton():
    dt = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((2, 48, 64), dt), jax.ShapeDtypeStruct((16, 65 * 16, 8, 64), dt),
            jax.ShapeDtypeStruct((16, 65 * 16, 8, 64), dt), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((2, 64), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
            jax.ShapeDtypeStruct((16, 2048, 2048), dt), jax.ShapeDtypeStruct((16, 2048, 16384), dt))
    fn = jax.jit(lambda *a: paged_decode_attention(*a[:6], page_size=16, new_kv="packed", interpret=False,
                                                   warm=((a[6], None), (a[7], 8 << 20))))
    assert "triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_engine_greedy_tokens_with_l2_warming_match_hf(caplog):
    """The engine with attention="pallas" and a matmul hook that asks the attention kernel to warm the L2 with the
    layer's O and part of its gate+up weights: greedy tokens equal HF's (the fixture), and the warming path ran."""
    import logging

    from jphoton import SamplingParams
    from jphoton.models.matmul import XlaMatmul

    from conftest import FIXTURES, make_llm, tiny_reference

    ref = tiny_reference("mistral")
    hook = XlaMatmul(glu_gemv=True, warm_l2=(("wo", None), ("w_gate_up", 6 * l2_warm.ROW * 4)))
    with caplog.at_level(logging.INFO, logger="jphoton.kernels"):
        llm = make_llm(str(FIXTURES / "tiny" / "mistral"), warmup=False, attention="pallas", matmul=hook)
        outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref],
                            SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [t.tolist() for _, t, _ in ref]
    assert any("L2 warmed with" in r.getMessage() for r in caplog.records)

"""Rows of one step never reach each other through garbage (issue 60): non-finite logits are marked, not sampled; a
LoRA slot's NaN never reaches a row without it; paged attention never reads what another request left in a page.
Cheap unit tests of the pure functions; the engine end to end is in tests/test_lora.py (poisoned adapters)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphoton.engine.attention import paged_attention, paged_attention_static
from jphoton.engine.slots import NONFINITE
from jphoton.engine.step import mark_nonfinite
from jphoton.models import lora


def test_rows_whose_logits_are_not_finite_are_marked_and_no_other():
    logits = np.zeros((5, 7), np.float32)
    logits[1, 3] = np.nan
    logits[2, 0] = np.inf
    logits[3, :] = -np.inf  # no distribution at all
    logits[4, :5] = -np.inf  # masked tokens are fine
    tokens = jnp.arange(5, dtype=jnp.int32) + 10
    got = np.asarray(mark_nonfinite(tokens, jnp.asarray(logits)))
    assert got.tolist() == [10, NONFINITE, NONFINITE, NONFINITE, 14]


def test_marking_under_tensor_parallelism_agrees_on_every_shard():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jphoton.models.tensor_parallel import AXIS, TensorParallel

    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    logits = np.zeros((3, 8), np.float32)
    logits[1, 6] = np.nan  # in the second shard's columns only
    tp = TensorParallel(2)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P(AXIS), check_vma=False)
    def per_shard(tokens, shard_logits):
        return mark_nonfinite(tokens, shard_logits, tp)

    got = np.asarray(per_shard(jnp.asarray([4, 5, 6], jnp.int32), jnp.asarray(logits))).reshape(2, 3)
    assert got.tolist() == [[4, NONFINITE, 6]] * 2  # both shards write the same tokens


def test_a_slot_full_of_nan_never_reaches_a_row_without_an_adapter():
    rng = np.random.default_rng(0)
    S, R, D, O = 3, 4, 16, 24
    n = len(lora.GROUPS["o"])
    a = rng.standard_normal((D, S * n * R)).astype(np.float32)
    b = rng.standard_normal((S * n * R, O)).astype(np.float32)
    a[:, 2 * n * R:] = np.nan  # slot 2 poisoned, A and B
    b[2 * n * R:] = np.nan
    x = jnp.asarray(rng.standard_normal((5, D)), jnp.float32)
    slots = jnp.asarray([-1, 0, 2, -1, 1], jnp.int32)
    got = np.asarray(lora.delta(x, jnp.asarray(a), jnp.asarray(b),
                                lora.slot_mask(slots, S * n * R, lora.group_width("o", R), jnp.float32)))
    assert (got[[0, 3]] == 0).all()  # exactly zero: the base product is left bit for bit
    assert np.isnan(got[2]).all()


@pytest.mark.parametrize("static", [True, False])
def test_paged_attention_ignores_garbage_past_each_rows_context(static):
    """The slots past a row's length hold another request's leftovers (NaN after an overflow): the output must equal
    the one over a clean pool, for decode and for prefill queries."""
    rng = np.random.default_rng(1)
    page_size, pages, Hkv, Hq, hd = 4, 3, 2, 4, 8
    slots = (2 * pages + 1) * page_size
    k = rng.standard_normal((1, slots, Hkv, hd)).astype(np.float32)
    v = rng.standard_normal((1, slots, Hkv, hd)).astype(np.float32)
    table = np.array([[0, 1, 6], [2, 3, 4]], np.int32)  # row 0 uses 5 positions; the rest of its table: trash (6)
    ctx = np.array([5, 12], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 2, Hq, hd)), jnp.float32)
    q_pos = jnp.asarray([[3, 4], [10, 11]], jnp.int32)
    dirty_k, dirty_v = k.copy(), v.copy()
    for s in [*range(5, 8), *range(6 * page_size, 7 * page_size)]:  # row 0's last page past 5, and the trash page
        dirty_k[0, s], dirty_v[0, s] = np.nan, np.nan
    if static:
        attend = functools.partial(paged_attention_static, page_size=page_size, num_pages=pages)
    else:
        attend = functools.partial(paged_attention, page_size=page_size, pages_per_block=1)
    clean = attend(q, jnp.asarray(k), jnp.asarray(v), 0, jnp.asarray(table), q_pos, jnp.asarray(ctx))
    dirty = attend(q, jnp.asarray(dirty_k), jnp.asarray(dirty_v), 0, jnp.asarray(table), q_pos, jnp.asarray(ctx))
    assert np.isfinite(np.asarray(dirty)).all()
    np.testing.assert_allclose(np.asarray(dirty), np.asarray(clean), rtol=1e-6, atol=1e-6)

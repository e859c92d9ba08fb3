"""On-device sampling: distributions, filters, and seeds that do not depend on the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.engine.sampling import sample, seed_key_data

from conftest import FIXTURES, shared_llm

V = 8


def _draw(logits, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """n draws from one row, as n rows of a batch with distinct output indices."""
    lg = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    kd = np.broadcast_to(seed_key_data(seed), (n, 2))
    out = jax.jit(sample)(lg, jnp.full(n, temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
                          jnp.full(n, top_p, jnp.float32), kd, jnp.arange(n, dtype=jnp.int32))
    return np.bincount(np.asarray(out), minlength=len(logits)) / n


LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]))


def test_temperature_one_follows_softmax():
    freq = _draw(LOGITS, 20000)
    assert np.abs(freq - np.exp(LOGITS)).max() < 0.015


def test_temperature_sharpens():
    freq = _draw(LOGITS, 20000, temperature=0.5)
    p = np.exp(LOGITS / 0.5)
    assert np.abs(freq - p / p.sum()).max() < 0.015


def test_top_k_keeps_k_most_likely():
    freq = _draw(LOGITS, 20000, top_k=3)
    p = np.exp(LOGITS[:3]) / np.exp(LOGITS[:3]).sum()
    assert freq[3:].sum() == 0
    assert np.abs(freq[:3] - p).max() < 0.015


def test_top_p_keeps_smallest_nucleus():
    freq = _draw(LOGITS, 20000, top_p=0.7)  # 0.4 + 0.25 < 0.7 <= 0.4 + 0.25 + 0.15
    p = np.exp(LOGITS[:3]) / np.exp(LOGITS[:3]).sum()
    assert freq[3:].sum() == 0
    assert np.abs(freq[:3] - p).max() < 0.015


def test_zero_temperature_is_argmax_whatever_the_filters():
    freq = _draw(LOGITS[::-1], 64, temperature=0.0, top_k=2, top_p=0.3)
    assert freq[V - 1] == 1.0


@pytest.fixture(scope="module")
def tiny_llm():
    # warm-up off: only the shapes these tests take compile (those of test_families' engine of the same model)
    with shared_llm(str(FIXTURES / "tiny" / "qwen2"), warmup=False) as llm:
        yield llm


def test_same_seed_same_tokens_whatever_the_batch(tiny_llm):
    p = SamplingParams(max_tokens=16, temperature=3.0, top_k=50, seed=1234, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    alone = tiny_llm.generate(prompt, p)[0].token_ids
    others = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (3, 11, 20)]
    batched = tiny_llm.generate(others[:1] + [prompt] + others[1:],
                                [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in (1, 2)][:1] + [p]
                                + [SamplingParams(max_tokens=20, temperature=0.7, seed=9, ignore_eos=True)] * 2)
    # really sampled, not a peaked argmax (the tiny model soon falls into repeats, whatever the noise)
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    assert len(set(alone)) > 2 and alone != greedy
    assert batched[1].token_ids == alone
    other_seed = tiny_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=3.0, top_k=50, seed=99,
                                                          ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(tiny_llm):
    prompt = {"prompt_token_ids": [10, 20, 30, 40]}
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    topk1 = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, seed=3,
                                                     ignore_eos=True))[0]
    assert topk1.token_ids == greedy.token_ids


@pytest.mark.parametrize("V", [512, 1000])  # two blocks of 256; a size that is padded to blocks of 16
def test_many_blocks_follow_softmax_and_never_draw_masked_tokens(V):
    rng = np.random.default_rng(V)
    logits = rng.normal(size=V) * 2.0
    logits[rng.permutation(V)[: V // 2]] = -np.inf  # half the vocabulary masked out, scattered over the blocks
    p = np.exp(logits - logits[np.isfinite(logits)].max())
    p /= p.sum()
    top = np.argsort(-p)[:4]
    freq = _draw(logits, 20000, seed=V)
    assert freq[~np.isfinite(logits)].sum() == 0
    assert np.abs(freq[top] - p[top]).max() < 0.015
    assert np.abs(freq - p).sum() < 0.2  # total variation over the whole vocabulary, 20000 draws


def test_a_row_with_nothing_allowed_gives_a_valid_id():
    freq = _draw(np.full(V, -np.inf), 4)
    assert freq.sum() == 1.0


def test_gumbel_noise_is_standard_gumbel_and_independent_across_indices_and_keys():
    from jphoton.engine.sampling import _gumbel

    kd = np.concatenate([np.broadcast_to(seed_key_data(7), (4, 2)), np.broadcast_to(seed_key_data(8), (4, 2))])
    idx = jnp.asarray([0, 1, 2, 3, 0, 1, 2, 3], jnp.int32)
    g = np.asarray(jax.jit(_gumbel)(jnp.zeros((8, 50_000)), jnp.asarray(kd), idx), np.float64)
    assert abs(g.mean() - np.euler_gamma) < 0.01 and abs(g.var() - np.pi ** 2 / 6) < 0.03
    u = np.exp(-np.exp(-g))  # back to uniforms: each row's deciles hold a tenth of its draws
    assert np.abs(np.stack([np.histogram(r, 10, (0, 1))[0] for r in u]) / 50_000 - 0.1).max() < 0.005
    corr = np.corrcoef(g)
    assert np.abs(corr[~np.eye(8, dtype=bool)]).max() < 0.03  # rows: other indices, other keys


def test_noise_is_finite_at_the_ends_of_the_hash_range():
    from jphoton.engine.sampling import _open_uniform

    h = jnp.asarray([0, 1, 511, 512, 0xFFFFFE00, 0xFFFFFFFF], jnp.uint32)
    u = np.asarray(_open_uniform(h))
    assert ((u > 0) & (u < 1)).all(), u
    assert np.isfinite(-np.log(-np.log(u.astype(np.float64)))).all()


def test_a_one_token_mask_draws_that_token_whatever_the_key():
    """A grammar's forced token: every other entry is -inf. Over a large vocabulary and many keys and indices, no
    noise value may turn a masked entry into the argmax (it did once, through +inf noise: -inf + inf = NaN)."""
    n, vocab = 256, 49_152
    logits = np.full(vocab, -np.inf, np.float32)
    logits[1799] = -3.0
    for seed in range(8):  # 100M noise entries: the old bug hit ~6 of them
        assert _draw(logits, n, temperature=0.8, seed=seed)[1799] == 1.0

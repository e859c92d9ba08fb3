"""Top-k / top-p sampling without a sort (pallas_kernels/filtered_sample.py) against the sort-based definition
(`jphoton.engine.sampling.sample_reference`): the same tokens on fixed seeds, the Pallas kernel (interpret mode) equal to the
XLA loops, edge rows, and no sort in the lowered sampler."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.engine.sampling import _gumbel, sample, sample_reference, seed_key_data
from jphoton.reference import ReferenceDecoder
from pallas_kernels.filtered_sample import filtered_sample, filtered_sample_xla, float_keys, key_value

# (top_k, top_p) settings: each filter alone, both, a nucleus of one token, k >= V, k = 1, nothing
SETTINGS = [(0, 0.9), (0, 0.5), (0, 0.1), (0, 0.999), (0, 1e-6), (50, 1.0), (1, 1.0), (3, 0.5), (200, 0.9),
            (10_000, 0.8), (0, 1.0)]


# Jitted once per module (an eager call traces and compiles the whole loop again each time: ~5 s a call here, while a
# jitted one is reused across the settings and the parametrized cases of a shape)
_sample, _sample_reference, _xla_loops = jax.jit(sample), jax.jit(sample_reference), jax.jit(filtered_sample_xla)


@functools.partial(jax.jit, static_argnames=("block", "count_block", "unroll", "compact_cap"))
def _kernel(scaled, noisy, k, p, **static):
    """The Pallas kernel in interpret mode."""
    return filtered_sample(scaled, noisy, k, p, interpret=True, **static)


def _rows(kind: str, R: int, V: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(R, V))
    if kind == "flat":  # a random model's logits: the nucleus holds most of the vocabulary
        x *= 0.3
    elif kind == "peaked":  # a trained model's: a few tokens hold most of the mass
        x *= 2.0
        x[:, rng.integers(0, V, 5)] += 12.0
    elif kind == "masked":  # a grammar mask: most entries -inf
        x[rng.random((R, V)) < 0.9] = -np.inf
    elif kind == "ties":  # few distinct values: ties at every threshold
        x = np.round(x * 2) / 2
    return x.astype(np.float32)


def _inputs(x, temperature=1.0, seed=0):
    R = x.shape[0]
    logits = jnp.asarray(x)
    kd = jnp.asarray(np.stack([seed_key_data(seed + i) for i in range(R)]))
    idx = jnp.arange(R, dtype=jnp.int32)
    return logits, jnp.full(R, temperature, jnp.float32), kd, idx


@pytest.mark.parametrize("kind", ["normal", "flat", "peaked", "masked"])
def test_same_tokens_as_the_sort_based_definition(kind):
    x = _rows(kind, 48, 3000, seed=len(kind))
    logits, temp, kd, idx = _inputs(x, temperature=0.8)
    R = x.shape[0]
    fast, ref = _sample, _sample_reference
    for k, p in SETTINGS:
        kk, pp = jnp.full(R, k, jnp.int32), jnp.full(R, p, jnp.float32)
        got, want = np.asarray(fast(logits, temp, kk, pp, kd, idx)), np.asarray(ref(logits, temp, kk, pp, kd, idx))
        assert (got == want).all(), (kind, k, p, np.flatnonzero(got != want))


def test_ties_keep_every_tied_value_at_the_threshold():
    """The reference keeps `scaled >= threshold` (all ties); with top-k alone the kept sets agree exactly."""
    x = _rows("ties", 32, 2000, seed=3)
    logits, temp, kd, idx = _inputs(x)
    for k in (1, 7, 60, 333):
        kk, pp = jnp.full(32, k, jnp.int32), jnp.ones(32, jnp.float32)
        assert (np.asarray(_sample(logits, temp, kk, pp, kd, idx))
                == np.asarray(_sample_reference(logits, temp, kk, pp, kd, idx))).all(), k


def test_mixed_rows_greedy_and_filters_in_one_batch():
    """Each row keeps its own settings: a greedy row is argmax whatever its filters; a row with none draws exactly
    what the unfiltered sampler draws (the fused step sampler's token)."""
    from jphoton.engine.sampling import sample_plain

    x = _rows("normal", 6, 3000, seed=9)
    logits, _, kd, idx = _inputs(x)
    temp = jnp.asarray([0.0, 1.0, 1.0, 0.7, 1.3, 0.0], jnp.float32)
    kk = jnp.asarray([5, 0, 0, 40, 0, 0], jnp.int32)
    pp = jnp.asarray([0.5, 1.0, 0.9, 1.0, 0.3, 1.0], jnp.float32)
    got = np.asarray(_sample(logits, temp, kk, pp, kd, idx))
    assert (got == np.asarray(_sample_reference(logits, temp, kk, pp, kd, idx))).all()
    assert got[0] == got[5] == 0 or (got[0] == int(jnp.argmax(logits[0])) and got[5] == int(jnp.argmax(logits[5])))
    assert got[1] == int(sample_plain(logits, temp, kd, idx)[1])


@pytest.mark.parametrize("kind,unroll", [("normal", None), ("peaked", None), ("masked", None), ("normal", 1),
                                         ("masked", 3)])
def test_pallas_kernel_equals_the_xla_loops(kind, unroll):
    """Interpret mode, a vocabulary that is not a whole number of blocks (the last block overlaps); sweeps that load
    one block at a time, 2 (the default here: 1000 entries are >= 4 count blocks), or 3 (a last group past the row)."""
    x = _rows(kind, 8, 1000, seed=5)
    scaled = jnp.asarray(x)
    noisy = scaled + _gumbel(scaled, jnp.asarray(np.stack([seed_key_data(i) for i in range(8)])),
                             jnp.zeros(8, jnp.int32))
    for k, p in [(0, 0.9), (50, 1.0), (3, 0.5), (0, 0.1), (0, 1.0)]:
        kk, pp = jnp.full(8, k, jnp.int32), jnp.full(8, p, jnp.float32)
        want = np.asarray(_xla_loops(scaled, noisy, kk, pp))
        got = np.asarray(_kernel(scaled, noisy, kk, pp, block=256, count_block=64, unroll=unroll))
        assert (got == want).all(), (kind, k, p)


def test_rows_with_nothing_allowed_or_one_token_allowed():
    V = 500
    x = np.full((3, V), -np.inf, np.float32)
    x[1, 17] = 2.0
    x[2, [3, 400]] = [1.0, 1.0]  # two tied tokens
    logits, temp, kd, idx = _inputs(x)
    for k, p in [(0, 0.9), (5, 1.0), (1, 0.5), (0, 1e-6)]:
        got = np.asarray(_sample(logits, temp, jnp.full(3, k, jnp.int32), jnp.full(3, p, jnp.float32), kd, idx))
        assert 0 <= got[0] < V and got[1] == 17 and got[2] in (3, 400), (k, p, got)


def test_distribution_of_a_flat_nucleus_matches_the_definition():
    """Statistically: the nucleus of a flat row holds hundreds of tokens (the rejection path's common case, where
    the first candidate is accepted or the next one is); draws over it follow the renormalised softmax."""
    rng = np.random.default_rng(0)
    V, n = 400, 20_000
    row = (rng.normal(size=V) * 0.5).astype(np.float32)
    p = np.exp(row - row.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[: np.searchsorted(np.cumsum(p[order]), 0.6) + 1]
    logits = jnp.broadcast_to(jnp.asarray(row), (n, V))
    kd = jnp.broadcast_to(jnp.asarray(seed_key_data(11)), (n, 2))
    out = np.asarray(_sample(logits, jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.full(n, 0.6), kd,
                                     jnp.arange(n, dtype=jnp.int32)))
    freq = np.bincount(out, minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(keep.tolist())
    q = np.zeros(V)
    q[keep] = p[keep] / p[keep].sum()
    assert np.abs(freq - q).sum() < 0.12  # total variation over ~170 tokens, 20000 draws


def test_float_keys_order_and_inverse():
    v = jnp.asarray([-jnp.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, jnp.inf], jnp.float32)
    k = np.asarray(float_keys(v))
    assert (np.diff(k) > 0).all()
    assert (np.asarray(key_value(float_keys(v))) == np.asarray(v)).all()


def test_lowered_sampler_has_no_sort():
    """The filtered sampler of a whole bucket lowers without a sort over the vocabulary (the definition has one,
    so the check can fail)."""
    R, V = 32, 4096
    args = (jnp.zeros((R, V)), jnp.ones(R), jnp.zeros(R, jnp.int32), jnp.full(R, 0.9), jnp.zeros((R, 2), jnp.uint32),
            jnp.zeros(R, jnp.int32))
    sort = "stablehlo.sort"
    assert sort in jax.jit(sample_reference).lower(*args).as_text()
    assert sort not in jax.jit(sample).lower(*args).as_text()
    # and the GPU path (the Pallas kernel), lowered for CUDA here without a GPU
    fn = jax.jit(lambda s, y, k, p: filtered_sample(s, y, k, p, interpret=False))
    text = fn.trace(args[0], args[0], args[2], args[3]).lower(lowering_platforms=("cuda",)).as_text()
    assert sort not in text and "filtered_sample" in text


def test_engine_sampled_tokens_equal_the_reference_decoder(embedded_llm):
    """Seeded top-p / top-k requests through the engine (the fast sampler) and through the dense reference decoder
    (the sort-based definition): the same tokens."""
    llm = embedded_llm
    prompts = [[1, 20, 300, 4000], [7, 8, 9], [42] * 12, [5, 6]]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.2, top_k=20, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, top_k=50, top_p=0.6, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, top_p=0.5, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seqs = llm.requests.sequences(prompts, params)
    ReferenceDecoder(llm.config, llm.model.params).run(seqs)
    assert [s.output_ids for s in seqs] == [o.token_ids for o in outs]
    assert len(set(outs[0].token_ids)) > 3  # really sampled


def test_decode_steps_sample_their_filters_in_the_step(embedded_llm, monkeypatch):
    """A decode step with top-k / top-p rows runs its filtered variant (one launch, no second sampler); its tokens
    equal those of the second sampler, which a step without a ready variant uses."""
    llm, runner = embedded_llm, embedded_llm.engine.runner
    assert runner.filtered_ready == set(runner.filtered_shapes())
    calls = []
    real = runner._resample_into
    monkeypatch.setattr(runner, "_resample_into", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [{"prompt_token_ids": [3, 14, 15, 92]}, {"prompt_token_ids": [6, 5, 35]}]
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.7, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=8, seed=6, ignore_eos=True)]
    fused = [o.token_ids for o in llm.generate(prompts, params)]
    fused_calls = len(calls)
    calls.clear()
    monkeypatch.setattr(runner, "filtered_ready", set())  # no variant ready: every step takes the second sampler
    second = [o.token_ids for o in llm.generate(prompts, params)]
    assert fused == second
    assert len(calls) >= 15 and fused_calls <= 2  # only the prefill steps (first tokens) took the second sampler


def test_seeded_filtered_tokens_equal_at_depth_1_and_2(embedded_d1, embedded_llm):
    """The blocking loop (depth 1) and the pipelined one (depth 2) draw the same seeded top-k / top-p tokens."""
    prompts = [{"prompt_token_ids": [9, 99, 999]}, {"prompt_token_ids": [4, 44, 444, 4444]}]
    params = [SamplingParams(max_tokens=10, temperature=1.1, top_p=0.85, seed=21, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.6, top_k=12, top_p=0.95, seed=22, ignore_eos=True)]
    d1 = [o.token_ids for o in embedded_d1.generate(prompts, params)]
    d2 = [o.token_ids for o in embedded_llm.generate(prompts, params)]
    assert d1 == d2 and len(set(d1[0])) > 3


@pytest.mark.parametrize("cap", [4096, 300, 60, 1])
def test_top_k_over_the_compacted_candidates_equals_the_xla_loops(cap):
    """Once a top-k row's count at the search's lower bound is <= compact_cap, its later sweeps read a compacted copy
    of those entries: caps that compact at the first sweep (4096 >= the row), mid-search (300, 60) and never (1)."""
    x = np.concatenate([_rows(kind, 2, 3000, seed=7) for kind in ("normal", "peaked", "masked")])
    scaled = jnp.asarray(x)
    R = x.shape[0]
    noisy = scaled + _gumbel(scaled, jnp.asarray(np.stack([seed_key_data(40 + i) for i in range(R)])),
                             jnp.zeros(R, jnp.int32))
    for k, p in [(50, 1.0), (3, 0.5), (200, 0.9), (1, 1.0), (1000, 0.95), (0, 0.9)]:
        kk, pp = jnp.full(R, k, jnp.int32), jnp.full(R, p, jnp.float32)
        want = np.asarray(_xla_loops(scaled, noisy, kk, pp))
        got = np.asarray(_kernel(scaled, noisy, kk, pp, block=256, count_block=64, compact_cap=cap))
        assert (got == want).all(), (cap, k, p, np.flatnonzero(got != want))


def test_compact_cap_must_be_positive():
    z = jnp.zeros((2, 300))
    with pytest.raises(ValueError, match="compact_cap"):
        filtered_sample(z, z, jnp.zeros(2, jnp.int32), jnp.ones(2), compact_cap=0, interpret=True)

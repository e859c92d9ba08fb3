"""On-device sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Randomness is keyed by (request seed, index of the token in the output), never by batch position or step count, so the
same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import log_once
from pallas_kernels.filtered_sample import filtered_sample, filtered_sample_xla

log = logging.getLogger("jphoton.engine.sampling")


def seed_key_data(seed) -> np.ndarray:
    """A 64-bit seed (or an array of them) as threefry key data (two uint32 words, [..., 2]), built on the host."""
    seed = np.asarray(seed, np.uint64)
    return np.stack([seed >> np.uint64(32), seed & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus. scaled: [B, V] float32."""
    V = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    in_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (mass_before < top_p[:, None])  # the top token is always kept
    pth = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)


_GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads consecutive counters over the 32-bit range


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 in which every input bit flips each output bit with
    probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _gumbel(logits: jax.Array, key_data: jax.Array, index: jax.Array, first_column=0) -> jax.Array:
    """Gumbel noise [B, V], a pure function of (the row's key, its output index, the vocabulary position).

    A counter-based hash, not threefry: Gumbel-max draws one number per vocabulary entry of every row at every step, and
    threefry's 20 rounds per pair made that noise 82 us of the 1B step at B=128 on the H100 (RESULTS.md, "Where the 1B
    step goes at B=128"). Here each row gets two stream keys mixed from its 64-bit key and output index (once per row),
    and each entry two finalizer rounds of its column index under them; the top 23 bits make the uniform. Sampling needs
    well-spread, independent-looking uniforms, not a cryptographic generator (the distribution tests in
    tests/test_sampling.py check the draws against the softmax). first_column: the vocabulary position of logits'
    column 0 (a tensor-parallel shard's slice draws the unsharded noise of its columns)."""
    kd = key_data.astype(jnp.uint32)
    stream_a = _fmix32(kd[:, 0] ^ _fmix32(kd[:, 1] + index.astype(jnp.uint32) * jnp.uint32(_GOLDEN)))
    stream_b = _fmix32(stream_a ^ jnp.uint32(0x5BD1E995))
    col = (jnp.arange(logits.shape[-1], dtype=jnp.uint32) + jnp.asarray(first_column).astype(jnp.uint32))[None, :]
    h = _fmix32(_fmix32(col * jnp.uint32(_GOLDEN) + stream_a[:, None]) ^ stream_b[:, None])
    return -jnp.log(-jnp.log(_open_uniform(h)))


def _open_uniform(h: jax.Array) -> jax.Array:
    """uint32 hash -> float32 uniform strictly inside (0, 1), so that the Gumbel transform stays finite.

    The top 23 bits plus one half: (2^23 - 0.5) needs 24 significant bits, which float32 holds exactly. With 24 bits the
    largest hash rounded to u = 1.0, i.e. +inf noise on ~1 entry in 2^24: that entry won the unmasked argmax outright,
    and on a grammar-masked entry (-inf + inf = NaN, which argmax picks) it emitted a token the grammar forbids."""
    return ((h >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def sample_plain(logits: jax.Array, temperature: jax.Array, key_data: jax.Array, index: jax.Array, tp=None
                 ) -> jax.Array:
    """Greedy rows (temperature 0) and plain temperature sampling (Gumbel-max), no filters. logits [B, V] float32;
    temperature [B]; key_data [B, 2] uint32; index [B] int32 (which output token this is). -> int32 [B].
    No data-dependent control flow: on GPU a conditional makes XLA sync the host, so filtered sampling is a separate
    executable (`sample`) that the runner dispatches only for steps that need it.
    tp: inside `shard_map`, logits are this shard's vocabulary slice [B, V/N] (models/tensor_parallel.py): each shard
    draws the unsharded noise of its columns and the argmax runs across shards (its winners gathered, [N, B] values
    and ids: no full-logit gather); the tokens are those of the unsharded sampler."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if tp is None:
        return _argmax_or_greedy(logits, scaled + _gumbel(logits, key_data, index), temperature)
    first = tp.index() * logits.shape[-1]
    scores = jnp.where((temperature > 0)[:, None], scaled + _gumbel(logits, key_data, index, first), logits)
    local = jnp.argmax(scores, axis=-1)
    best = jnp.take_along_axis(scores, local[:, None], axis=-1)[:, 0]
    values = jax.lax.all_gather(best, tp.axis)  # [N, B]
    ids = jax.lax.all_gather(local.astype(jnp.int32) + first.astype(jnp.int32), tp.axis)
    winner = jnp.argmax(values, axis=0)  # the first shard holding the maximum: the unsharded argmax's first index
    return jnp.take_along_axis(ids, winner[None, :], axis=0)[0]


def _argmax_or_greedy(logits: jax.Array, noisy: jax.Array, temperature: jax.Array) -> jax.Array:
    """argmax of `noisy` on sampled rows, of `logits` on greedy rows (temperature 0), as one argmax over each row's
    selected scores instead of two argmaxes and a select: the same tokens (ties go to the first index either way), half
    the reductions over the vocabulary (benchmarks/probes/sampler_argmax.py)."""
    return jnp.argmax(jnp.where((temperature > 0)[:, None], noisy, logits), axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, key_data: jax.Array,
           index: jax.Array) -> jax.Array:
    """`sample_plain` after top-k (0 = off) / top-p (1 = off) filtering, without sorting the vocabulary: the Gumbel-max
    draw over the kept set by a threshold search with early exit (pallas_kernels/filtered_sample.py; the Pallas kernel
    on a GPU, the same algorithm as XLA loops elsewhere). The kept set is the sort-based `sample_reference`'s, so the
    same seed draws the same token (up to float summation order at the nucleus edge). A row with both filters off draws
    exactly what sample_plain draws (same noise), so a request's tokens never depend on which path ran; greedy rows
    (temperature 0) are argmax whatever their filters."""
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    noisy = scaled + _gumbel(logits, key_data, index)
    top_k = jnp.where(sampled, top_k, 0)
    top_p = jnp.where(sampled, top_p, 1.0)
    if jax.default_backend() in ("gpu", "cuda", "rocm"):
        tokens = filtered_sample(scaled, noisy, top_k, top_p)
    else:
        log_once(log, ("filtered_sample_xla", logits.shape), "filtered sampling [%d, %d]: XLA loops (%s backend)",
                 *logits.shape, jax.default_backend())
        tokens = filtered_sample_xla(scaled, noisy, top_k, top_p)
    return jnp.where(sampled, tokens, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def sample_reference(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     key_data: jax.Array, index: jax.Array) -> jax.Array:
    """The definition `sample` implements: sort each row, cut it at top-k and at the top-p nucleus, Gumbel-max over
    what is left (a full-vocabulary sort per row: 0.99 ms for 32 rows of 128256 on the H100). The reference decoder
    and the tests use it."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    return _argmax_or_greedy(logits, scaled + _gumbel(logits, key_data, index), temperature)


def top_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """([B, 1 + k] float32: the chosen token's logprob then the top k, [B, k] int32 ids) of the raw model
    distribution (before temperature)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, k)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)
    return jnp.concatenate([chosen, top_lp], axis=1), top_ids.astype(jnp.int32)

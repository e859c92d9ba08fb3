"""On-device sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Randomness is keyed by (request seed, index of the token in the output), never by batch position or step count, so the
same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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


def _block_size(V: int) -> int:
    """Tokens per block of the two-level inverse CDF: the largest power of two <= 256 dividing V (Llama-3's 128256 =
    501 x 256), so that the [B, V] scores reshape into blocks without a padded copy; 16 for odd sizes (padded)."""
    b = 256
    while b > 16 and V % b:
        b //= 2
    return b


def _uniform(key_data: jax.Array, index: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row, keyed by (request seed, output index)."""
    def row(kd, i):
        return jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), i), ())

    return jax.vmap(row)(key_data, index)


def _draw(scaled: jax.Array, key_data: jax.Array, index: jax.Array) -> jax.Array:
    """A token from softmax(scaled) per row (-inf entries never drawn), by inverse CDF with one uniform per row.

    Two levels, so that no [B, V] intermediate is written: the probabilities' sums per block of `_block_size` tokens
    (exp fused into the reduction), a cumulative sum over the blocks picks the block, a cumulative sum inside that block
    picks the token. Gumbel-max (an argmax over scores + noise) gives the same distribution but draws V random numbers
    per row: at B = 128 on the H100 its threefry noise alone took 82 us of a 2.2 ms 1B step (RESULTS.md)."""
    B, V = scaled.shape
    blk = _block_size(V)
    if V % blk:
        scaled = jnp.pad(scaled, ((0, 0), (0, blk - V % blk)), constant_values=-jnp.inf)
    blocks = scaled.reshape(B, -1, blk)
    m = jnp.max(scaled, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with nothing allowed draws a valid (meaningless) id, never NaN
    mass = jnp.sum(jnp.exp(blocks - m[:, None, None]), axis=-1)  # [B, nb]
    cum = jnp.cumsum(mass, axis=-1)
    target = _uniform(key_data, index) * cum[:, -1]
    last_block = blocks.shape[1] - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)  # rounding never picks an empty tail
    b = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), last_block)
    rest = target - jnp.where(b > 0, jnp.take_along_axis(cum, jnp.maximum(b - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    p = jnp.exp(jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0] - m[:, None])  # [B, blk]
    last_token = blk - 1 - jnp.argmax((p > 0)[:, ::-1], axis=-1)
    t = jnp.minimum(jnp.sum(jnp.cumsum(p, axis=-1) <= rest[:, None], axis=-1), last_token)
    return jnp.minimum(b * blk + t, V - 1).astype(jnp.int32)


def sample_plain(logits: jax.Array, temperature: jax.Array, key_data: jax.Array, index: jax.Array) -> jax.Array:
    """Greedy rows (temperature 0) and plain temperature sampling (`_draw`), no filters. logits [B, V] float32;
    temperature [B]; key_data [B, 2] uint32; index [B] int32 (which output token this is). -> int32 [B].
    No data-dependent control flow: on GPU a conditional makes XLA sync the host, so filtered sampling is a separate
    executable (`sample`) that the runner dispatches only for steps that need it."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    return jnp.where(temperature > 0, _draw(scaled, key_data, index), greedy)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, key_data: jax.Array,
           index: jax.Array) -> jax.Array:
    """`sample_plain` after top-k (0 = off) / top-p (1 = off) filtering. With both off it draws exactly what
    sample_plain draws (same uniform, no-op filter), so a request's tokens never depend on which path ran."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    return jnp.where(temperature > 0, _draw(scaled, key_data, index), greedy)


def top_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """([B, 1 + k] float32: the chosen token's logprob then the top k, [B, k] int32 ids) of the raw model
    distribution (before temperature)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, k)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)
    return jnp.concatenate([chosen, top_lp], axis=1), top_ids.astype(jnp.int32)

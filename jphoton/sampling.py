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


def _gumbel(logits: jax.Array, key_data: jax.Array, index: jax.Array) -> jax.Array:
    def row(kd, i):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), i)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    return jax.vmap(row)(key_data, index)


def sample_plain(logits: jax.Array, temperature: jax.Array, key_data: jax.Array, index: jax.Array) -> jax.Array:
    """Greedy rows (temperature 0) and plain temperature sampling (Gumbel-max), no filters. logits [B, V] float32;
    temperature [B]; key_data [B, 2] uint32; index [B] int32 (which output token this is). -> int32 [B].
    No data-dependent control flow: on GPU a conditional makes XLA sync the host, so filtered sampling is a separate
    executable (`sample`) that the runner dispatches only for steps that need it."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sampled = jnp.argmax(scaled + _gumbel(logits, key_data, index), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, key_data: jax.Array,
           index: jax.Array) -> jax.Array:
    """`sample_plain` after top-k (0 = off) / top-p (1 = off) filtering. With both off it draws exactly what
    sample_plain draws (same noise, no-op filter), so a request's tokens never depend on which path ran."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    sampled = jnp.argmax(scaled + _gumbel(logits, key_data, index), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def top_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """([B, 1 + k] float32: the chosen token's logprob then the top k, [B, k] int32 ids) of the raw model
    distribution (before temperature)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, k)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)
    return jnp.concatenate([chosen, top_lp], axis=1), top_ids.astype(jnp.int32)

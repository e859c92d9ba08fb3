"""On-device sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Randomness is keyed by (request seed, index of the token in the output), never by batch position or step count, so the
same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def seed_key_data(seed: int) -> np.ndarray:
    """A 64-bit seed as threefry key data (two uint32 words), built on the host."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32)


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


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, key_data: jax.Array,
           index: jax.Array) -> jax.Array:
    """logits [B, V] float32; temperature, top_p [B] float32; top_k [B] int32; key_data [B, 2] uint32; index [B] int32
    (which output token this is). Returns int32 tokens [B]. Rows with temperature 0 are greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    needs_filter = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1.0)))
    # The sort is only paid for when some sampled row asks for top-k/top-p.
    scaled = jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)

    def gumbel_row(kd, i):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), i)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    noise = jax.vmap(gumbel_row)(key_data, index)
    sampled = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)

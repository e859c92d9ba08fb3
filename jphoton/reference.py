"""Reference decoder: one batch, dense KV cache, a blocking host loop. Slow and simple on purpose.

It is the numerical oracle the paged/pipelined engine is tested against, so it shares the model and sampling functions
with the engine but none of the scheduling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.engine.sampling import sample_reference, seed_key_data
from jphoton.models import llama
from jphoton.models.config import ModelConfig
from jphoton.sequence import Delta, Sequence


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _step(cfg: ModelConfig, params, tokens, positions, last, kv, temperature, top_k, top_p, key_data, index):
    """Forward tokens [B, T] at positions [B, T], sample at column `last` [B] of each row."""
    hidden, kv = llama.forward(params, cfg, tokens, positions, kv, llama.dense_attention(cfg, positions))
    hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = llama.lm_head(params, hidden)
    return sample_reference(logits, temperature, top_k, top_p, key_data, index), kv


class ReferenceDecoder:
    def __init__(self, cfg: ModelConfig, params):
        self.cfg = cfg
        self.params = params
        self.dtype = params["embed"].dtype
        self._step = jax.jit(functools.partial(_step, cfg), donate_argnames=("kv",))

    def run(self, seqs: list[Sequence], on_delta: Callable[[Sequence, Delta], None] | None = None) -> None:
        """Decode every sequence to its end. Shapes are bucketed to powers of two to bound recompiles."""
        n = len(seqs)
        B = _next_pow2(n)
        T = _next_pow2(max(len(s.prompt_ids) for s in seqs), 16)
        S = _next_pow2(max(len(s.prompt_ids) + s.max_new_tokens for s in seqs), 64)
        tokens = np.zeros((B, T), np.int32)
        positions = np.full((B, T), S, np.int32)  # padding positions are >= S: their K/V writes are dropped
        lens = np.ones(B, np.int32)
        for i, s in enumerate(seqs):
            L = len(s.prompt_ids)
            tokens[i, :L] = s.prompt_ids
            positions[i, :L] = np.arange(L)
            lens[i] = L
        temperature = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        key_data = np.zeros((B, 2), np.uint32)
        for i, s in enumerate(seqs):
            temperature[i], top_k[i], top_p[i] = s.params.temperature, s.params.top_k, s.params.top_p
            key_data[i] = seed_key_data(s.seed)
        sampling = tuple(jax.device_put(a) for a in (temperature, top_k, top_p, key_data))

        kv = tuple(llama.init_dense_kv(self.cfg, B, S, self.dtype))
        out, kv = self._step(self.params, tokens, positions, lens - 1, kv, *sampling, np.zeros(B, np.int32))
        index = 0
        while True:
            host = jax.device_get(out)
            for i, s in enumerate(seqs):
                if not s.finished:
                    delta = s.append(int(host[i]))
                    if on_delta is not None:
                        on_delta(s, delta)
            if all(s.finished for s in seqs):
                return
            index += 1
            step_pos = np.minimum(lens + index - 1, S).astype(np.int32)[:, None]
            out, kv = self._step(self.params, out[:, None], step_pos, np.zeros(B, np.int32), kv, *sampling,
                                 np.full(B, index, np.int32))

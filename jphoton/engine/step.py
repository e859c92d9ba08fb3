"""One engine step as a pure function: unpack the step's inputs, run the model over decode rows and prefill chunks
together, sample, write the results into the (donated) output buffers.

Every host input of a step travels as ONE packed int32 array (one host->device copy); `StepLayout` says where each field
lives in it for a given bucket shape, and is used both to pack (host) and to unpack (traced, static offsets).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.constrain.choice import FORCED_SET
from jphoton.engine.attention import paged_attention, paged_attention_static, token_slots
from jphoton.engine.plan import StepShape
from jphoton.engine.sampling import sample, sample_plain, top_logprobs
from jphoton.engine.slots import NONFINITE
from jphoton.image.spatial import SPATIAL_BASE
from jphoton.models.lora import LoraInputs


@dataclasses.dataclass(frozen=True)
class StepStatic:
    """Everything about the engine that shapes the compiled step (hashable: a jit static argument)."""

    pages_per_seq: int  # block-table width, a multiple of pages_per_block
    page_size: int
    pages_per_block: int
    trash_page: int
    max_rows: int  # length of the output buffers
    sliding_window: int | None
    # decode rows through pallas_kernels/paged_decode_attention.py, prefill rows through paged_prefill_attention.py
    pallas_attention: bool = False
    lora_slots: int = 0  # LoRA adapter slots (models/lora.py); 0: LoRA off
    lora_rank: int = 0
    # the model takes images (models/protocol.py Vision): a prefill row's negative tokens are image embeddings, and
    # the positions up to its image run's end attend to each other bidirectionally
    image_prefix: bool = False
    decode_banned: tuple[int, ...] = ()  # token ids decode rows never sample (models/protocol.py)


class StepLayout:
    """Offsets of each field in the packed int32 input for one shape. The buffer may be longer than the fields
    (`buffer_size`): every step shape takes one fixed-length input, so that a step's input can also ride in the
    grammar sampler's transfer (Runner.finalize) without another compiled variant per shape."""

    def __init__(self, shape: StepShape, static: StepStatic, buffer_size: int = 0):
        Bd, Bp, Tp, P, R = shape.decode_rows, shape.prefill_rows, shape.prefill_tokens, static.pages_per_seq, shape.rows
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, dims in (
            ("d_tokens", (Bd,)), ("d_carry", (Bd,)), ("d_pos", (Bd,)), ("d_table", (Bd, P)),
            ("p_tokens", (Bp, Tp)), ("p_start", (Bp,)), ("p_len", (Bp,)), ("p_table", (Bp, P)),
            ("temperature", (R,)), ("key", (R, 2)), ("sample_index", (R,)), ("top_k", (R,)), ("top_p", (R,)),
            ("d_lora", (Bd,)), ("p_lora", (Bp,)),  # each row's LoRA slot, -1: none (read by a step's LoRA variant)
            # each row's device automaton state and how to read it (`AUTOMATON_*`; read by a step's filtered variant)
            ("g_state", (R,)), ("g_mode", (R,)),
            ("spatial", (R,)),  # each row's spatial skill (image/spatial.py MODES; 0: a text row)
        ):
            self.fields[name] = (offset, dims)
            offset += math.prod(dims)
        self.size = offset  # words the fields take
        self.buffer_size = max(offset, buffer_size)

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Host views of each field into a packed buffer (and the buffer itself as "_buffer")."""
        views = {name: buf[o:o + math.prod(d)].reshape(d) for name, (o, d) in self.fields.items()}
        views["_buffer"] = buf
        return views

    def empty(self, trash_page: int) -> dict[str, np.ndarray]:
        """Host views into one zeroed buffer, with padding defaults (tables -> trash page, top_p 1, no carry)."""
        views = self.views(np.zeros(self.buffer_size, np.int32))
        views["d_table"][:] = trash_page
        views["p_table"][:] = trash_page
        views["d_carry"][:] = -1
        views["d_lora"][:] = -1
        views["p_lora"][:] = -1
        return views

    def unpack(self, packed: jax.Array) -> dict[str, jax.Array]:
        out = {}
        for name, (o, d) in self.fields.items():
            out[name] = jax.lax.slice_in_dim(packed, o, o + math.prod(d)).reshape(d)
        out["temperature"] = jax.lax.bitcast_convert_type(out["temperature"], jnp.float32)
        out["top_p"] = jax.lax.bitcast_convert_type(out["top_p"], jnp.float32)
        out["key"] = jax.lax.bitcast_convert_type(out["key"], jnp.uint32)
        return out


# g_mode: where a row's automaton state (the one its next token is sampled in) comes from. State 0 is the free state.
AUTOMATON_GIVEN = 0  # g_state is it (the host knows every token before the sample: prefill rows, host input tokens)
AUTOMATON_CARRIED = 1  # the previous step's state output at the row's carry_from row (it sampled on the device too)
AUTOMATON_ADVANCE = 2  # g_state is the state before the carried input token: advance by it on the device


ForwardFn = Callable[..., tuple[jax.Array, Any]]  # (params, tokens, positions, kv, attend) -> (hidden, kv)
LogitsFn = Callable[[Any, jax.Array], jax.Array]  # (params, hidden [R, D]) -> float32 logits [R, V]


def engine_step(forward: ForwardFn, logits_fn: LogitsFn, static: StepStatic, shape: StepShape, params, kv,
                prev_tokens, out_tokens, out_logits, packed, lora_weights=None, automaton=None, out_states=None, *,
                filtered: bool = False, lora: bool = False, tp=None, spatial_fn=None, fields=None):
    """Returns (out_tokens, out_logits, kv), and out_states when `automaton` is given. prev_tokens is the previous
    step's token output (read for carry-over, never donated); the output buffers and kv are donated and come back
    updated in place. The logits of every row stay on the device for a later sampler (logprobs, grammar masks, filters
    of a step without a filtered variant).
    filtered: sample with each row's top-k / top-p (`sampling.sample`) instead of the plain sampler, so that such a
    step needs no second sampler launch (a variant of every shape; docs/decisions.md).
    lora: the step's LoRA variant, for steps with a row that uses an adapter: each token gets its row's slot's update
    from `lora_weights` (models/lora.py); steps with none run the base program (no LoRA op in it).
    automaton: (next_state [S, V] int16, mask [S, W] int32, prev_states [max_rows] int32), the device automata
    (jphoton/constrain/automaton.py; the filtered variant only): each row samples under its state's mask, and the state after
    its token goes to out_states (donated), which the next step reads as prev_states.
    tp: one shard of a tensor-parallel step, inside shard_map (models/tensor_parallel.py; the runner wraps it): the
    forward and logits are the shard's, kv and out_logits its slices (KV heads, vocabulary); the sampler reduces across
    shards and every shard writes the same tokens.
    spatial_fn: the model's spatial skills (models/protocol.py JaxModel.spatial): in a step with a point / detect row,
    those rows emit its values (image/spatial.py ids) instead of sampled tokens.
    shape.steps = K > 1 (a decode-only shape): K decode steps in one program (`_decode_steps`); out_tokens then holds
    the last step's tokens in rows 0.. and step j's (j < K - 1) in rows (j + 1) * max_rows.. (plan.py `step_tokens`).
    fields: the unpacked input (`_decode_steps` passes each step's own)."""
    if shape.steps > 1:
        assert not shape.prefill_rows and automaton is None, "multi-step shapes are decode-only, without automata"
        return _decode_steps(forward, logits_fn, static, shape, params, kv, prev_tokens, out_tokens, out_logits,
                             StepLayout(shape, static).unpack(packed), lora_weights, filtered=filtered, lora=lora,
                             tp=tp, spatial_fn=spatial_fn)
    f = fields if fields is not None else StepLayout(shape, static).unpack(packed)
    Bd, Bp, Tp = shape.decode_rows, shape.prefill_rows, shape.prefill_tokens
    ps, trash = static.page_size, static.trash_page

    # Decode inputs: a carried-over token is read on the device from the previous step's output.
    d_tokens = jnp.where(f["d_carry"] >= 0, prev_tokens[jnp.maximum(f["d_carry"], 0)], f["d_tokens"])
    d_pos = f["d_pos"]
    p_pos = f["p_start"][:, None] + jnp.arange(Tp, dtype=jnp.int32)[None, :]
    p_valid = jnp.arange(Tp)[None, :] < f["p_len"][:, None]
    tokens = jnp.concatenate([d_tokens, f["p_tokens"].reshape(-1)])
    positions = jnp.concatenate([d_pos, p_pos.reshape(-1)])
    trash_slots = trash * ps + jnp.arange(Tp, dtype=jnp.int32) % ps
    slots = jnp.concatenate([
        token_slots(f["d_table"], d_pos[:, None], ps)[:, 0],
        jnp.where(p_valid, token_slots(f["p_table"], p_pos, ps), trash_slots[None, :]).reshape(-1),
    ])
    p_prefix = p_mask_pos = None  # (rows with an image run: each row's prefix length, the positions their masks use)
    if static.image_prefix and Bp:
        image = (f["p_tokens"] < 0) & (f["p_tokens"] > -SPATIAL_BASE)  # (a recomputed spatial row's ids are not)
        p_prefix = jnp.max(jnp.where(image, p_pos + 1, 0), axis=1)
        p_mask_pos = jnp.maximum(p_pos, p_prefix[:, None] - 1)
    if shape.ctx_pages:
        attention = functools.partial(paged_attention_static, page_size=ps, num_pages=shape.ctx_pages,
                                      sliding_window=static.sliding_window)
    else:
        attention = functools.partial(paged_attention, page_size=ps, pages_per_block=static.pages_per_block,
                                      sliding_window=static.sliding_window)

    # Decode rows through the Pallas kernel: its loop follows each row's own length (no context bucket), and it writes
    # the rows' new keys/values into the pool itself, so only prefill tokens go through a scatter here.
    kernel_writes = static.pallas_attention and Bd > 0
    if static.pallas_attention:
        from pallas_kernels.paged_decode_attention import paged_decode_attention
        from pallas_kernels.paged_prefill_attention import paged_prefill_attention

    def attend(q, k, v, kv, layer):
        k_pool, v_pool = kv
        first = Bd if kernel_writes else 0  # tokens from here on have their KV written by a scatter
        if shape.tokens > first:
            k_pool = k_pool.at[layer, slots[first:]].set(k[first:].astype(k_pool.dtype))
            v_pool = v_pool.at[layer, slots[first:]].set(v[first:].astype(v_pool.dtype))
        parts = []
        if kernel_writes:
            # q, k, v of the decode rows as one array the kernel reads by head offset: XLA builds it in one fusion
            # with the model's RoPE, where three separate operands would each be copied out by a kernel of their own
            qkv = jnp.concatenate([q[:Bd], k[:Bd].astype(q.dtype), v[:Bd].astype(q.dtype)], axis=1)
            out, (k_pool, v_pool) = paged_decode_attention(
                qkv, k_pool, v_pool, layer, f["d_table"], d_pos + 1, page_size=ps,
                sliding_window=static.sliding_window, new_kv="packed")
            parts.append(out)
        elif Bd:
            parts.append(attention(q[:Bd, None], k_pool, v_pool, layer, f["d_table"], d_pos[:, None], d_pos + 1)[:, 0])
        if Bp:
            qp = q[Bd:].reshape(Bp, Tp, *q.shape[1:])
            if static.pallas_attention:  # its loop follows each row's own length: no context bucket
                out = paged_prefill_attention(qp, k_pool, v_pool, layer, f["p_table"], f["p_start"], f["p_len"],
                                              page_size=ps, sliding_window=static.sliding_window, prefix=p_prefix)
            else:
                out = attention(qp, k_pool, v_pool, layer, f["p_table"], p_pos if p_mask_pos is None else p_mask_pos,
                                f["p_start"] + f["p_len"])
            parts.append(out.reshape(Bp * Tp, *q.shape[1:]))
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0], (k_pool, v_pool)

    if lora:
        token_lora = jnp.concatenate([f["d_lora"], jnp.repeat(f["p_lora"], Tp)])
        hidden, kv = forward(params, tokens, positions, kv, attend,
                             lora=LoraInputs(lora_weights, token_lora, static.lora_rank))
    else:
        hidden, kv = forward(params, tokens, positions, kv, attend)
    if Bp:  # each row's last token: a prefill row's sits at its own length
        last = jnp.concatenate([jnp.arange(Bd, dtype=jnp.int32),
                                Bd + jnp.arange(Bp, dtype=jnp.int32) * Tp + jnp.maximum(f["p_len"] - 1, 0)])
        hidden = hidden[last]
    # a decode-only step's rows are its tokens: no gather (XLA kept the identity gather as a kernel of its own)
    logits = logits_fn(params, hidden)
    raw_logits = logits
    if static.decode_banned and Bd:
        logits = logits.at[:Bd, jnp.asarray(static.decode_banned)].set(-jnp.inf)
    if filtered:  # (top-k / top-p over the whole vocabulary: a shard's logits are gathered first)
        full = logits if tp is None else tp.gather_vocab(logits)
        scores = full
        if automaton is not None:
            next_state, mask, prev_states = automaton
            carry = jnp.concatenate([f["d_carry"], jnp.full((Bp,), -1, jnp.int32)])
            row_in = jnp.concatenate([d_tokens, jnp.zeros((Bp,), jnp.int32)])
            state = jnp.where(f["g_mode"] == AUTOMATON_CARRIED, prev_states[jnp.maximum(carry, 0)], f["g_state"])
            advanced = next_state[f["g_state"], row_in].astype(jnp.int32)
            state = jnp.where(f["g_mode"] == AUTOMATON_ADVANCE, advanced, state)
            scores = jnp.where(unpack_bitmask(mask[state], full.shape[-1]), full, -jnp.inf)
        tokens_out = sample(scores, f["temperature"], f["top_k"], f["top_p"], f["key"], f["sample_index"])
        if automaton is not None:
            new_state = next_state[state, tokens_out].astype(jnp.int32)
            out_states = jax.lax.dynamic_update_slice(out_states, new_state, (0,))
    else:
        tokens_out = sample_plain(logits, f["temperature"], f["key"], f["sample_index"], tp=tp)
    if spatial_fn is not None and tp is None:
        tokens_out = _spatial_rows(spatial_fn, params, hidden, raw_logits, f, d_tokens, tokens_out, Bp)
    tokens_out = mark_nonfinite(tokens_out, full if filtered else logits, None if filtered else tp)
    out_tokens = jax.lax.dynamic_update_slice(out_tokens, tokens_out, (0,))
    out_logits = jax.lax.dynamic_update_slice(out_logits, logits.astype(out_logits.dtype), (0, 0))
    if filtered and automaton is not None:
        return out_tokens, out_logits, kv, out_states
    return out_tokens, out_logits, kv


def _decode_steps(forward, logits_fn, static: StepStatic, shape: StepShape, params, kv, prev_tokens, out_tokens,
                  out_logits, f, lora_weights, **variant):
    """K = shape.steps decode steps in a `lax.fori_loop`: step j runs the one-step program's body at positions
    d_pos + j with sample index + j, its input the row's token from step j - 1 (step 0: the packed input, carried as
    usual); its tokens are kept at rows (j + 1) * max_rows.. of out_tokens, the last step's at rows 0.. (the next
    launch's carry-over). A row that ends inside the K steps runs on to the end; the commit drops what follows."""
    one = dataclasses.replace(shape, steps=1)
    K, R, M = shape.steps, shape.decode_rows, static.max_rows
    rows = jnp.arange(R, dtype=jnp.int32)

    def body(j, carry):
        kv, tokens, logits = carry
        g = {**f, "d_pos": f["d_pos"] + j, "sample_index": f["sample_index"] + j,
             "d_carry": jnp.where(j == 0, f["d_carry"], rows)}
        prev = jnp.where(j == 0, prev_tokens, tokens)
        tokens, logits, kv = engine_step(forward, logits_fn, static, one, params, kv, prev, tokens, logits, None,
                                         lora_weights, fields=g, **variant)
        keep = jax.lax.dynamic_update_slice(tokens, tokens[:R], ((j + 1) * M,))
        return kv, jnp.where(j < K - 1, keep, tokens), logits

    kv, out_tokens, out_logits = jax.lax.fori_loop(0, K, body, (kv, out_tokens, out_logits))
    return out_tokens, out_logits, kv


def _spatial_rows(spatial_fn, params, hidden, logits, f, d_tokens, tokens_out, Bp: int) -> jax.Array:
    """tokens_out with each spatial row's value (only in a step that has one: a text step skips the region heads).
    A row's previous value is its input token: a decode row's carried token, a prefill row's last chunk token (a
    recomputed row's chunk may end in a spatial id)."""
    mode = f["spatial"]
    prev = d_tokens
    if Bp:
        last = jnp.take_along_axis(f["p_tokens"], jnp.maximum(f["p_len"] - 1, 0)[:, None], axis=1)[:, 0]
        prev = jnp.concatenate([d_tokens, last])
    return jax.lax.cond(jnp.any(mode > 0),
                        lambda: jnp.where(mode > 0, spatial_fn(params, hidden, logits, mode, prev), tokens_out),
                        lambda: tokens_out)


def mark_nonfinite(tokens: jax.Array, logits: jax.Array, tp=None) -> jax.Array:
    """tokens [R] with NONFINITE where a row's logits [R, V] hold a NaN or +inf (or are all -inf): the model overflowed
    on that row (an adapter's weights, a bad input), and a sampler would turn it into some arbitrary token, silently.
    One max over the logits (NaN propagates through it). tp: the logits are this shard's columns; the flag is summed
    over the shards so that every shard writes the same tokens."""
    bad = ~jnp.isfinite(jnp.max(logits, axis=-1))
    if tp is not None:
        bad = tp.psum(bad.astype(jnp.int32)) > 0
    return jnp.where(bad, NONFINITE, tokens)


class SamplerColumns:
    """The second sampler's per-row fields ([R, SAMPLER_ROW_FIELDS] int32 of its input), by column: written by the
    runner (`Runner.sampler_input`), read by `resample`."""

    TEMPERATURE = 0  # float32 bits
    TOP_K = 1
    TOP_P = 2  # float32 bits
    KEY = slice(3, 5)  # the row's PRNG key data
    SAMPLE_INDEX = 5  # which output token the row samples (keys its draw)
    LOGPROBS = 6  # top logprobs the row wants
    N_FORCED = 7  # a forced row's candidates (0: not forced; engine/step.py `_forced`)
    FORCED = slice(8, 8 + FORCED_SET)


SAMPLER_ROW_FIELDS = 8 + FORCED_SET  # per-row words of the second sampler's input


def sampler_input_size(max_rows: int, mask_words: int, carrier: int) -> int:
    """Words of the second sampler's one packed input: [mask rows | sampler fields | carrier]."""
    return max_rows * (mask_words + SAMPLER_ROW_FIELDS) + carrier


def resample(filtered: bool, num_logprobs: int, masked: bool, logits, tokens, logprobs_buf, top_ids_buf, carrier_buf,
             inputs):
    """The second sampler, dispatched after a step only when one of its rows asks for top-k/top-p, logprobs or a
    grammar. inputs: one int32 vector, [R, W] token bitmask if masked (W = ceil(V / 32) words, bit v % 32 of word
    v // 32 = token v allowed, all ones for free rows), then [R, SAMPLER_ROW_FIELDS] per-row fields (`SamplerColumns`),
    then a
    carrier: words copied into `carrier_buf` (the next step's packed input, so that it needs no transfer of its own;
    the buffer is donated and persistent, so the step that reads it always finds it at the same address, and nothing
    is allocated per step). Every row is re-sampled
    from its own key, so a free row draws what the fused sampler drew. A *forced* row (n forced > 0: a `choice`
    branch, constrain/choice.py) takes the likeliest of its n candidates, whatever was drawn: its next token is known on
    the host when the step is planned, so it needs no mask and no wait for a commit; its logprob scores the option.
    Logprobs are those of the raw model distribution (before temperature and mask). Returns (tokens, logprobs,
    top_ids, carrier_buf)."""
    R, V = logits.shape
    W = -(-V // 32) if masked else 0
    buffer, tokens = tokens, tokens[:R]  # (the buffer holds max_rows tokens per decode step of a multi-step shape)
    rows = inputs[R * W:R * (W + SAMPLER_ROW_FIELDS)].reshape(R, SAMPLER_ROW_FIELDS)
    carrier = inputs[R * (W + SAMPLER_ROW_FIELDS):]
    C = SamplerColumns
    temperature = jax.lax.bitcast_convert_type(rows[:, C.TEMPERATURE], jnp.float32)
    top_p = jax.lax.bitcast_convert_type(rows[:, C.TOP_P], jnp.float32)
    key = jax.lax.bitcast_convert_type(rows[:, C.KEY], jnp.uint32)
    scores = logits
    if masked:
        scores = jnp.where(unpack_bitmask(inputs[:R * W].reshape(R, W), V), logits, -jnp.inf)
    if filtered or masked:  # (a row the step marked NONFINITE stays marked)
        fresh = (sample(scores, temperature, rows[:, C.TOP_K], top_p, key, rows[:, C.SAMPLE_INDEX]) if filtered
                 else sample_plain(scores, temperature, key, rows[:, C.SAMPLE_INDEX]))
        tokens = jnp.where((tokens == NONFINITE) | (tokens <= -SPATIAL_BASE), tokens, fresh)  # (spatial: kept)
    tokens = _forced(logits, tokens, rows[:, C.N_FORCED], rows[:, C.FORCED])
    if num_logprobs:
        logprobs_buf, top_ids_buf = top_logprobs(logits, tokens, num_logprobs)
    if carrier.size:
        carrier_buf = jax.lax.dynamic_update_slice(carrier_buf, carrier, (0,))
    return jax.lax.dynamic_update_slice(buffer, tokens, (0,)), logprobs_buf, top_ids_buf, carrier_buf


def _forced(logits: jax.Array, tokens: jax.Array, n: jax.Array, candidates: jax.Array) -> jax.Array:
    """tokens with each forced row's (n > 0) likeliest candidate among its first n; a NONFINITE row stays marked."""
    cand = jnp.maximum(candidates, 0)
    scores = jnp.take_along_axis(logits, cand, axis=-1)
    scores = jnp.where(jnp.arange(FORCED_SET)[None, :] < n[:, None], scores, -jnp.inf)
    best = jnp.take_along_axis(cand, jnp.argmax(scores, axis=-1)[:, None], axis=-1)[:, 0]
    return jnp.where((n > 0) & (tokens != NONFINITE), best, tokens)


def unpack_bitmask(words: jax.Array, vocab_size: int) -> jax.Array:
    """[R, W] int32 bitmask -> [R, vocab_size] bool."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)

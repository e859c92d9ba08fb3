"""The runner: the only owner of device state (params, KV pool, decode slots) and of the compiled steps.

Two `DecodeSlot`s alternate (ping-pong): each holds one step's output buffers, donated to the jitted step and handed
back, and the host landing of its async device->host copy. A slot is reused only after the commit that read it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jphoton.constraints import mask_words
from jphoton.engine.dispatch import Dispatcher
from jphoton.engine.scheduler import SchedulerConfig, StepPlan
from jphoton.engine.step import (
    SAMPLER_ROW_FIELDS,
    StepLayout,
    StepShape,
    StepStatic,
    engine_step,
    resample,
    sampler_input_size,
)
from jphoton.sampling import seed_key_data

log = logging.getLogger("jphoton.engine")


def _input_transfer():
    """The step's one packed input is handed to the jitted call as a host array: the call's own argument transfer
    (C++ dispatch, a few µs) is far cheaper than a separate `jax.device_put` (50-250 µs a step). It is the intended
    transfer, so it is allowed even where a guard polices the loop for accidental ones; every other argument is a
    device array."""
    return jax.transfer_guard_host_to_device("allow")


@dataclasses.dataclass
class DecodeSlot:
    """One step's device outputs (donated each use, so no per-step allocation) and what the host got back."""

    tokens: jax.Array  # [max_rows] int32
    logits: jax.Array  # [max_rows, V] float32: every row's logits, for the second sampler
    logprobs: jax.Array  # [max_rows, K + 1] float32: sampled token's logprob, then the top K
    top_ids: jax.Array  # [max_rows, max(K, 1)] int32
    plan: StepPlan | None = None  # the step occupying the slot, until its commit
    resampled: tuple[bool, int, bool] | None = None  # which second sampler ran, if any
    awaiting_mask: bool = False  # a grammar row's token is sampled only at finalize, after the previous commit
    job: object = None  # the dispatcher job that last wrote the arrays above (None: done inline)


class _Carried:
    """`finalize` returns this in place of the carried input (the device array exists only once the sampler's job has
    run); `launch` then reads the runner's carrier buffer when its own job runs."""

    def __repr__(self) -> str:
        return "CARRIED"


CARRIED = _Carried()


@dataclasses.dataclass
class SamplerInput:
    """The second sampler's one host->device transfer, as views into one buffer: grammar bitmasks (all ones; llguidance
    fills the grammar rows in place), per-row sampler fields, and a carrier for the next step's packed input."""

    variant: tuple[bool, int, bool]  # (filtered, logprobs, masked): which compiled sampler
    buffer: np.ndarray  # [sampler_input_size] int32
    mask: np.ndarray | None  # [max_rows, W] view, when masked
    fields: np.ndarray  # [max_rows, SAMPLER_ROW_FIELDS] view
    carrier: np.ndarray  # [packed_size] view when masked, else empty


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray
    logprobs: np.ndarray | None
    top_ids: np.ndarray | None


def all_shapes(cfg: SchedulerConfig) -> list[StepShape]:
    decode = [0, *cfg.decode_buckets]
    prefill = [(0, 0), *cfg.prefill_buckets]
    contexts = cfg.context_buckets or (0,)
    if cfg.pallas_decode:  # decode-only steps need no context bucket: one shape per decode bucket
        return ([StepShape(d, 0, 0) for d in cfg.decode_buckets]
                + [StepShape(d, r, t, c) for c in contexts for d in decode for r, t in prefill if r])
    return [StepShape(d, r, t, c) for c in contexts for d in decode for r, t in prefill if d or r]


class Runner:
    def __init__(self, model, *, sched: SchedulerConfig, num_pages: int, page_size: int, max_model_len: int,
                 max_logprobs: int, pages_per_block: int = 8, kv_dtype=None, dispatch_thread: bool = False):
        cfg = model.config
        self.model = model
        self.sched = sched
        ppb = min(pages_per_block, -(-max_model_len // page_size))
        pages_per_seq = -(-max_model_len // page_size)
        pages_per_seq = -(-pages_per_seq // ppb) * ppb
        max_rows = max(sched.decode_buckets) + max(r for r, _ in sched.prefill_buckets)
        self.static = StepStatic(pages_per_seq=pages_per_seq, page_size=page_size, pages_per_block=ppb,
                                 trash_page=num_pages, max_rows=max_rows, sliding_window=cfg.sliding_window,
                                 pallas_decode=sched.pallas_decode)
        # Every step takes an input of one length (the largest layout), whatever its shape: a step that follows a
        # grammar step gets it from the grammar sampler's carrier, as a device array of that length.
        self.packed_size = max(StepLayout(s, self.static).size for s in all_shapes(sched))
        self.max_logprobs = max_logprobs
        # Every device buffer is *committed* to the device: jit keys its cache on committedness, and a step fed an
        # uncommitted buffer at warm-up and a committed one while serving would compile twice.
        self.device = jax.devices()[0]
        self.params = jax.device_put(model.params, self.device)
        dtype = kv_dtype or jax.tree_util.tree_leaves(model.params)[0].dtype
        slots = (num_pages + 1) * page_size  # +1: the trash page that padding writes to
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim)
        self.kv = (self._zeros(shape, dtype), self._zeros(shape, dtype))
        self.kv_bytes = 2 * int(np.prod(shape)) * jnp.dtype(dtype).itemsize
        K = max_logprobs
        self.slots = [DecodeSlot(self._zeros((max_rows,), jnp.int32),
                                 self._zeros((max_rows, cfg.vocab_size), jnp.float32),
                                 self._zeros((max_rows, K + 1), jnp.float32),
                                 self._zeros((max_rows, max(K, 1)), jnp.int32)) for _ in range(2)]
        self._next_slot = 0
        self.input_transfers = 0  # host->device copies of step and sampler inputs (telemetry; tests check the count)
        self._prev_tokens = self.slots[1].tokens
        self._layouts: dict[StepShape, StepLayout] = {}
        # Shardings pinned on both jits: a step input that arrives as a host array (usual) and one that arrives as a
        # device array (carried by the grammar sampler) then share one executable; left to inference, a committed
        # device argument and an uncommitted host one compile twice.
        on_device = jax.sharding.SingleDeviceSharding(self.device)
        self._step = jax.jit(functools.partial(engine_step, model.forward, model.logits, self.static),
                             static_argnums=(0,), donate_argnums=(2, 4, 5), in_shardings=on_device,
                             out_shardings=on_device)
        self._resample = jax.jit(resample, static_argnums=(0, 1, 2), donate_argnums=(4, 5, 6, 7),
                                 in_shardings=on_device, out_shardings=on_device)
        self.mask_words = mask_words(cfg.vocab_size)
        self.carrier = self._zeros((self.packed_size,), jnp.int32)  # the next step's input, when a sampler carries it
        # Device calls (and the device state they replace: kv, slot arrays, carrier, _prev_tokens) belong to the
        # dispatcher's jobs; the engine thread keeps to host bookkeeping and waits only in fetch (engine/dispatch.py).
        self.dispatcher = Dispatcher(dispatch_thread)
        self._last_launched: DecodeSlot | None = None

    def _zeros(self, shape, dtype) -> jax.Array:
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    def layout(self, shape: StepShape) -> StepLayout:
        if shape not in self._layouts:
            self._layouts[shape] = StepLayout(shape, self.static, self.packed_size)
        return self._layouts[shape]

    # ---- compile ---------------------------------------------------------------------------------------------------
    def warmup(self, shapes: Iterable[StepShape] | None = None, progress: bool = False) -> float:
        """Compile (and run once, all rows padding) every bucket shape, so serving never compiles."""
        shapes = list(shapes if shapes is not None else all_shapes(self.sched))
        t0 = time.perf_counter()
        it = shapes
        if progress:
            from tqdm import tqdm

            it = tqdm(shapes, desc="compiling step buckets", unit="shape")
        self.dispatcher.drain()
        for shape in it:  # slots alternate as in serving: a step never donates the buffer it reads as prev_tokens
            inputs = self.layout(shape).empty(self.static.trash_page)["_buffer"]
            self._dispatch_into(self.slots[self._next_slot], shape, inputs)
            self._next_slot ^= 1
        for variant in self.resample_variants():
            self._resample_into(self.slots[0], self._sampler_input(variant))
        jax.block_until_ready(self.kv)
        elapsed = time.perf_counter() - t0
        log.info("compiled %d step shapes in %.1fs", len(shapes), elapsed)
        return elapsed

    # ---- one step --------------------------------------------------------------------------------------------------
    def pack(self, plan: StepPlan) -> tuple[StepShape, np.ndarray]:
        pr, pt = plan.prefill_bucket
        shape = StepShape(plan.decode_bucket, pr, pt, plan.context_bucket)
        v = self.layout(shape).empty(self.static.trash_page)
        # Column-wise fills (one numpy call per field, not per row): packing is on the host's critical path.
        if d := plan.decode:
            n = len(d)
            v["d_tokens"][:n] = [row.tokens[0] if row.tokens else 0 for row in d]
            v["d_carry"][:n] = [row.carry_from for row in d]
            v["d_pos"][:n] = [row.start for row in d]
            _fill_ragged(v["d_table"], [row.seq.block_table for row in d])
        for j, row in enumerate(plan.prefill):
            v["p_tokens"][j, :row.num_tokens] = row.tokens
            v["p_start"][j] = row.start
            v["p_len"][j] = row.num_tokens
            table = row.seq.block_table
            v["p_table"][j, :len(table)] = table
        rows = plan.rows
        out = [row.out_row for row in rows]
        v["temperature"].view(np.float32)[out] = [row.seq.params.temperature for row in rows]
        v["key"][out] = seed_key_data(np.array([row.seq.seed for row in rows], np.uint64)).view(np.int32)
        v["sample_index"][out] = [row.sample_index for row in rows]
        return shape, v["_buffer"]

    def resample_variants(self) -> list[tuple[bool, int, bool]]:
        """(filtered, logprobs, masked) second samplers, each compiled at warm-up."""
        lps = (0, self.max_logprobs) if self.max_logprobs else (0,)
        return [(f, k, m) for m in (False, True) for f in (False, True) for k in lps if f or k or m]

    def _sampler_input(self, variant: tuple[bool, int, bool]) -> SamplerInput:
        R, W = self.static.max_rows, self.mask_words if variant[2] else 0
        carrier = self.packed_size if variant[2] else 0
        buf = np.empty(sampler_input_size(R, W, carrier), np.int32)
        mask = buf[:R * W].reshape(R, W) if W else None
        if mask is not None:
            mask.fill(-1)
        fields = buf[R * W:R * (W + SAMPLER_ROW_FIELDS)].reshape(R, SAMPLER_ROW_FIELDS)
        fields[:] = 0
        fields[:, 2] = np.float32(1.0).view(np.int32)  # top_p 1 on padding rows
        return SamplerInput(variant, buf, mask, fields, buf[R * (W + SAMPLER_ROW_FIELDS):])

    def sampler_input(self, plan: StepPlan, masked: bool = False) -> SamplerInput | None:
        """The second sampler this step needs (filters? logprobs? grammar masks?) with its per-row fields filled and
        the mask words all ones, or None (the usual case)."""
        filtered = any(r.samples and r.seq.params.temperature > 0 and (r.seq.params.top_k or r.seq.params.top_p < 1)
                       for r in plan.rows)
        want_lp = any(r.seq.params.logprobs for r in plan.rows)
        if not filtered and not want_lp and not masked:
            return None
        inp = self._sampler_input((filtered, self.max_logprobs if want_lp else 0, masked))
        rows = inp.fields
        out = [row.out_row for row in plan.rows]
        params = [row.seq.params for row in plan.rows]
        rows[out, 0] = np.array([p.temperature for p in params], np.float32).view(np.int32)
        rows[out, 1] = [p.top_k for p in params]
        rows[out, 2] = np.array([p.top_p for p in params], np.float32).view(np.int32)
        rows[out, 3:5] = seed_key_data(np.array([row.seq.seed for row in plan.rows], np.uint64)).view(np.int32)
        rows[out, 5] = [row.sample_index for row in plan.rows]
        rows[out, 6] = [p.logprobs or 0 for p in params]
        return inp

    def launch(self, plan: StepPlan, record=None, defer_sampling: bool = False,
               packed: tuple[StepShape, np.ndarray | _Carried] | None = None) -> DecodeSlot:
        """Dispatch the step into the next free slot and start copying its results to the host. Never waits.
        defer_sampling: the step has grammar rows, whose tokens are drawn by `finalize` once their masks exist; the
        forward (and the logits) run now all the same. packed: `pack(plan)` if done ahead, or what `finalize`
        returned for it (the input rode in the sampler's transfer)."""
        shape, packed = packed or self.pack(plan)
        if record is not None:
            record.t_packed = time.perf_counter()
        slot = self.slots[self._next_slot]
        assert slot.plan is None, "slot reused before the commit that reads it"
        self._next_slot ^= 1
        self._last_launched = slot
        second = None if defer_sampling else self.sampler_input(plan)
        slot.plan, slot.awaiting_mask = plan, defer_sampling
        slot.resampled = second.variant if second is not None else None
        self.input_transfers += (packed is not CARRIED) + (second is not None)

        def job():
            self._dispatch_into(slot, shape, self.carrier if packed is CARRIED else packed, record)
            if second is not None:
                self._resample_into(slot, second)
            if not defer_sampling:
                self._copy_to_host(slot)

        slot.job = self.dispatcher.submit(job)
        return slot

    def finalize(self, slot: DecodeSlot, inp: SamplerInput,
                 then: tuple[StepShape, np.ndarray] | None = None) -> tuple[StepShape, _Carried] | None:
        """Sample a deferred step with its grammar masks (`inp` from `sampler_input(slot.plan, masked=True)`, mask
        rows filled), then start its host copy. Only the latest launched step can be finalized: the next launch reads
        its tokens. then: the next step's packed input, if already planned: it rides in this transfer, and the
        returned (shape, CARRIED) is what `launch` takes for it, so that the step costs no transfer of its own."""
        assert slot.awaiting_mask and slot is self._last_launched, "finalize out of order"
        assert inp.variant[2], "finalize needs a masked sampler input"
        if then is not None and then[1].size != inp.carrier.size:  # a shape outside the buckets (benchmarks only)
            then = None
        if then is not None:
            inp.carrier[:] = then[1]
        slot.awaiting_mask, slot.resampled = False, inp.variant
        self.input_transfers += 1

        def job():
            self._resample_into(slot, inp)
            self._copy_to_host(slot)

        slot.job = self.dispatcher.submit(job)
        return (then[0], CARRIED) if then is not None else None

    @staticmethod
    def _copy_to_host(slot: DecodeSlot) -> None:
        # An intended, explicit copy: allowed even where a transfer guard polices the loop for accidental ones.
        with jax.transfer_guard_device_to_host("allow"):
            slot.tokens.copy_to_host_async()
            if slot.resampled and slot.resampled[1]:
                slot.logprobs.copy_to_host_async()
                slot.top_ids.copy_to_host_async()

    def _resample_into(self, slot: DecodeSlot, inp: SamplerInput) -> None:
        # One more host->device copy, only for steps with top-k/top-p, logprobs or grammar rows.
        feeds_next = self._prev_tokens is slot.tokens
        with _input_transfer():
            slot.tokens, slot.logprobs, slot.top_ids, self.carrier = self._resample(
                *inp.variant, slot.logits, slot.tokens, slot.logprobs, slot.top_ids, self.carrier, inp.buffer)
        if feeds_next:  # the next step's carry-over must read the resampled tokens (the old buffer was donated)
            self._prev_tokens = slot.tokens

    def _dispatch_into(self, slot: DecodeSlot, shape: StepShape, packed: np.ndarray | jax.Array, record=None) -> None:
        """Run one step into `slot`: one host->device copy (none if packed is already on the device), outputs and KV
        donated."""
        if record is not None:
            record.t_put = time.perf_counter()
        with _input_transfer():
            slot.tokens, slot.logits, self.kv = self._step(
                shape, self.params, self.kv, self._prev_tokens, slot.tokens, slot.logits, packed)
        if record is not None:
            record.t_dispatched = time.perf_counter()
        self._prev_tokens = slot.tokens

    def fetch(self, slot: DecodeSlot) -> StepResult:
        """Wait for the slot's host copy (explicit transfer) and free the slot."""
        assert not slot.awaiting_mask, "a deferred step must be finalized before its commit"
        self.dispatcher.wait(slot.job)
        want_lp = bool(slot.resampled and slot.resampled[1])
        tokens = jax.device_get(slot.tokens)
        lp, ids = (jax.device_get(slot.logprobs), jax.device_get(slot.top_ids)) if want_lp else (None, None)
        slot.plan = None
        return StepResult(np.asarray(tokens), lp, ids)


def _fill_ragged(out: np.ndarray, rows: list[list[int]]) -> None:
    """out[i, :len(rows[i])] = rows[i] for every i, as one masked assignment: a numpy assignment per row cost ~1.3 us
    each, most of the ~190 us that packing 128 decode rows took on the CPU here (benchmarks/host_overhead.py)."""
    if len(rows) <= 8:  # the masked assignment's fixed cost (~10 us of numpy calls) is more than a few rows' loop
        for i, row in enumerate(rows):
            out[i, :len(row)] = row
        return
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    total = int(lengths.sum())
    if total:
        filled = np.arange(out.shape[1])[None, :] < lengths[:, None]  # row-major, like the flattened tables
        out[:len(rows)][filled] = np.fromiter(itertools.chain.from_iterable(rows), np.int32, total)

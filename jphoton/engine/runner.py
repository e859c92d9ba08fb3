"""The runner: the only owner of device state (params, KV pool, decode slots) and of the compiled steps. Device work
only: pack a planned step into its one input, dispatch it, sample, start the host copy, fetch; warm-up. The pipeline
(engine/pipeline.py) decides when.

`DecodeSlot`s are used in turn, one per step in flight (two at pipeline depth 2): each holds one step's output
buffers, donated to the jitted step and handed back. A slot is reused only after the commit that read it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jphoton
from jphoton.constrain.compiler import mask_words
from jphoton.engine import sharded
from jphoton.engine.config import EngineConfig
from jphoton.engine.packing import StepPacker
from jphoton.engine.plan import CONSTRAINED, FILTERS, LOGPROBS, LORA, StepPlan, StepShape
from jphoton.engine.sampling import seed_key_data
from jphoton.engine.slots import DecodeSlot, PlannedStep, SamplerInput, SamplerVariant, StepInput, StepResult
from jphoton.engine.step import (
    SAMPLER_ROW_FIELDS,
    SamplerColumns,
    StepLayout,
    StepStatic,
    engine_step,
    resample,
    sampler_input_size,
)
from jphoton.engine.telemetry import StepRecord
from jphoton.models import lora as lora_lib
from jphoton.models import tensor_parallel

log = logging.getLogger("jphoton.engine")


def _input_transfer():
    """The step's one packed input is handed to the jitted call as a host array: the call's own argument transfer
    (C++ dispatch, a few µs) is far cheaper than a separate `jax.device_put` (50-250 µs a step). It is the intended
    transfer, so it is allowed even where a guard polices the loop for accidental ones; every other argument is a
    device array."""
    return jax.transfer_guard_host_to_device("allow")


class Runner:
    def __init__(self, model, config: EngineConfig, num_pages: int, pages_per_block: int = 8, abstract: bool = False):
        """abstract: model.params are `jax.ShapeDtypeStruct`s in the serving layout (LoRA columns included) and every
        device buffer is one too: a runner that only lowers and compiles the steps (engine/compile_worker.py)."""
        cfg = model.config
        self.abstract = abstract
        self.model = model
        self.sched = config.scheduler_config()
        page_size, max_model_len = config.page_size, config.max_model_len
        ppb = min(pages_per_block, -(-max_model_len // page_size))
        pages_per_seq = -(-max_model_len // page_size)
        pages_per_seq = -(-pages_per_seq // ppb) * ppb
        max_rows = max(self.sched.decode_buckets) + max(r for r, _ in self.sched.prefill_buckets)
        self.lora_enabled = config.max_loras > 0
        if self.lora_enabled and not getattr(model, "supports_lora", False):
            raise ValueError(f"max_loras={config.max_loras}: model {model.name!r} does not support LoRA adapters "
                             "(dense Llama-family models do; a JaxModel's forward must take lora=)")
        self.static = StepStatic(pages_per_seq=pages_per_seq, page_size=page_size, pages_per_block=ppb,
                                 trash_page=num_pages, max_rows=max_rows, sliding_window=cfg.sliding_window,
                                 pallas_attention=config.kernels.attention == "pallas", lora_slots=config.max_loras,
                                 lora_rank=config.max_lora_rank if self.lora_enabled else 0,
                                 image_prefix=getattr(model, "vision", None) is not None,
                                 decode_banned=tuple(getattr(model, "decode_banned_tokens", ())))
        self.vision = getattr(model, "vision", None)  # the image encoder (models/protocol.py Vision), or None
        self.vision_ready: set[int] = set()  # crop buckets whose vision step is compiled (engine/warmup.py)
        # Every step takes an input of one length (the largest layout), whatever its shape: a step that follows a
        # grammar step gets it from the grammar sampler's carrier, as a device array of that length.
        self.packed_size = max(StepLayout(s, self.static).size for s in self.sched.all_shapes())
        self.max_logprobs = config.max_logprobs
        # Every device buffer is *committed* to the device: jit keys its cache on committedness, and a step fed an
        # uncommitted buffer at warm-up and a committed one while serving would compile twice.
        self.device = jax.devices()[0]
        # Tensor parallelism (models/tensor_parallel.py): params arrive placed on the mesh, the KV pool is sharded by
        # KV head and the logits buffers by vocabulary, every other buffer is replicated; the step runs under shard_map.
        self.tp, self.mesh = model.tensor_parallel or (None, None)
        if self.tp is not None and self.vision is not None:
            raise ValueError("tensor_parallel_size > 1 with an image model is not supported yet; serve it on one device")
        if self.tp is not None and self.lora_enabled:
            raise ValueError("max_loras > 0 with tensor_parallel_size > 1 is not supported yet (LoRA slots are not "
                             "sharded); serve adapters on one device")
        if self.tp is not None and jphoton.ONE_SHOT_FLAG_LATE and self.mesh.devices.flat[0].platform == "gpu":
            log.warning("JAX started its GPU backend before jphoton was imported, so XLA's one-shot all-reduce kernel "
                        "stays on: every compiled program then holds ~6 MiB a GPU per all-reduce outside JAX's pool. "
                        "Import jphoton first, or set XLA_FLAGS=%s=false (docs/tensor-parallel.md)",
                        jphoton.ONE_SHOT_FLAG)
        if self.tp is None:
            on_device = jax.sharding.SingleDeviceSharding(self.device)
            kv_sharding = logits_sharding = on_device
            kv_heads = cfg.num_kv_heads
        else:
            on_device = NamedSharding(self.mesh, P())  # replicated
            kv_sharding = NamedSharding(self.mesh, sharded.KV_SPEC)
            logits_sharding = NamedSharding(self.mesh, sharded.LOGITS_SPEC)
            kv_heads = tensor_parallel.kv_heads(cfg, self.tp.size)
        self._sharding = on_device
        self._make_buffers(model, config, num_pages, max_rows, kv_heads, on_device, kv_sharding, logits_sharding)
        self._make_programs(model, page_size, on_device, kv_sharding, logits_sharding)

    def _make_buffers(self, model, config: EngineConfig, num_pages: int, max_rows: int, kv_heads: int, on_device,
                      kv_sharding, logits_sharding) -> None:
        """The device state: params (placed), the KV pool, the automaton tables, the decode slots' output buffers,
        the LoRA slot weights (and their writers), the carrier. Abstract runners get ShapeDtypeStructs."""
        cfg, abstract, page_size = model.config, self.abstract, config.page_size
        if self.lora_enabled and not abstract:  # q|k|v's and gate|up's LoRA A ride in extra columns (models/lora.py)
            lora_lib.extend_params(cfg, model.params, config.max_loras, config.max_lora_rank)
        if abstract:
            self.params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device), model.params)
        else:
            self.params = jax.device_put(model.params, self.device) if self.tp is None else model.params
        dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
        slots = (num_pages + 1) * page_size  # +1: the trash page that padding writes to
        shape = (cfg.num_layers, slots, kv_heads, cfg.head_dim)
        self.kv = (self._zeros(shape, dtype, kv_sharding), self._zeros(shape, dtype, kv_sharding))
        self.kv_bytes = 2 * int(np.prod(shape)) * jnp.dtype(dtype).itemsize  # all shards together
        K = self.max_logprobs
        # Device automata (jphoton/constrain/automaton.py): next-state and mask tables, row 0 the free state (every token
        # allowed, every token back to 0). Not under tensor parallelism (the masks would need the vocabulary shards).
        self.automaton_states = config.automaton_states if self.tp is None else 0
        self.mask_words = mask_words(cfg.vocab_size)
        self.automaton = None
        if self.automaton_states:
            S, W = self.automaton_states, self.mask_words
            if abstract:
                self.automaton = (jax.ShapeDtypeStruct((S, cfg.vocab_size), jnp.int16, sharding=on_device),
                                  jax.ShapeDtypeStruct((S, W), jnp.int32, sharding=on_device))
            else:
                self.automaton = (self._zeros((S, cfg.vocab_size), jnp.int16),
                                  jax.jit(lambda: jnp.zeros((S, W), jnp.int32).at[0].set(-1),
                                          out_shardings=on_device)())
        # tokens: max_rows a decode step, for the most steps a launch runs (step.py `engine_step`, plan.py `step_tokens`)
        self.slots = [DecodeSlot(self._zeros((max_rows * self.sched.decode_steps,), jnp.int32),
                                 self._zeros((max_rows, cfg.vocab_size), jnp.float32, logits_sharding),
                                 self._zeros((max_rows, K + 1), jnp.float32),
                                 self._zeros((max_rows, max(K, 1)), jnp.int32),
                                 self._zeros((max_rows,), jnp.int32) if self.automaton_states else None)
                      for _ in range(max(2, config.pipeline_depth))]  # one per step in flight
        self._next_slot = 0
        self.input_transfers = 0  # host->device copies of step and sampler inputs (telemetry; tests check the count)
        self._prev_tokens = self.slots[-1].tokens  # the last dispatched step's tokens: the next step's carry-over
        self._prev_states = self.slots[-1].states  # and its rows' automaton states (filtered steps write them)
        self.packer = StepPacker(self.static, self.packed_size, self.lora_enabled)
        # LoRA slot weights (models/lora.py), in the params' layer layout; None when LoRA is off.
        self.lora_weights = None
        if self.lora_enabled:
            per_layer = isinstance(model.params.get("layers"), (tuple, list))
            host = lora_lib.init_weights(cfg, config.max_loras, config.max_lora_rank, dtype, per_layer)
            self.lora_weights = self._put(host)
            self._per_layer_lora = per_layer
            self._write_lora = jax.jit(lora_lib.write_slot, donate_argnums=(0,), in_shardings=on_device,
                                       out_shardings=on_device)
            self._write_inline = jax.jit(functools.partial(lora_lib.write_inline, base=lora_lib.base_columns(cfg)),
                                         donate_argnums=(0,), in_shardings=on_device, out_shardings=on_device)
        self.carrier = self._zeros((self.packed_size,), jnp.int32)  # the next step's input, when a sampler carries it

    def _make_programs(self, model, page_size: int, on_device, kv_sharding, logits_sharding) -> None:
        """The jitted step variants, the second sampler, the table writes and page copies, and the abstract
        arguments their ahead-of-time compiles take."""
        abstract = self.abstract
        step = functools.partial(engine_step, model.forward, model.logits, self.static,
                                 spatial_fn=getattr(model, "spatial", None))
        # Shardings pinned on the jits: a step input that arrives as a host array (usual) and one that arrives as a
        # device array (carried by the grammar sampler) then share one executable; left to inference, a committed
        # device argument and an uncommitted host one compile twice.
        if self.tp is None:
            jit = functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 4, 5, 9),
                                    in_shardings=on_device, out_shardings=on_device)
        else:
            param_specs = tensor_parallel.param_specs(self.params)
            sharded.check_placement(self.params, self.mesh, param_specs)
            jit = sharded.step_jit(self.params, kv_sharding, logits_sharding, on_device)
            step = sharded.sharded_step(step, self.tp, self.mesh, param_specs)
        # Step variants by (filtered, lora). Steps whose rows ask for top-k / top-p or use a device automaton sample in
        # a filtered variant (one launch, not two); steps with a row that uses a LoRA adapter run a LoRA variant (the
        # base variants carry no LoRA op: an engine with adapters loaded serves base rows at base speed).
        self._steps = {(f, lo): jit(functools.partial(step, filtered=f, lora=lo))
                       for f in (False, True) for lo in ((False, True) if self.lora_enabled else (False,))}
        # None: compile on demand (no warm-up); else the shapes whose filtered variants are compiled so far (Warmup
        # fills it), and a step whose variant is not ready yet samples through the second sampler instead.
        self.filtered_ready: set[StepShape] | None = None
        resample_fn = resample if self.tp is None else sharded.sharded_resample(self.tp, self.mesh)
        resample_in = on_device if self.tp is None else (logits_sharding, *[on_device] * 5)
        self._resample = jax.jit(resample_fn, static_argnums=(0, 1, 2), donate_argnums=(4, 5, 6, 7),
                                 in_shardings=resample_in, out_shardings=on_device)
        self._last_launched: DecodeSlot | None = None

        def spec(a):  # abstract arguments for ahead-of-time compiles (shape, dtype, sharding of the live buffers)
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

        slot = self.slots[0]
        self._param_specs = jax.tree.map(spec, self.params)
        self._step_specs = (jax.tree.map(spec, self.text_params()), jax.tree.map(spec, self.kv), spec(slot.tokens),
                            spec(slot.tokens), spec(slot.logits),
                            jax.ShapeDtypeStruct((self.packed_size,), jnp.int32, sharding=on_device),
                            jax.tree.map(spec, self.lora_weights))
        self._automaton_specs = None if self.automaton is None else (
            (*map(spec, self.automaton), spec(slot.states)), spec(slot.states))
        self._programs: dict[tuple, jax.stages.Compiled] = {}  # `install`: programs compiled by another process
        self.first_ran: set[tuple] = set()  # programs run once already (`first_run`)
        if self.automaton is not None:
            self._write_automaton = jax.jit(_write_automaton_rows, donate_argnums=(0, 1), in_shardings=on_device,
                                            out_shardings=on_device)
        # KV page copies (a `choice` branch's own copy of its leader's last prompt page, StepPlan.page_copies), in
        # chunks of one compiled shape: as many pairs as a step has decode rows at most
        self.page_copy_chunk = self.sched.decode_buckets[-1]
        self._copy_pages = jax.jit(functools.partial(_copy_kv_pages, page_size=page_size), donate_argnums=(0,),
                                   in_shardings=((kv_sharding, kv_sharding), on_device),
                                   out_shardings=(kv_sharding, kv_sharding))
        if self.vision is not None:  # the vision step: one image's crops -> its embeddings in the params' image cache
            self._encode_image = jax.jit(self.vision.encode, donate_argnums=(0,), in_shardings=on_device,
                                         out_shardings=on_device)
        if not abstract:
            self.compile_table_writes()
        self._sampler_specs = (spec(slot.logits), spec(slot.tokens), spec(slot.logprobs), spec(slot.top_ids),
                               spec(self.carrier))


    def compile_table_writes(self) -> None:
        """Compile the automaton-table and LoRA-slot writes now (at start-up and in `warmup`, which is also the re-warm
        after `jax.clear_caches()`): a new automaton or adapter then serves without a compile."""
        self._copy_pages.lower(self._step_specs[1], jax.ShapeDtypeStruct((self.page_copy_chunk, 2), jnp.int32,
                                                                         sharding=self._sharding)).compile()
        if self.automaton is not None:
            tables = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in self.automaton]
            self._write_automaton.lower(*tables, *_automaton_chunk_specs(self.model.config.vocab_size,
                                                                          self.mask_words)).compile()
        if self.lora_enabled:
            cfg, rank = self.model.config, self.static.lora_rank
            blocks = lora_lib.slot_blocks(cfg, None, rank)
            if not self._per_layer_lora:
                blocks = lora_lib.stack_blocks(blocks)
            blocks = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), blocks)
            index = jax.ShapeDtypeStruct((), jnp.int32)
            self._write_lora.lower(self._step_specs[-1], index, blocks).compile()
            self._write_inline.lower(self._param_specs, index, blocks).compile()

    def lower_vision(self, bucket: int):
        """The vision step for `bucket` crops, lowered (`.compile()` it; the engine uses it once `vision_ready` holds
        the bucket)."""
        return self._encode_image.lower(self._param_specs, *self._image_specs(bucket))

    def text_params(self):
        """The params the steps read: all of them, or for a model with an image encoder the top-level entries its text
        steps use (models/protocol.py `Vision.text_keys`; every leaf passed costs the step's dispatch time)."""
        keys = self.vision.text_keys if self.vision is not None else ()
        return {k: self.params[k] for k in keys} if keys else self.params

    def compile_vision(self, bucket: int) -> None:
        self.lower_vision(bucket).compile()
        self.vision_ready.add(bucket)

    def _image_specs(self, n: int) -> tuple:
        v, on = self.vision, self._sharding
        g = v.crop_size // v.patch_size
        return (jax.ShapeDtypeStruct((), jnp.int32, sharding=on),
                jax.ShapeDtypeStruct((n, v.crop_size, v.crop_size, 3), jnp.uint8, sharding=on),
                jax.ShapeDtypeStruct((n - 1, g, g), jnp.float32, sharding=on),
                jax.ShapeDtypeStruct((n - 1, g, g), jnp.float32, sharding=on))

    def encode_image(self, slot: int, crops: np.ndarray, pool_rows: np.ndarray, pool_cols: np.ndarray) -> None:
        """Dispatch the vision step for one image (its crops padded to the smallest bucket that holds them) into the
        image cache's `slot`: ordered after every step already dispatched and before the next, which reads it."""
        n = len(crops)
        # the smallest compiled bucket that holds them (warm-up compiles the largest first); none (warmup "off"): the
        # smallest bucket that holds them, compiled now
        bucket = min((b for b in tuple(self.vision_ready) if b >= n), default=None) or next(
            b for b in self.vision.crop_buckets if b >= n)
        self.vision_ready.add(bucket)
        c = np.zeros((bucket, *crops.shape[1:]), np.uint8)
        c[:n] = crops
        r, k = (np.zeros((bucket - 1, *a.shape[1:]), np.float32) for a in (pool_rows, pool_cols))
        r[:n - 1], k[:n - 1] = pool_rows, pool_cols
        with _input_transfer():
            self.params = self._encode_image(self.params, np.int32(slot), c, r, k)

    def _zeros(self, shape, dtype, sharding=None) -> jax.Array:
        if self.abstract:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or self._sharding)
        return tensor_parallel.zeros(shape, dtype, sharding or self._sharding)

    def _put(self, host):
        if self.abstract:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._sharding), host)
        return jax.device_put(host, self.device)

    def install(self, key: tuple, program: jax.stages.Compiled) -> None:
        """Use `program` (compiled elsewhere: engine/compile_worker.py) for ("step", shape, filtered, lora) or
        ("sampler", variant) instead of the jitted function's own compile."""
        self._programs[key] = program

    def layout(self, shape: StepShape) -> StepLayout:
        return self.packer.layout(shape)

    # ---- compile ---------------------------------------------------------------------------------------------------
    def compile_step(self, shape: StepShape, filtered: bool = False) -> None:
        """Compile one step shape ahead of time (safe from another thread while the engine runs: it lowers from
        abstract arguments, never the live buffers that steps donate). The jitted step's own cache is filled, so the
        engine's next call with this shape dispatches at once. filtered: its top-k / top-p variant. With LoRA on, the
        shape's LoRA variant compiles with it (a shape is ready when both are)."""
        for lowered in self.lower_step(shape, filtered):
            lowered.compile()
        if filtered and self.filtered_ready is not None:
            self.filtered_ready.add(shape)

    def lower_step(self, shape: StepShape, filtered: bool = False) -> list:
        """`compile_step`'s first half, the Python trace (holds the GIL): its programs, lowered, to `.compile()` (XLA,
        releases the GIL) later or on another thread."""
        automaton = self._automaton_specs if filtered and self._automaton_specs else (None, None)
        return [self._steps[filtered, lora].lower(shape, *self._step_specs[:-1], self._step_specs[-1] if lora else None,
                                                  *automaton)
                for lora in ((False, True) if self.lora_enabled else (False,))]

    def filtered_shapes(self) -> list[StepShape]:
        """The shapes that have a filtered variant (top-k / top-p rows and device automata sample in it): every shape,
        one more program each, decode-only shapes first (warm-up compiles them in this order). Prefill and mixed
        steps have one since device automata: each new constrained request draws its first token in one, and a step
        sampled at a finalize instead holds up the whole batch for the host."""
        shapes = [s for s in self.sched.all_shapes() if s.steps == 1]  # (K-step launches take plain rows only)
        return [s for s in shapes if not s.prefill_rows] + [s for s in shapes if s.prefill_rows]

    def compile_sampler(self, variant: SamplerVariant) -> None:
        """Compile one second sampler ahead of time (as `compile_step`)."""
        self.lower_sampler(variant).compile()

    def lower_sampler(self, variant: SamplerVariant):
        """`compile_sampler`'s first half (as `lower_step`)."""
        buffer = jax.ShapeDtypeStruct(self._sampler_input(variant).buffer.shape, jnp.int32, sharding=self._sharding)
        return self._resample.lower(*variant, *self._sampler_specs, buffer)

    def warmup(self, shapes: Iterable[StepShape] | None = None, progress: bool = False) -> float:
        """Compile every given step shape (default: all) and every second sampler now, so serving never compiles."""
        shapes = list(shapes if shapes is not None else self.sched.all_shapes())
        t0 = time.perf_counter()
        it = shapes
        if progress:
            from tqdm import tqdm

            it = tqdm(shapes, desc="compiling step shapes", unit="shape")
        for shape in it:
            self.compile_step(shape)
        for variant in self.sampler_variants():
            self.compile_sampler(variant)
        for shape in self.filtered_shapes():
            self.compile_step(shape, filtered=True)
        self.compile_table_writes()
        for bucket in self.vision.crop_buckets if self.vision is not None else ():
            self.compile_vision(bucket)
        elapsed = time.perf_counter() - t0
        log.info("compiled %d step shapes in %.1fs", len(shapes), elapsed)
        return elapsed

    def sampler_variants(self) -> list[SamplerVariant]:
        """Every second sampler a step may need (compiled at warm-up)."""
        lps = (0, self.max_logprobs) if self.max_logprobs else (0,)
        return [SamplerVariant(f, k, m) for m in (False, True) for f in (False, True) for k in lps if f or k or m]

    # ---- one step --------------------------------------------------------------------------------------------------
    def pack(self, plan: StepPlan, automata: bool = False) -> StepInput:
        """The step's one packed host input (engine/packing.py); automata: its automaton rows sample in the step."""
        return self.packer.pack(plan, automata)

    def _sampler_input(self, variant: SamplerVariant) -> SamplerInput:
        R, W = self.static.max_rows, self.mask_words if variant.masked else 0
        carrier = self.packed_size if variant.masked else 0
        buf = np.empty(sampler_input_size(R, W, carrier), np.int32)
        mask = buf[:R * W].reshape(R, W) if W else None
        if mask is not None:
            mask.fill(-1)
        fields = buf[R * W:R * (W + SAMPLER_ROW_FIELDS)].reshape(R, SAMPLER_ROW_FIELDS)
        fields[:] = 0
        fields[:, SamplerColumns.TOP_P] = np.float32(1.0).view(np.int32)  # top_p 1 on padding rows
        return SamplerInput(variant, buf, mask, fields, buf[R * (W + SAMPLER_ROW_FIELDS):])

    def uses_lora(self, plan: StepPlan) -> bool:
        """A row of the step uses a LoRA adapter: the step runs its LoRA variant."""
        return self.lora_enabled and bool(plan.flags & LORA)

    def load_lora(self, slot: int, adapter) -> None:
        """Write an adapter (weights/peft.py PeftAdapter) into slot `slot` of the device weights: one precompiled,
        donated update, ordered after every step already dispatched. The slot must be free (engine/loras.py)."""
        blocks = lora_lib.slot_blocks(self.model.config, adapter, self.static.lora_rank)
        if not self._per_layer_lora:
            blocks = lora_lib.stack_blocks(blocks)
        with _input_transfer():
            self.lora_weights = self._write_lora(self.lora_weights, np.int32(slot), blocks)
            self.params = self._write_inline(self.params, np.int32(slot), blocks)

    @staticmethod
    def wants_filters(plan: StepPlan) -> bool:
        return bool(plan.flags & FILTERS)

    def has_filtered_variant(self, plan: StepPlan) -> bool:
        """The step can sample top-k / top-p rows and device automata itself: its filtered variant exists (or,
        before warm-up, may compile now)."""
        ready = self.filtered_ready
        return ready is None or plan.shape in ready

    def sampler_input(self, plan: StepPlan, masked: bool = False, filtered: bool | None = None
                      ) -> SamplerInput | None:
        """The second sampler this step needs (filters? logprobs? grammar masks?) with its per-row fields filled and
        the mask words all ones, or None (the usual case: the sampler in the step is enough). filtered: whether it
        applies top-k / top-p (default: if any row asks)."""
        if filtered is None:
            filtered = self.wants_filters(plan)
        want_lp = bool(plan.flags & LOGPROBS)  # (else 0: the chosen token's only)
        forced = [(row.out_row, c.forced(row.sample_index)) for row in plan.rows
                  if row.samples and (c := row.seq.constraint) is not None and c.kind == "forced"
                  ] if plan.flags & CONSTRAINED else []
        if not filtered and not want_lp and not masked and not forced:
            return None
        inp = self._sampler_input(SamplerVariant(filtered, self.max_logprobs if want_lp else 0, masked))
        rows = inp.fields
        plan_rows = plan.rows
        out = [row.out_row for row in plan_rows]
        params = [row.seq.params for row in plan_rows]
        C = SamplerColumns
        rows[out, C.TEMPERATURE] = np.array([p.temperature for p in params], np.float32).view(np.int32)
        rows[out, C.TOP_K] = [p.top_k for p in params]
        rows[out, C.TOP_P] = np.array([p.top_p for p in params], np.float32).view(np.int32)
        rows[out, C.KEY] = seed_key_data(np.array([row.seq.seed for row in plan_rows], np.uint64)).view(np.int32)
        rows[out, C.SAMPLE_INDEX] = [row.sample_index for row in plan_rows]
        rows[out, C.LOGPROBS] = [p.logprobs or 0 for p in params]
        for out_row, tokens in forced:  # choice branches: the device takes the likeliest of these (step.py resample)
            if tokens is not None:
                rows[out_row, C.N_FORCED] = len(tokens)
                rows[out_row, C.FORCED.start:C.FORCED.start + len(tokens)] = tokens
        return inp

    @property
    def last_launched(self) -> DecodeSlot | None:
        """The slot of the step launched last (its tokens are the next step's carry-over)."""
        return self._last_launched

    def launch(self, step: PlannedStep, defer_sampling: bool = False) -> DecodeSlot:
        """Dispatch the step into the next free slot and start copying its tokens to the host. Never waits.
        defer_sampling: the step has grammar rows, whose tokens are drawn by `finalize` once their masks exist; the
        forward (and the logits) run now all the same."""
        slot = self._take_slot()
        assert slot.step is None, "slot reused before the commit that reads it"
        self._last_launched = slot
        wants = not defer_sampling and (step.automata or self.wants_filters(step.plan))  # (a grammar step filters at
        in_step = wants and self.has_filtered_variant(step.plan)  # finalize; automaton rows need the filtered variant)
        second = None if defer_sampling else self.sampler_input(step.plan, filtered=wants and not in_step)
        slot.step, slot.awaiting_mask = step, defer_sampling
        slot.sampler = second.variant if second is not None else None
        if step.plan.page_copies:
            self.copy_pages(step.plan.page_copies)
        inp = step.input
        self.input_transfers += (inp.packed is not None) + (second is not None)
        self._dispatch_into(slot, inp.shape, self.carrier if inp.packed is None else inp.packed, step.record,
                            filtered=in_step, lora=self.uses_lora(step.plan))
        if second is not None:
            self._resample_into(slot, second.variant, second.buffer)
        if not defer_sampling:
            self._copy_to_host(slot)
        return slot

    def finalize(self, slot: DecodeSlot, inp: SamplerInput, then: StepInput | None = None) -> None:
        """Sample a deferred step with its grammar masks (`inp` from `sampler_input(plan, masked=True)`, mask rows
        filled), then start its host copy. Only the latest launched step can be finalized: the next launch reads its
        tokens. then: the next step's input, if already planned: it rides in this transfer to the runner's carrier,
        and `then.packed` becomes None, so that the step costs no transfer of its own."""
        assert slot.awaiting_mask and slot is self._last_launched, "finalize out of order"
        assert inp.variant.masked, "finalize needs a masked sampler input"
        if then is not None and then.packed is not None and then.packed.size == inp.carrier.size:
            inp.carrier[:] = then.packed
            then.packed = None
        slot.awaiting_mask, slot.sampler = False, inp.variant
        self.input_transfers += 1
        self._resample_into(slot, inp.variant, inp.buffer)
        self._copy_to_host(slot)

    def fetch(self, slot: DecodeSlot) -> StepResult:
        """Wait for the slot's host copy (an explicit transfer) and free the slot."""
        assert not slot.awaiting_mask, "a deferred step must be finalized before its commit"
        want_lp = bool(slot.sampler and slot.sampler.logprobs)
        tokens = jax.device_get(slot.host_views[0])
        lp, ids = (jax.device_get(slot.host_views[1]), jax.device_get(slot.host_views[2])) if want_lp else (None, None)
        slot.step = None
        return StepResult(np.asarray(tokens).tolist(), lp, ids)

    # ---- device calls ----------------------------------------------------------------------------------------------
    def _take_slot(self) -> DecodeSlot:
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.slots)
        return slot

    @staticmethod
    def _copy_to_host(slot: DecodeSlot) -> None:
        # An intended, explicit copy: allowed even where a transfer guard polices the loop for accidental ones.
        views = [slot.tokens] + ([slot.logprobs, slot.top_ids] if slot.sampler and slot.sampler.logprobs else [])
        # a mesh over several processes: each reads its own replica (a global array cannot be fetched whole)
        slot.host_views = tuple(v if v.is_fully_addressable else v.addressable_shards[0].data for v in views)
        with jax.transfer_guard_device_to_host("allow"):
            for v in slot.host_views:
                v.copy_to_host_async()

    def _resample_into(self, slot: DecodeSlot, variant: SamplerVariant, buffer: np.ndarray | jax.Array) -> None:
        # One more host->device copy, only for steps with top-k/top-p, logprobs or grammar rows.
        feeds_next = self._prev_tokens is slot.tokens
        with _input_transfer():
            buffer = self._on_mesh(buffer)
            program = self._programs.get(("sampler", variant))
            resample = functools.partial(self._resample, *variant) if program is None else program
            slot.tokens, slot.logprobs, slot.top_ids, self.carrier = resample(
                slot.logits, slot.tokens, slot.logprobs, slot.top_ids, self.carrier, buffer)
        if feeds_next:  # the next step's carry-over must read the resampled tokens (the old buffer was donated)
            self._prev_tokens = slot.tokens

    def _dispatch_into(self, slot: DecodeSlot, shape: StepShape, packed: np.ndarray | jax.Array,
                       record: StepRecord | None = None, filtered: bool = False, lora: bool = False) -> None:
        """Run one step into `slot`: one host->device copy (none if packed is already on the device), outputs and KV
        donated."""
        if record is not None:
            record.t_put = time.perf_counter()
        program = self._programs.get(("step", shape, filtered, lora))
        step = functools.partial(self._steps[filtered, lora], shape) if program is None else program
        with _input_transfer():
            packed = self._on_mesh(packed)
            # (the base program takes no LoRA weights: each pytree leaf costs the dispatch time, ~100 leaves here)
            lora_weights = self.lora_weights if lora else None
            if filtered and self.automaton is not None:
                slot.tokens, slot.logits, self.kv, slot.states = step(
                    self.text_params(), self.kv, self._prev_tokens, slot.tokens, slot.logits, packed, lora_weights,
                    (*self.automaton, self._prev_states), slot.states)
            else:
                slot.tokens, slot.logits, self.kv = step(self.text_params(), self.kv, self._prev_tokens, slot.tokens,
                                                         slot.logits, packed, lora_weights, None, None)
        if record is not None:
            record.t_dispatched = time.perf_counter()
        self._prev_tokens = slot.tokens
        # (a step that did not write states leaves stale ones: the next step reads them for no row, engine/packing.py)
        self._prev_states = slot.states

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV pages (source, destination), ordered after every step already dispatched and before the next."""
        C, trash = self.page_copy_chunk, self.static.trash_page
        with _input_transfer():
            for a in range(0, len(pairs), C):
                idx = np.full((C, 2), trash, np.int32)  # padding: the trash page onto itself
                idx[:len(pairs[a:a + C])] = pairs[a:a + C]
                self.kv = self._copy_pages(self.kv, idx)

    def write_automaton(self, offset: int, next_state: np.ndarray, mask: np.ndarray) -> None:
        """Write an automaton's rows (jphoton/constrain/automaton.py: next_state [S, V] local int32, -1 = not allowed; mask
        [S, W]) at rows offset .. offset + S - 1 of the device tables, in chunks of one compiled shape, ordered after
        every step already dispatched (rows being rewritten are no live request's, engine/pipeline.py)."""
        S, V = next_state.shape
        assert 1 <= offset and offset + S <= self.automaton_states, "automaton rows out of the table"
        global_next = np.where(next_state >= 0, next_state + offset, 0).astype(np.int16)  # not allowed -> free state
        C = AUTOMATON_CHUNK
        with _input_transfer():
            for a in range(0, S, C):
                n = min(C, S - a)
                rows = np.full((C,), self.automaton_states, np.int32)  # out of range: dropped
                rows[:n] = offset + a + np.arange(n)
                nxt = np.zeros((C, V), np.int16)
                nxt[:n] = global_next[a:a + n]
                words = np.zeros((C, self.mask_words), np.int32)
                words[:n] = mask[a:a + n]
                self.automaton = self._write_automaton(*self.automaton, rows, nxt, words)

    def _on_mesh(self, host: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
        """Under tensor parallelism a host input is put on the mesh first: a jitted call given a host array and one
        given a device array (the grammar sampler's carrier) would otherwise be two executables, only one of them
        compiled at warm-up (on one device they share one)."""
        if self.tp is None or not isinstance(host, np.ndarray):
            return host
        return jax.device_put(host, self._sharding)

    # ---- first runs ------------------------------------------------------------------------------------------------
    def first_run(self, key: tuple) -> None:
        """Run one compiled program once, on padding rows (trash page, no carry-over), and wait for it: a program's
        first execution in a process costs far more than the later ones (a 1B decode step up to 390 ms on an H100,
        6e55017:lab/probes/first_run.py), and this way warm-up pays it, not a request. key: ("step", shape, filtered, lora)
        or ("sampler", variant), as `install`'s. Only for an idle engine (it uses the decode slots)."""
        if key[0] == "step":
            _, shape, filtered, lora = key
            slot = self._take_slot()
            self._dispatch_into(slot, shape, self.layout(shape).empty(self.static.trash_page)["_buffer"],
                                filtered=filtered, lora=lora)
        else:  # on the slot of the last step, as in serving (the next step must not take the slot it carries from)
            slot = self.slots[self._next_slot - 1]
            self._resample_into(slot, key[1], self._sampler_input(key[1]).buffer)
        jax.block_until_ready((slot.tokens, self.kv))
        self.first_ran.add(key)

    # ---- measurement -----------------------------------------------------------------------------------------------
    def time_decode_steps(self, rows: int, context: int = 0, steps: int = 30, masked_sampler: bool = False,
                          lora_rows: int = 0, filtered: bool = False, decode_steps: int = 1) -> float:
        """Seconds per decode-only step of `rows` rows dispatched back to back, with no host work between (what the
        pipelined loop would reach if the host were free). Each row attends over `context` tokens on pages of its own,
        as in serving (0: padding rows on the trash page, attention nearly free); masked_sampler: the grammar sampler
        runs after each step too; lora_rows: the first rows use LoRA slots 0, 1, ... in turn (the step's LoRA
        variant); filtered: the step's filtered variant (top-k / top-p, device automata). Overwrites KV pages: only for
        an idle engine."""
        bucket = next((d for d in self.sched.decode_buckets if d >= rows), None)
        if bucket is None:
            raise ValueError(f"{rows} rows exceed the largest decode bucket ({self.sched.decode_buckets[-1]})")
        ps, pages = self.static.page_size, -(-context // self.static.page_size)
        if pages > self.static.pages_per_seq:
            raise ValueError(f"context {context} exceeds max_model_len ({self.static.pages_per_seq * ps} tokens)")
        ctx = 0
        if self.sched.context_buckets:  # static attention: a context bucket
            ctx = next(c for c in self.sched.context_buckets if c >= max(pages, 1))
        if decode_steps not in (1, self.sched.decode_steps):
            raise ValueError(f"decode_steps must be 1 or the engine's decode_steps ({self.sched.decode_steps})")
        if context and context + decode_steps > self.static.pages_per_seq * ps:
            raise ValueError(f"context {context} + {decode_steps} steps exceed max_model_len")
        shape = StepShape(bucket, 0, 0, ctx, decode_steps)
        views = self.layout(shape).empty(self.static.trash_page)
        if context:
            real = self.static.trash_page  # pages 0 .. trash_page - 1 are the pool's own; tables cycle through them
            for i in range(bucket):
                views["d_table"][i, :pages] = (i * pages + np.arange(pages)) % real
            views["d_pos"][:] = context - 1
        if lora_rows and not self.lora_enabled:
            raise ValueError("lora_rows needs an engine with max_loras > 0")
        views["d_lora"][:min(lora_rows, bucket)] = np.arange(min(lora_rows, bucket)) % max(self.static.lora_slots, 1)
        packed = jax.device_put(views["_buffer"], self._sharding)
        variant = SamplerVariant(False, 0, True)
        sampler = jax.device_put(self._sampler_input(variant).buffer, self._sharding) if masked_sampler else None

        def run(n):
            for _ in range(n):
                slot = self._take_slot()
                self._dispatch_into(slot, shape, packed, lora=lora_rows > 0, filtered=filtered)
                if sampler is not None:
                    self._resample_into(slot, variant, sampler)
            jax.block_until_ready(self.kv)

        run(3)  # compile (if needed) and warm
        t0 = time.perf_counter()
        run(steps)
        return (time.perf_counter() - t0) / steps / decode_steps


AUTOMATON_CHUNK = 32  # automaton rows a table write carries (one compiled shape)


def _copy_kv_pages(kv, pairs, page_size: int):
    """kv with page pairs[i, 1] overwritten by page pairs[i, 0] (every layer, keys and values)."""
    slots = jnp.arange(page_size, dtype=jnp.int32)
    src = (pairs[:, :1] * page_size + slots).reshape(-1)
    dst = (pairs[:, 1:] * page_size + slots).reshape(-1)
    return tuple(a.at[:, dst].set(a[:, src]) for a in kv)


def _write_automaton_rows(next_state, mask, rows, chunk_next, chunk_mask):
    return (next_state.at[rows].set(chunk_next, mode="drop"), mask.at[rows].set(chunk_mask, mode="drop"))


def _automaton_chunk_specs(vocab_size: int, words: int):
    return (jax.ShapeDtypeStruct((AUTOMATON_CHUNK,), jnp.int32), jax.ShapeDtypeStruct((AUTOMATON_CHUNK, vocab_size),
            jnp.int16), jax.ShapeDtypeStruct((AUTOMATON_CHUNK, words), jnp.int32))


def default_num_pages(model_cfg, cfg: EngineConfig, params) -> int:
    """Enough pages for max_num_seqs full contexts, capped by free device memory (accelerators) or 256 MiB (CPU)."""
    dtype_bytes = jax.tree_util.tree_leaves(params)[0].dtype.itemsize
    tp = cfg.tensor_parallel_size  # each device holds its shards' KV heads of every page
    heads = tensor_parallel.kv_heads(model_cfg, tp) // tp
    page_bytes = 2 * model_cfg.num_layers * cfg.page_size * heads * model_cfg.head_dim * dtype_bytes
    wanted = cfg.max_num_seqs * -(-cfg.max_model_len // cfg.page_size)
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        # and at least 3 GiB left for the step's temporaries (a 70B shape on two 80 GB GPUs has ~9 GB free)
        budget = int(min(free * cfg.kv_memory_fraction, free - 3 * 2**30))
    else:
        budget = 256 * 2**20
    return max(1, min(wanted, budget // page_bytes))

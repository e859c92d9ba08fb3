"""EngineConfig: every engine knob in one frozen dataclass. Defaults are the fast, safe path; "auto" and None are resolved
per device and model by `resolve`. Plain Python (no jax): the backend is passed in."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from jphoton.engine.plan import SchedulerConfig

FIRST_CONTEXT_TOKENS = 128  # the smallest context bucket (prefill rows attend over at least this many tokens)
DEFAULT_MAX_MODEL_LEN = 8192  # a longer context is opt-in (max_model_len=): it widens every block table
ATTENTION = ("auto", "pallas", "static", "dynamic")
WARMUP = ("background", "full", "off")  # engine/warmup.py (which imports jax; this module must not)
CHOICE_DEFAULTS = (32, 64)  # Limits.max_choices, max_choice_tokens (measured: docs/decisions.md)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The step shapes compiled at start-up (None: derived from the limits). Every step is padded to one of them."""

    decode: tuple[int, ...] | None = None  # rows of a decode-only step; None: 1, 2, 4, ... max_num_seqs
    prefill: tuple[tuple[int, int], ...] | None = None  # (rows, tokens per row) of a step's prefill part
    context: tuple[int, ...] | None = None  # pages every row attends over (attention="static" only)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """How the model's layers run. "auto" picks the fastest measured path for the device (README, RESULTS.md)."""

    attention: str = "auto"  # "pallas" (GPU), "dynamic" (CPU), "static"
    matmul: Any = "auto"  # "fused" (GPU), "xla-plain" (CPU), "xla", or a hook object of models/matmul.py
    moe_backend: str = "auto"  # MoE models: "warp_decode" up to 192 tokens a step, else "expert_centric"
    unroll_layers: bool | None = None  # None: unrolled on GPU (faster steps), scanned on CPU (faster compiles)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for, checked at submission before any work on it (tokenizing, compiling a grammar):
    a request over a limit is a ValueError (INVALID_ARGUMENT over gRPC) naming the limit. Raise them as needed."""

    max_prompt_bytes: int = 8 * 2**20  # a text prompt (UTF-8), or a chat's messages together
    max_stop_strings: int = 64  # stop strings per request (the engine checks each against every new token's text)
    max_stop_bytes: int = 1024  # UTF-8 bytes of one stop string
    max_constraint_bytes: int = 256 * 2**10  # a json_schema / regex / grammar text, or all choice options together
    # A json_schema's properties, all objects together ($defs included): llguidance's compile grows with the square of
    # an object's optional properties (6,000: 3.8 s on the 2-core CPU box; 1,024: 0.2 s), docs/decisions.md
    max_schema_properties: int = 1024
    max_choices: int = CHOICE_DEFAULTS[0]  # options of a `choice` (each is scored on an internal sequence of its own)
    # A `choice`'s options as the engine scores them: the sum over options of (tokens + 1, its end), checked once they
    # are tokenized (constrain/choice.py; what the defaults cost: docs/decisions.md)
    max_choice_tokens: int = CHOICE_DEFAULTS[1]
    max_stop_token_ids: int = 1024  # stop_token_ids per request (a set the commit checks every token against)
    # an image's pixels, checked from its header before it is decoded (jphoton/image/decode.py; a decompression bomb)
    max_image_pixels: int = 50_000_000
    max_image_bytes: int = 16 * 2**20  # an encoded image (bytes): checked before it is opened (gRPC: before parsing)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}")


# LLM(...) keywords that live in a group: keyword -> (group, field).
_GROUPED = {"decode_buckets": ("buckets", "decode"), "prefill_buckets": ("buckets", "prefill"),
            "context_buckets": ("buckets", "context"),
            **{f.name: ("kernels", f.name) for f in dataclasses.fields(Kernels)},
            **{f.name: ("limits", f.name) for f in dataclasses.fields(Limits)}}
_GROUPS = ("buckets", "kernels", "limits")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # limits
    max_num_seqs: int = 64  # requests decoding at once
    max_num_batched_tokens: int = 512  # tokens per step: decode rows first, then prefill chunks
    max_model_len: int | None = None  # None: the model's limit, at most 8192
    max_logprobs: int = 20  # the largest SamplingParams.logprobs accepted
    # decode rows one `choice` request's option branches take at once (constrain/choice.py): a choice beside other
    # streams adds at most this many rows to their steps (7: one stream + a choice fill the 8-row bucket; measured on
    # the 2-core CPU box, docs/decisions.md; a GPU's step hardly grows with rows: raise it there)
    max_choice_rows: int = 7
    # memory
    page_size: int = 16  # tokens per KV page
    num_kv_pages: int | None = None  # None: max_num_seqs full contexts, capped by free device memory (CPU: 256 MiB)
    kv_memory_fraction: float = 0.85  # of free device memory the KV pool may take
    prefix_caching: bool = True  # full KV pages of shared prompt prefixes are reused (engine/pages.py)
    # LoRA adapters (engine/loras.py): device slots for this many adapters at once (0: LoRA off, no LoRA programs
    # compiled), each of rank up to max_lora_rank (a lower rank is zero-padded)
    max_loras: int = 0
    max_lora_rank: int = 16
    # shard the model over this many local devices (Megatron tensor parallelism, docs/tensor-parallel.md)
    tensor_parallel_size: int = 1
    # Constrained decoding on the device (jphoton/constrain/automaton.py): regular regex and JSON-schema constraints run
    # as token automata in device tables of this many states (int16 next-state rows: 2 bytes x vocabulary a state,
    # 256 MiB at 1,024 states and a 128k vocabulary), sampled inside the step like free rows; 0: every constraint's
    # masks are built on the host by llguidance. (docs/constrained.md)
    automaton_states: int = 1024
    dtype: Any = None  # "float32" | "bfloat16" | "float16" (or a jnp dtype); None: float32 on CPU, bfloat16 on GPU
    # the loop
    pipeline_depth: int = 2  # 2: step t+1 is dispatched before t's tokens reach the host; 3: t+2 too; 1: blocking loop
    # K > 1: a decode-only step with no host decision due (nothing waiting, no grammar / logprobs / filters / spatial
    # rows, every row K tokens from its end) runs K decode steps in one launch, tokens fed back on the device
    decode_steps: int = 1
    seed: int = 0  # seeds of requests that give none
    # "background": the first request's shapes before LLM() returns, the rest on a background thread (served as they
    # become ready); "full": every shape before LLM() returns; "off": on first use (engine/warmup.py). True = "full".
    warmup: str | bool = "background"
    # "background" warm-up in a second process that sends the compiled programs over (engine/compile_worker.py): the
    # serving process's decode keeps its speed while they compile. None: on for a one-device GPU engine whose model
    # jphoton built (LLM(<path or random:...>)); off on CPU, under tensor parallelism and for a user's JaxModel.
    compile_worker: bool | None = None
    progress: bool = True  # progress bars on loading and compiling
    freeze_gc: bool = True  # gc.freeze() start-up objects: a full GC pass would stall a tick (RESULTS.md)
    cache_converted: bool | None = None  # cache GGUF -> orbax conversions on disk (None: GGUF only)
    buckets: Buckets = Buckets()
    kernels: Kernels = Kernels()
    limits: Limits = Limits()

    def __post_init__(self):
        def positive_int(name, value, allow_none=False):
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")

        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        positive_int("max_choice_rows", self.max_choice_rows)
        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("page_size", self.page_size)
        positive_int("num_kv_pages", self.num_kv_pages, allow_none=True)
        positive_int("max_lora_rank", self.max_lora_rank)
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 0:
            raise ValueError(f"max_loras must be a non-negative integer (0: LoRA off), got {self.max_loras!r}")
        if (not isinstance(self.automaton_states, int) or isinstance(self.automaton_states, bool)
                or not 0 <= self.automaton_states <= 32767):
            raise ValueError(f"automaton_states must be an integer in [0, 32767] (0: off), got {self.automaton_states!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {self.prefix_caching!r}")
        if not isinstance(self.decode_steps, int) or isinstance(self.decode_steps, bool) or not (
                1 <= self.decode_steps <= 64):
            raise ValueError(f"decode_steps must be an integer in [1, 64], got {self.decode_steps!r}")
        if self.pipeline_depth not in (1, 2, 3):
            raise ValueError(f"pipeline_depth must be 1 (blocking), 2 or 3 (pipelined), got {self.pipeline_depth!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}")
        if self.warmup is True or self.warmup is False:
            object.__setattr__(self, "warmup", "full" if self.warmup else "off")
        if self.warmup not in WARMUP:
            raise ValueError(f"warmup must be one of {', '.join(map(repr, WARMUP))} (or a bool), got {self.warmup!r}")
        if self.compile_worker not in (None, True, False):
            raise ValueError(f"compile_worker must be True, False or None (auto), got {self.compile_worker!r}")
        if self.kernels.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTION))}, got {self.kernels.attention!r}")
        # The bucket tuples are checked where they are complete (SchedulerConfig, after resolve).

    # ---- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, base: EngineConfig | None = None, **kwargs) -> EngineConfig:
        """`base` (default: the defaults) with LLM(...)-style flat keywords applied (`decode_buckets=`, `attention=`,
        ...: a group's fields by their keyword). An unknown keyword is a TypeError naming the nearest known one."""
        base = base or cls()
        top = {f.name for f in dataclasses.fields(cls)} - set(_GROUPS)
        flat: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        for key, value in kwargs.items():
            if key in top:
                flat[key] = value
            elif key in _GROUPED:
                group, field = _GROUPED[key]
                groups[group][field] = value
            else:
                near = difflib.get_close_matches(key, [*top, *_GROUPED], n=1)
                raise TypeError(f"unknown engine option {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        return dataclasses.replace(base, **flat, **{g: dataclasses.replace(getattr(base, g), **groups[g])
                                                     for g in _GROUPS})

    @staticmethod
    def option_names() -> list[str]:
        """Every keyword `LLM(...)` maps onto this config (the README's option table lists them all)."""
        return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in _GROUPS] + list(_GROUPED)

    # ---- resolution ------------------------------------------------------------------------------------------------
    def resolve_kernels(self, backend: str) -> EngineConfig:
        """The "auto" kernels and the layer loop for `backend` ("cpu", "gpu", ...)."""
        accelerator = backend != "cpu"
        k = self.kernels
        # GPU: decode and prefill rows through the Pallas kernels (decode 1.4-3.2x the static gather on the H100; an XLA
        # data-dependent loop would sync the host every iteration), no context buckets. CPU: the plain-JAX loop (the
        # kernels would run in interpret mode: correct, slow).
        attention = k.attention if k.attention != "auto" else ("pallas" if accelerator else "dynamic")
        unroll = k.unroll_layers if k.unroll_layers is not None else accelerator
        return dataclasses.replace(self, kernels=dataclasses.replace(k, attention=attention, unroll_layers=unroll))

    def resolve_shapes(self, model_limit: int, min_decode_rows: int = 1) -> EngineConfig:
        """max_model_len and the bucket sets, for a model whose context holds `model_limit` tokens and whose matmuls
        want decode steps of at least `min_decode_rows` rows (models/matmul.py). Needs `resolve_kernels` first."""
        if self.max_model_len is not None and self.max_model_len > model_limit:
            raise ValueError(f"max_model_len must be in [1, {model_limit}] for this model, got {self.max_model_len!r}")
        max_len = self.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
        b = self.buckets
        decode = tuple(b.decode or _geometric(1, 2, self.max_num_seqs))
        decode = tuple(sorted({max(d, min_decode_rows) for d in decode}))  # one-row steps would pad every matmul
        prefill = tuple(b.prefill or default_prefill(self.max_num_batched_tokens))
        pages_per_seq = -(-max_len // self.page_size)
        if self.kernels.attention == "static":  # every row attends over its step's context bucket
            # From 128 tokens up, at most 4x waste: a newcomer's first chunk (a 128-token prompt) attends over 8 pages,
            # not 32 (the "pallas" default needs no bucket: its kernels follow each row's own length)
            context = tuple(b.context or _geometric(-(-FIRST_CONTEXT_TOKENS // self.page_size), 4, pages_per_seq))
            if context[-1] < pages_per_seq:
                raise ValueError(f"the largest context bucket ({context[-1]} pages) must cover max_model_len "
                                 f"({pages_per_seq} pages of {self.page_size})")
        elif b.context:
            raise ValueError(f"context_buckets apply to attention='static' only (this engine's attention is "
                             f"{self.kernels.attention!r}: its attention follows each row's own length)")
        else:
            context = ()
        return dataclasses.replace(self, max_model_len=max_len, buckets=Buckets(decode, prefill, context))

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's view (needs `resolve_shapes` first)."""
        b = self.buckets
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               decode_buckets=b.decode, prefill_buckets=b.prefill, context_buckets=b.context,
                               page_size=self.page_size, max_choice_rows=self.max_choice_rows,
                               decode_steps=self.decode_steps)


def _geometric(start: int, factor: int, last: int) -> tuple[int, ...]:
    """start, start*factor, ... below `last`, then `last` itself."""
    out, b = [], start
    while b < last:
        out.append(b)
        b *= factor
    return (*out, last)


def default_prefill(budget: int) -> tuple[tuple[int, int], ...]:
    shapes = [(1, 32), (1, 128), (4, 128), (1, 512)]
    return tuple((r, t) for r, t in shapes if r * t <= budget) or ((1, budget),)

"""The typed records that travel through the pipeline: a planned step, its decode slot, its second sampler's input, and
what its commit reads back."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jphoton.engine.plan import StepPlan, StepShape
from jphoton.engine.telemetry import StepRecord

# The token a step writes for a row whose logits are not finite (engine/step.py mark_nonfinite): the commit ends that
# request with an error and keeps its pages out of the prefix cache.
NONFINITE = -1
NONFINITE_ERROR = ("the model's logits were not finite (NaN or inf) for this request: its weights or LoRA adapter "
                   "overflowed on this input")


class SamplerVariant(NamedTuple):
    """Which compiled second sampler a step needs (each variant is compiled at warm-up)."""

    filtered: bool  # a sampling row asks for top-k / top-p
    logprobs: int  # K top logprobs per row (0: none)
    masked: bool  # grammar rows: token bitmasks applied before sampling


@dataclasses.dataclass
class StepInput:
    """A planned step's one host->device input."""

    shape: StepShape
    packed: np.ndarray | None  # None: already on the device, in the runner's carrier (it rode in a grammar sampler's
    # transfer, so the step costs no transfer of its own)


@dataclasses.dataclass
class PlannedStep:
    """A step the scheduler planned and the runner packed, waiting for its launch."""

    plan: StepPlan
    record: StepRecord
    input: StepInput
    automata: bool = False  # its automaton rows sample inside the step (the filtered variant)
    image_slots: tuple | list = ()  # image-cache slots its prefill chunks read (pinned until the launch)


@dataclasses.dataclass
class DecodeSlot:
    """One step's device outputs (donated at each use, so no per-step allocation) while the step is in flight."""

    tokens: jax.Array  # [max_rows * decode_steps] int32 (plan.py `step_tokens`)
    logits: jax.Array  # [max_rows, V] float32: every row's logits, for the second sampler
    logprobs: jax.Array  # [max_rows, K + 1] float32: sampled token's logprob, then the top K
    top_ids: jax.Array  # [max_rows, max(K, 1)] int32
    states: jax.Array | None = None  # [max_rows] int32: each row's device automaton state after its token (filtered steps)
    step: PlannedStep | None = None  # the step occupying the slot, until its commit
    sampler: SamplerVariant | None = None  # the second sampler that ran on it, if any
    awaiting_mask: bool = False  # grammar rows: sampled only at finalize, after the previous step's commit
    # the arrays whose host copy was started (tokens[, logprobs, top_ids]): this process's replicas when the mesh spans
    # several processes (jax.distributed), else the outputs themselves
    host_views: tuple = ()


@dataclasses.dataclass
class SamplerInput:
    """The second sampler's one host->device transfer, as views into one buffer: grammar bitmasks (all ones; llguidance
    fills the grammar rows in place), per-row sampler fields, and a carrier for the next step's packed input."""

    variant: SamplerVariant
    buffer: np.ndarray  # [sampler_input_size] int32
    mask: np.ndarray | None  # [max_rows, W] view, when masked
    fields: np.ndarray  # [max_rows, SAMPLER_ROW_FIELDS] view
    carrier: np.ndarray  # [packed_size] view when masked, else empty


@dataclasses.dataclass
class StepResult:
    """What the commit of a step reads on the host."""

    tokens: list[int]  # one per output row (Python ints: indexing a numpy array per row cost ~0.2 us a row)
    logprobs: np.ndarray | None  # [max_rows, K + 1] when the step's sampler computed logprobs
    top_ids: np.ndarray | None

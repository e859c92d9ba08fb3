"""What a step is, as the scheduler plans it and the runner packs it: its shape (one compiled program's padded sizes),
its rows (decode rows as columns, prefill rows as objects), the flags that pick its program variants, and the
scheduler's configuration (the shape set). Plain Python that never imports jax.
"""

from __future__ import annotations

import dataclasses

from jphoton.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The padded sizes of one compiled step (one XLA program each)."""

    decode_rows: int  # Bd (0 = no decode part)
    prefill_rows: int  # Bp (0 = no prefill part)
    prefill_tokens: int  # Tp, tokens per prefill row
    ctx_pages: int = 0  # pages every row attends over (the context bucket); 0 = no bucket (Pallas / dynamic loop)
    steps: int = 1  # decode steps one launch runs (decode-only shapes; each step's tokens feed the next on the device)

    @property
    def rows(self) -> int:
        return self.decode_rows + self.prefill_rows

    @property
    def tokens(self) -> int:
        return self.decode_rows + self.prefill_rows * self.prefill_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences at most (decode rows per step)
    max_num_batched_tokens: int = 512  # valid tokens per step (decode rows + prefill chunk tokens)
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_buckets: tuple[tuple[int, int], ...] = ((1, 32), (1, 128), (4, 128), (1, 512))  # (rows, tokens per row)
    # pages attended per row (static attention); () = attention that follows each row's length (Pallas kernels or
    # the plain-JAX dynamic loop)
    context_buckets: tuple[int, ...] = ()
    page_size: int = 16  # tokens per KV page (context buckets count pages)
    max_choice_rows: int = 7  # a `choice` request's branches decoding at once (`_admit_branches`)
    # decode steps a launch may run when no host decision is due (no request waiting, plain rows, room for every
    # row): 1 = one per launch; K > 1 adds a K-step variant of each decode-only shape
    decode_steps: int = 1

    def __post_init__(self):
        if not self.decode_buckets or sorted(self.decode_buckets) != list(self.decode_buckets):
            raise ValueError("decode_buckets must be a non-empty ascending tuple")
        if not self.prefill_buckets or any(r < 1 or t < 1 for r, t in self.prefill_buckets):
            raise ValueError("prefill_buckets must be non-empty (rows, tokens) pairs of positive sizes")
        if list(self.context_buckets) != sorted(self.context_buckets) or any(c < 1 for c in self.context_buckets):
            raise ValueError("context_buckets must be ascending positive page counts")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 1 <= self.decode_steps <= 64:
            raise ValueError(f"decode_steps must be in [1, 64], got {self.decode_steps}")

    @property
    def max_prefill_chunk(self) -> int:
        return max(t for _, t in self.prefill_buckets)

    @property
    def mixed_decode_rows(self) -> int:
        """Decode rows of every step that also carries prefill: the largest decode bucket. A step with a prefill chunk
        costs what the chunk costs; padding decode rows (trash page, length 0) add matmul rows, not weight reads. One
        decode size instead of one per bucket divides the mixed shapes by the number of decode buckets."""
        return self.decode_buckets[-1]

    def all_shapes(self) -> list[StepShape]:
        """Every step shape the scheduler can plan: decode-only steps (one per decode bucket; with static attention
        one per context bucket too) and prefill steps with no decode part or the full one (`mixed_decode_rows`)."""
        contexts = self.context_buckets or (0,)
        multi = [StepShape(d, 0, 0, c, self.decode_steps) for c in contexts for d in self.decode_buckets
                 ] if self.decode_steps > 1 else []
        return ([StepShape(d, 0, 0, c) for c in contexts for d in self.decode_buckets] + multi
                + [StepShape(d, r, t, c) for c in contexts for d in (0, self.mixed_decode_rows)
                   for r, t in self.prefill_buckets])


@dataclasses.dataclass(slots=True)
class Row:
    """One sequence's part of a step: `num_tokens` tokens at positions start.. (one for decode rows)."""

    seq: Sequence
    start: int
    num_tokens: int
    tokens: list[int]  # host-known input tokens; empty for a decode row whose input is carried over on the device
    carry_from: int  # row of the previous step's output holding the input token, or -1
    samples: bool  # the row's last token yields a sampled token that the commit appends
    sample_index: int  # which output token it samples (keys the per-request seed)
    out_row: int = -1  # where the sample lands in this step's output buffer


# What a row asks of its step beyond a plain forward and sampler (`row_flags`, `StepPlan.flags`), so that the per-step
# path reads one int instead of every row's parameters. The sampling flags count for rows that sample, LORA for any row.
FILTERS = 1  # top-k / top-p (the filtered sampler)
LOGPROBS = 2  # logprobs (a second sampler)
CONSTRAINED = 4  # a grammar (masks or device automata)
LORA = 8  # a LoRA adapter (the step's LoRA variant)


def row_flags(seq: Sequence) -> int:
    """A sequence's flags (set when the scheduler gets it: its parameters, constraint and LoRA slot are fixed then)."""
    p = seq.params
    return ((FILTERS if p.temperature > 0 and (p.top_k or p.top_p < 1) else 0)
            | (LOGPROBS if p.logprobs is not None else 0) | (CONSTRAINED if seq.constraint is not None else 0)
            | (LORA if seq.lora_slot >= 0 else 0))


@dataclasses.dataclass(slots=True)
class DecodeRows:
    """A step's decode rows as columns (no object per row: at 64 rows a `Row` each cost ~35 us of a ~130 us plan on
    the CI box). Row i is one token of seqs[i] at position start[i] and samples into output row i; its input is
    tokens[i], or, where carry[i] >= 0, row carry[i] of the previous step's output (still on the device)."""

    seqs: list[Sequence]
    start: list[int]
    tokens: list[int]  # 0 where carried
    carry: list[int]
    sample_index: list[int]

    def __len__(self) -> int:
        return len(self.seqs)

    def rows(self) -> list[Row]:
        """As `Row`s (for the paths that are not per step: grammar, logprobs, filters, tests)."""
        return [Row(s, p, 1, [t] if c < 0 else [], c, True, k, i) for i, (s, p, t, c, k) in
                enumerate(zip(self.seqs, self.start, self.tokens, self.carry, self.sample_index, strict=True))]

    @classmethod
    def of(cls, rows: list[Row]) -> DecodeRows:
        """From decode `Row`s in output-row order (tests)."""
        assert all(r.out_row == i and r.num_tokens == 1 and r.samples for i, r in enumerate(rows))
        return cls([r.seq for r in rows], [r.start for r in rows], [r.tokens[0] if r.tokens else 0 for r in rows],
                   [r.carry_from for r in rows], [r.sample_index for r in rows])


@dataclasses.dataclass
class StepPlan:
    step_id: int
    decode: DecodeRows
    prefill: list[Row]
    shape: StepShape  # the compiled step it runs in (padded sizes)
    flags: int = 0  # FILTERS | LOGPROBS | CONSTRAINED of the rows that sample, LORA of any row
    # KV pages to copy (source, destination) before the step runs: a `choice` branch's copy of its leader's last
    # prompt page (`Scheduler._admit_branches`)
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def rows(self) -> list[Row]:
        """Every row as a `Row` (decode rows built anew: not for the per-step path)."""
        return self.decode.rows() + self.prefill

    @property
    def num_rows(self) -> int:
        return len(self.decode) + len(self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) * self.shape.steps + sum(r.num_tokens for r in self.prefill)


def step_tokens(tokens: list[int], row: int, steps: int, max_rows: int) -> list[int]:
    """A decode row's tokens, in order, from the host copy of a step's token buffer: a K-step launch keeps step j's
    (j < K - 1) in rows (j + 1) * max_rows.. and the last step's in rows 0.. (step.py `engine_step`)."""
    return [tokens[(j + 1) * max_rows + row] for j in range(steps - 1)] + [tokens[row]]

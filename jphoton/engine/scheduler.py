"""Who runs next: continuous batching with chunked prefill, decode claimed first, preemption by recompute.

Plain Python that never imports jax. The scheduler plans a step from what the host knows *now*, which may be a step
behind the device (pipelined decoding): a decode row whose input token is still on the device names the row of the
previous step's output that holds it (`carry_from`), and the runner resolves it on the device.
"""

from __future__ import annotations

import collections
import dataclasses

from jphoton.engine.pages import PagePool
from jphoton.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences at most (decode rows per step)
    max_num_batched_tokens: int = 512  # valid tokens per step (decode rows + prefill chunk tokens)
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_buckets: tuple[tuple[int, int], ...] = ((1, 32), (1, 128), (4, 128), (1, 512))  # (rows, tokens per row)
    context_buckets: tuple[int, ...] = ()  # pages attended per row (static attention); () = dynamic attention loop
    # Decode rows attend through the Pallas kernel (pallas_kernels/paged_decode_attention.py), whose loop follows each
    # row's own length: only prefill rows need a context bucket, and a decode-only step has none.
    pallas_decode: bool = False

    def __post_init__(self):
        if not self.decode_buckets or sorted(self.decode_buckets) != list(self.decode_buckets):
            raise ValueError("decode_buckets must be a non-empty ascending tuple")
        if not self.prefill_buckets or any(r < 1 or t < 1 for r, t in self.prefill_buckets):
            raise ValueError("prefill_buckets must be non-empty (rows, tokens) pairs of positive sizes")
        if list(self.context_buckets) != sorted(self.context_buckets) or any(c < 1 for c in self.context_buckets):
            raise ValueError("context_buckets must be ascending positive page counts")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")

    @property
    def max_prefill_chunk(self) -> int:
        return max(t for _, t in self.prefill_buckets)


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


@dataclasses.dataclass
class StepPlan:
    step_id: int
    decode: list[Row]
    prefill: list[Row]
    decode_bucket: int  # padded decode rows (0 = none)
    prefill_bucket: tuple[int, int]  # padded (rows, tokens per row); (0, 0) = none
    context_bucket: int = 0  # pages attended per row; 0 = dynamic (or no bucket: decode-only, Pallas decode)

    @property
    def rows(self) -> list[Row]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: PagePool):
        self.config = config
        self.pages = pages
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._admissions = 0
        self._next_step = 0

    # ---- queue -----------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = "waiting"
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return any(not s.finalized for s in self.waiting) or any(not s.finalized for s in self.running)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.running if not s.finalized)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.waiting if not s.finalized)

    def release_if_done(self, seq: Sequence) -> bool:
        """Give a finalized sequence's pages back once no launched step references it (zombies wait for that)."""
        if not seq.finalized or seq.inflight_refs or seq.status == "released":
            return False
        self.pages.release(seq.block_table)
        seq.block_table = []
        if seq.status == "running":
            self.running.remove(seq)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
        seq.status = "released"
        return True

    # ---- planning --------------------------------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        step_id = self._next_step
        planned: set[int] = set()
        decode = self._plan_decode(step_id, planned)
        prefill, prefill_bucket = self._plan_prefill(self.config.max_num_batched_tokens - len(decode), planned)
        if not decode and not prefill:
            return None
        decode_bucket = _smallest_at_least(self.config.decode_buckets, len(decode)) if decode else 0
        plan = StepPlan(step_id, decode, prefill, decode_bucket, prefill_bucket)
        bucketed = plan.prefill if self.config.pallas_decode else plan.rows
        if self.config.context_buckets and bucketed:
            need = max(self.pages.pages_for(r.start + r.num_tokens) for r in bucketed)
            plan.context_bucket = _smallest_at_least(self.config.context_buckets, need)
        for j, row in enumerate(prefill):
            row.out_row = decode_bucket + j
            s = row.seq
            s.num_computed = row.start + row.num_tokens
            s.inflight_refs += 1
            if row.samples:
                s.pending_samples += 1
                s.last_sample = (step_id, row.out_row)
        self._next_step += 1
        return plan

    def _plan_decode(self, step_id: int, planned: set[int]) -> list[Row]:
        """Claim a decode row for every running sequence that can take one, oldest admission first, and book it as
        launched (num_computed, inflight_refs, pending_samples, last_sample) as `plan` does for prefill rows.

        One pass with the per-row tests inlined: this loop runs for every row of every step on the host's critical
        path (benchmarks/host_overhead.py: 128 rows took ~2.5 us each with helper calls and property reads)."""
        rows: list[Row] = []
        limit = min(self.config.max_num_seqs, max(self.config.decode_buckets))
        page_size = self.pages.page_size
        # `running` is in admission order (admission appends, preemption removes), so no sort is needed for FIFO; the
        # copy is because a page reservation may preempt (remove) other sequences while we walk.
        for s in list(self.running):
            if len(rows) >= limit:
                break
            pos, pending = s.num_computed, s.pending_samples
            n_out = len(s.output_ids)
            if (s.finish_reason is not None or s.status != "running" or pos < s.prefill_target
                    or pos >= len(s.prompt_ids) + n_out + pending or n_out + pending >= s.max_new_tokens):
                continue
            if pos >= len(s.block_table) * page_size and not self._reserve(s, pos + 1, planned):
                continue
            known = pos - len(s.prompt_ids)
            if known < 0:
                tokens, carry = [s.prompt_ids[pos]], -1
            elif known < n_out:
                tokens, carry = [s.output_ids[known]], -1
            else:  # the input is the token sampled by the step launched just before, still on the device
                prev_step, carry = s.last_sample
                assert prev_step == step_id - 1, "a pending token must come from the step launched just before"
                tokens = []
            out_row = len(rows)
            rows.append(Row(s, pos, 1, tokens, carry, True, n_out + pending, out_row))
            planned.add(id(s))
            s.num_computed = pos + 1
            s.inflight_refs += 1
            s.pending_samples = pending + 1
            s.last_sample = (step_id, out_row)
        return rows

    def _plan_prefill(self, budget: int, planned: set[int]) -> tuple[list[Row], tuple[int, int]]:
        rows: list[Row] = []
        bucket = (0, 0)
        prefilling = [s for s in self.running  # in admission order (see _plan_decode)
                      if not s.finalized and s.status == "running" and s.num_computed < s.prefill_target]
        candidates = prefilling + [s for s in self.waiting if not s.finalized]
        num_running = self.num_running if candidates else 0
        for s in candidates:
            if budget <= 0:
                break
            admitting = s.status == "waiting"
            if admitting:
                if s.inflight_refs:  # preempted while in flight: re-admit once its last token has landed
                    continue
                if num_running >= self.config.max_num_seqs:
                    break
                target = s.num_tokens
            else:
                target = s.prefill_target
            chunk = min(target - s.num_computed, self.config.max_prefill_chunk, budget)
            fit = _fit_prefill(self.config.prefill_buckets, [r.num_tokens for r in rows] + [chunk])
            if fit is None:
                break
            if not self._reserve(s, s.num_computed + chunk, planned, may_preempt=False):
                break  # no pages: later arrivals wait too (FIFO)
            if admitting:
                self.waiting.remove(s)
                self.running.append(s)
                s.status, s.prefill_target = "running", target
                s.admitted_at, self._admissions = self._admissions, self._admissions + 1
                num_running += 1
            done = s.num_computed + chunk == s.prefill_target
            rows.append(Row(s, s.num_computed, chunk, [s.token_at(i) for i in range(s.num_computed, s.num_computed + chunk)],
                            -1, done, len(s.output_ids)))
            planned.add(id(s))
            bucket = fit
            budget -= chunk
        return rows, bucket

    def _reserve(self, s: Sequence, num_tokens: int, planned: set[int], may_preempt: bool = True) -> bool:
        """Make s's block table cover `num_tokens` positions, preempting the latest-admitted other sequences if the pool
        is dry (never one already in this plan). If nothing else can go, s itself is preempted and False returned."""
        need = self.pages.pages_for(num_tokens) - len(s.block_table)
        if need <= 0:
            return True
        while self.pages.num_free < need:
            if not may_preempt:
                return False
            victims = [v for v in self.running if v is not s and id(v) not in planned and not v.finalized
                       and v.status == "running"]
            if not victims:
                self._preempt(s)
                return False
            self._preempt(max(victims, key=lambda v: v.admitted_at))
        s.block_table += self.pages.allocate(need)
        return True

    def _preempt(self, s: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens; the sequence is prefilled again from its full history.
        Freeing pages of a sequence still in flight is safe: the device runs steps in order, so the in-flight step's
        writes land before any later step that reuses the pages, and its sampled token is still valid."""
        self.pages.release(s.block_table)
        s.block_table = []
        s.num_computed = 0
        s.prefill_target = 0
        s.status = "waiting"
        self.running.remove(s)
        self.waiting.appendleft(s)
        self.num_preemptions += 1


def _smallest_at_least(buckets, n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _fit_prefill(buckets, chunks: list[int]) -> tuple[int, int] | None:
    """The cheapest (rows, tokens) bucket that holds every chunk as a row, or None."""
    fits = [(r * t, r, t) for r, t in buckets if r >= len(chunks) and t >= max(chunks)]
    return min(fits)[1:] if fits else None

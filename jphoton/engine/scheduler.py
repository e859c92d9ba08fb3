"""Who runs next: continuous batching with chunked prefill, decode claimed first, preemption by recompute.

Plain Python that never imports jax. The scheduler plans a step from what the host knows *now*, which may be a step
behind the device (pipelined decoding): a decode row whose input token is still on the device names the row of the
previous step's output that holds it (`carry_from`), and the runner resolves it on the device.
"""

from __future__ import annotations

import collections
import dataclasses

from jphoton.engine.pages import PagePool, page_keys
from jphoton.engine.plan import (
    CONSTRAINED,
    FILTERS,
    LOGPROBS,
    LORA,
    DecodeRows,
    Row,
    SchedulerConfig,
    StepPlan,
    StepShape,
    row_flags,
)
from jphoton.sequence import Sequence


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: PagePool):
        self.config = config
        self.pages = pages
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._admissions = 0
        self._next_step = 0
        # Shapes that may be planned: None = all of them; else a frozenset, replaced (never mutated) by the thread that
        # compiles the rest in the background (engine/warmup.py), so a plan reads one consistent set.
        self.ready: frozenset[StepShape] | None = None
        # The shape a plan would have used had it been ready (the background compiler takes it next); None if none.
        self.wanted: StepShape | None = None
        self._prefill_turn = False  # the next plan runs prefill alone (no ready shape mixes it with decode)
        self._branches_waiting = 0  # sequences added with share_from (choice branches), an upper bound on those waiting
        # id(choice group) -> (block table, step planned in) of its template: the prompt's pages for branches still
        # waiting (`_admit_branches`); dropped once none waits
        self._templates: dict[int, tuple[list[int], int]] = {}

    # ---- queue -----------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = "waiting"
        seq.sample_flags = row_flags(seq)
        self.waiting.append(seq)
        if seq.share_from is not None:
            self._branches_waiting += 1

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
        self._release_pages(seq)
        if seq.status == "running":
            self.running.remove(seq)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
            group = seq.choice_group
            if group is not None and id(group) in self._templates and not any(
                    b.status == "waiting" and b.share_from is not None and not b.finalized for b in group.branches):
                self._drop_template(group)  # (its last waiting branch was aborted)
        seq.status = "released"
        return True

    # ---- planning --------------------------------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """The next step: decode rows of running sequences first, then prefill chunks in the remaining token budget,
        padded to a shape that is ready. Until every shape is compiled (`ready`), a prompt goes through the ready
        prefill shapes in chunks, decode rows beyond the largest ready bucket take turns, and a step that cannot mix
        decode with prefill alternates with a prefill-only one."""
        step_id = self._next_step
        planned: set[int] = set()  # ids of the prefill rows' sequences (decode rows: last_sample is this step)
        prefill_turn, self._prefill_turn = self._prefill_turn, False
        copies = self._admit_branches(step_id, planned) if self._branches_waiting and not prefill_turn else []
        decode, flags = (DecodeRows([], [], [], [], []), 0) if prefill_turn else self._plan_decode(step_id, planned)
        prefill, shape = self._plan_prefill(self.config.max_num_batched_tokens - len(decode), planned, decode)
        if prefill_turn and not prefill:  # nothing could be prefilled after all: decode this step
            decode, flags = self._plan_decode(step_id, planned)
            prefill, shape = self._plan_prefill(self.config.max_num_batched_tokens - len(decode), planned, decode)
        if not decode and not prefill:
            assert not copies, "branches admitted into a step with no rows"
            return None
        if shape is None:  # decode only
            shape = self._decode_shape(decode)
            steps = self._decode_steps(decode, shape, flags)
            if steps > 1:
                shape = dataclasses.replace(shape, steps=steps)
        for j, row in enumerate(prefill):
            row.out_row = shape.decode_rows + j
            s = row.seq
            s.num_computed = row.start + row.num_tokens
            s.inflight_refs += 1
            if row.samples:
                s.pending_samples += 1
                s.last_sample = (step_id, row.out_row)
                flags |= s.sample_flags
            else:
                flags |= s.sample_flags & LORA
        self._next_step += 1
        return StepPlan(step_id, decode, prefill, shape, flags, copies)

    def _decode_steps(self, decode: DecodeRows, shape: StepShape, flags: int) -> int:
        """How many decode steps a decode-only step runs: config.decode_steps when no host decision is due within them
        (no request waiting or prefilling, every running row in the step, plain rows: no grammar, logprobs, filters,
        choice branch or spatial skill, each with K tokens to go and pages for them), else 1. The K-step booking (K
        positions, K pending samples a row) is done here."""
        K = self.config.decode_steps
        if (K == 1 or flags & (FILTERS | LOGPROBS | CONSTRAINED) or self.waiting or self._branches_waiting
                or len(decode) < self._decodable() or not self._is_ready(dataclasses.replace(shape, steps=K))):
            return 1
        for s in decode.seqs:
            if (s.choice_group is not None or s.spatial_mode or s.finish_reason is not None
                    or s.max_new_tokens - len(s.output_ids) - s.pending_samples < K - 1):
                return 1
        for s, pos in zip(decode.seqs, decode.start, strict=True):
            if not self._reserve(s, pos + K, set(), may_preempt=False):
                return 1  # (the pages taken stay with their rows: the next steps use them)
        for s in decode.seqs:
            s.num_computed += K - 1
            s.pending_samples += K - 1
        return K

    def _is_ready(self, shape: StepShape) -> bool:
        return self.ready is None or shape in self.ready

    def _ctx_pages(self, rows: list[Row]) -> list[int]:
        """Context buckets (ascending) that cover every row in `rows`: the rows whose attention needs one (prefill
        rows; decode rows too with static attention). [0] when none does."""
        if not self.config.context_buckets or not rows:
            return [0]
        need = max(self.pages.pages_for(r.start + r.num_tokens) for r in rows)
        return [c for c in self.config.context_buckets if c >= need]

    def _static_decode(self) -> bool:
        """Decode rows need a context bucket (static attention); with the Pallas kernel or the dynamic loop none."""
        return bool(self.config.context_buckets)

    def _decode_shape(self, decode: DecodeRows) -> StepShape:
        for c in self._ctx_pages(decode.rows() if self._static_decode() else []):
            for d in self.config.decode_buckets:
                if d >= len(decode) and self._is_ready(StepShape(d, 0, 0, c)):
                    return StepShape(d, 0, 0, c)
        raise AssertionError("decode rows planned beyond the ready decode shapes")

    def _decode_limit(self) -> int:
        """Most decode rows a step may take: the largest ready decode-only bucket (all of them once warm). With static
        attention only shapes of the largest context bucket count (they serve any context)."""
        limit = min(self.config.max_num_seqs, self.config.decode_buckets[-1])
        if self.ready is None:
            return limit
        ctx = self.config.context_buckets[-1] if self._static_decode() else 0
        return min(limit, max((s.decode_rows for s in self.ready if not s.prefill_rows and s.ctx_pages == ctx),
                              default=0))

    def _plan_decode(self, step_id: int, planned: set[int]) -> tuple[DecodeRows, int]:
        """Claim a decode row for every running sequence that can take one, oldest admission first, and book it as
        launched (num_computed, inflight_refs, pending_samples, last_sample) as `plan` does for prefill rows. Returns
        the rows and their sample flags.

        One pass with the per-row tests inlined, into columns: this loop runs for every row of every step on the
        host's critical path (benchmarks/host_overhead.py: 128 rows took ~2.5 us each with helper calls and property
        reads)."""
        seqs: list[Sequence] = []
        starts: list[int] = []
        tokens: list[int] = []
        carries: list[int] = []
        samples: list[int] = []
        flags = 0
        limit = self._decode_limit()
        if len(self.running) > limit and self.ready is not None:  # the next larger decode bucket is wanted
            ctx = self.config.context_buckets[-1] if self._static_decode() else 0
            self.wanted = self.wanted or next((StepShape(d, 0, 0, ctx) for d in self.config.decode_buckets
                                               if d > limit and not self._is_ready(StepShape(d, 0, 0, ctx))), None)
        page_size = self.pages.page_size
        # `running` is in admission order (admission appends, preemption removes), so no sort is needed for FIFO; the
        # copy is because a page reservation may preempt (remove) other sequences while we walk.
        for s in list(self.running):
            if len(seqs) >= limit:
                break
            pos, pending = s.num_computed, s.pending_samples
            n_out = len(s.output_ids)
            if (s.finish_reason is not None or s.status != "running" or pos < s.prefill_target
                    or pos >= len(s.prompt_ids) + n_out + pending or n_out + pending >= s.max_new_tokens):
                continue
            known = pos - len(s.prompt_ids)
            if known >= n_out and s.last_sample[0] != step_id - 1:
                # its input token is in an older step's output, not yet committed (this step is planned ahead of that
                # commit, and the sequence sat out the step between): it joins the step after
                continue
            if pos >= len(s.block_table) * page_size and not self._reserve(s, pos + 1, planned):
                continue
            if known < 0:
                token, carry = s.prompt_ids[pos], -1
            elif known < n_out:
                token, carry = s.output_ids[known], -1
            else:  # the input is the token sampled by the step launched just before, still on the device
                prev_step, carry = s.last_sample
                assert prev_step == step_id - 1, "a pending token must come from the step launched just before"
                token = 0
            s.last_sample = (step_id, len(seqs))
            seqs.append(s)
            starts.append(pos)
            tokens.append(token)
            carries.append(carry)
            samples.append(n_out + pending)
            flags |= s.sample_flags
            s.num_computed = pos + 1
            s.inflight_refs += 1
            s.pending_samples = pending + 1
        return DecodeRows(seqs, starts, tokens, carries, samples), flags

    def _admit_branches(self, step_id: int, planned: set[int]) -> list[tuple[int, int]]:
        """Admit waiting `choice` branches (constrain/choice.py) as decode rows, with no prefill: a branch maps the prompt
        pages of a source that holds them (the leader, a branch admitted so, or the group's template) but the last
        (read-only, refcounted), gets a copy of that one (run before this step: `StepPlan.page_copies`), and its first
        row recomputes the prompt's last position, whose logits score the option's first token. So a branch costs one
        decode row a token of its option, and up to a decode bucket of branches start at once, where a prefill row
        each (the prompt's tail, up to a page) took up to a prefill bucket's rows a step (the embedded model on the
        2-core CPU box, default engine: ~1 s an option). While branches of a group wait, the group keeps a template
        (the shared pages and a copy of the last), so that branches admitted after every running one has finished
        still find their source. Returns the page copies."""
        copies: list[tuple[int, int]] = []
        room = min(self.config.max_num_seqs - self.num_running, self._decode_limit() - self._decodable())
        ps = self.pages.page_size
        first_new = self._admissions  # sequences admitted from here on are this plan's: no source yet
        sources: dict[int, list[int] | None] = {}  # id(group) -> a block table whose prompt KV is written
        waiting: dict[int, int] = collections.Counter()  # id(group) -> its branches still waiting after this plan
        groups = {}
        rows: dict[int, int] = {}  # id(group) -> room for more of its branches (max_choice_rows)
        for s in list(self.waiting):
            if s.share_from is None or s.finalized:
                continue
            group = s.choice_group
            key = id(group)
            if key not in groups:
                groups[key] = group
                rows[key] = self.config.max_choice_rows - _rows_wanted(group)
            n = len(s.prompt_ids)
            last = (n - 1) // ps  # the page that holds the prompt's last position
            if key not in sources:
                sources[key] = self._branch_source(group, n, last, step_id, first_new, planned)
            table = sources[key]
            if (room <= 0 or rows[key] <= 0 or table is None or s.inflight_refs or s.output_ids
                    or not self.pages.num_available):
                waiting[key] += 1
                continue
            [page] = self.pages.allocate(1)
            s.block_table = self.pages.share(table[:last]) + [page]
            copies.append((table[last], page))
            s.share_from = None
            s.num_computed = s.prefill_target = n - 1  # a decode row at position n - 1 (its input: the prompt's)
            if self.pages.prefix_caching:
                self.pages.query_tokens += n
                self.pages.hit_tokens += n - 1
            self.waiting.remove(s)
            self.running.append(s)
            s.status = "running"
            s.admitted_at, self._admissions = self._admissions, self._admissions + 1
            room -= 1
            rows[key] -= 1
        for key, group in groups.items():
            if not waiting[key]:
                self._drop_template(group)
            elif key not in self._templates and sources[key] is not None and self.pages.num_available:
                table = sources[key]
                last = (len(group.parent.prompt_ids) - 1) // ps
                [page] = self.pages.allocate(1)
                self._templates[key] = (self.pages.share(table[:last]) + [page], step_id)
                copies.append((table[last], page))
        if not groups:
            self._branches_waiting = 0
        return copies

    def _branch_source(self, group, n: int, last: int, step_id: int, first_new: int,
                       planned: set[int]) -> list[int] | None:
        """A block table holding the group's prompt KV below position n - 1, written by a launched step or by a copy
        run before one: the group's template if made by an earlier plan, else a branch admitted by an earlier plan
        that has computed that far (a preempted one is not running; the source is kept from preemption in this plan,
        its page being copied before the step runs). None: none yet (the leader's prefill is not launched)."""
        template = self._templates.get(id(group))
        if template is not None and template[1] < step_id:
            return template[0]
        b = next((b for b in group.branches if b.status == "running" and b.admitted_at < first_new
                  and b.num_computed >= n - 1 and len(b.block_table) > last), None)
        if b is None:
            return None
        planned.add(id(b))
        return b.block_table

    def _drop_template(self, group) -> None:
        template = self._templates.pop(id(group), None)
        if template is not None:
            self.pages.release(template[0])

    def _decodable(self) -> int:
        """Running sequences that want a decode row (an upper bound: the step's decode rows)."""
        return sum(1 for s in self.running if not s.finalized and s.num_computed >= s.prefill_target)

    def _plan_prefill(self, budget: int, planned: set[int], decode: DecodeRows) -> tuple[list[Row], StepShape | None]:
        """Prefill chunks for the step (oldest first) and the ready shape that holds them with `decode` (None: no
        prefill). Only shapes in `ready` are used: a chunk is cut to the largest ready prefill bucket."""
        cfg = self.config
        d_part = cfg.mixed_decode_rows if decode else 0
        rows: list[Row] = []
        shape: StepShape | None = None
        prefilling = [s for s in self.running  # in admission order (see _plan_decode)
                      if not s.finalized and s.status == "running" and s.num_computed < s.prefill_target]
        candidates = prefilling + [s for s in self.waiting if not s.finalized]
        num_running = self.num_running if candidates else 0
        max_chunk = self._max_ready_chunk(d_part) if candidates else 0
        if candidates and not max_chunk:
            self._want(StepShape(d_part, *cfg.prefill_buckets[0], self._ctx_for(candidates[0])))
        for s in candidates:
            if budget <= 0 or not max_chunk:
                break
            admitting = s.status == "waiting"
            if admitting:
                if s.inflight_refs:  # preempted while in flight: re-admit once its last token has landed
                    continue
                if num_running >= cfg.max_num_seqs:
                    break
                if not self._map_prefix(s):
                    continue  # a choice branch waits for its leader's prompt prefill to be launched
                target = s.num_tokens
            else:
                target = s.prefill_target
            chunk = min(target - s.num_computed, max_chunk, budget)
            if s.image is not None and s.num_computed + chunk < sum(s.image_run):
                # an image run and every position before it go in one chunk (bidirectional attention): wait for a step
                # with room (the request builder checked that the largest chunk holds it)
                assert admitting, "a running sequence's image prefix was split"
                self._release_pages(s)
                s.num_computed = 0
                break
            row = Row(s, s.num_computed, chunk, [], -1, s.num_computed + chunk == target, len(s.output_ids))
            fit = self._fit_prefill(d_part, rows + [row], decode)
            if fit is None or not self._reserve(s, s.num_computed + chunk, planned, may_preempt=False):
                if admitting:  # a waiting sequence holds no pages (two that did could wait on each other forever)
                    self._release_pages(s)
                    s.num_computed = 0
                break  # no shape or no pages: later arrivals wait too (FIFO)
            if admitting:
                s.share_from = None
                if self.pages.prefix_caching:
                    self.pages.query_tokens += target
                    self.pages.hit_tokens += row.start  # tokens whose KV it reuses
                self.waiting.remove(s)
                self.running.append(s)
                s.status, s.prefill_target = "running", target
                s.admitted_at, self._admissions = self._admissions, self._admissions + 1
                num_running += 1
            row.tokens = s.tokens_between(s.num_computed, s.num_computed + chunk)
            rows.append(row)
            if self.pages.prefix_caching:  # pages this chunk fills are cached (later steps read what it writes)
                self._cache_written_pages(s, s.num_computed + chunk)
            planned.add(id(s))
            shape = fit
            budget -= chunk
        if candidates and not rows and decode and self.ready is not None:
            self._prefill_turn = True  # no ready shape mixes these chunks with decode: try them alone next step
        return rows, shape

    def _map_prefix(self, s: Sequence) -> bool:
        """Before admitting s: map the KV pages it can reuse onto its (empty) block table. A `choice` branch
        (constrain/choice.py) maps its leader's full prompt pages once the leader's prefill of them is launched (later
        steps run after it on the device, so their attention reads the written KV); until then False (wait). A leader
        that is gone leaves the branch to the prefix cache or its own prefill. The mapping is undone if s is not
        admitted after all."""
        if s.share_from is not None:
            leader, tokens = s.share_from
            if id(s.choice_group) in self._templates or not leader.finalized and leader.status != "released":
                return False  # `_admit_branches` takes it as a decode row (no prefill) when there is room
            if _rows_wanted(s.choice_group) >= self.config.max_choice_rows:
                return False  # (its group's rows are taken: max_choice_rows)
        if self.pages.prefix_caching:
            self._map_cached_prefix(s)
        return True

    def _map_cached_prefix(self, s: Sequence) -> None:
        """Map the longest cached run of s's full pages onto its (empty) block table; at least one token is left to
        compute, whose logits the admission samples."""
        target = s.num_tokens
        keys = self._page_keys(s, (target - 1) // self.pages.page_size)
        pages = self.pages.lookup(keys)
        s.block_table, s.pages_cached = pages, len(pages)
        s.num_computed = len(pages) * self.pages.page_size

    def _cache_written_pages(self, s: Sequence, written: int) -> None:
        """Cache s's full pages below position `written` (launched steps write them) whose tokens the host knows."""
        known = min(written, len(s.prompt_ids) + len(s.output_ids))
        n = min(known // self.pages.page_size, len(s.block_table))
        if n > s.pages_cached:
            self.pages.register(s.block_table[s.pages_cached:n], self._page_keys(s, n)[s.pages_cached:n])
            s.pages_cached = n

    def _page_keys(self, s: Sequence, n: int) -> list:
        ps = self.pages.page_size
        if len(s.page_keys) >= n:
            return s.page_keys[:n]
        tokens = s.prompt_ids if n * ps <= len(s.prompt_ids) else s.prompt_ids + s.output_ids
        extra = s.lora_key if s.image is None else (s.lora_key, s.image.digest)  # (an image's pages: its content)
        return page_keys(tokens, ps, n, s.page_keys, extra)[:n]

    def _max_ready_chunk(self, d_part: int) -> int:
        """Tokens per row of the largest ready prefill bucket that goes with `d_part` decode rows (0: none ready)."""
        if self.ready is None:
            return self.config.max_prefill_chunk
        return max((s.prefill_tokens for s in self.ready if s.prefill_rows and s.decode_rows == d_part), default=0)

    def _ctx_for(self, seq: Sequence) -> int:
        """The context bucket a prefill chunk of `seq` needs (0 if attention takes none)."""
        if not self.config.context_buckets:
            return 0
        need = self.pages.pages_for(min(seq.num_tokens, seq.num_computed + self.config.max_prefill_chunk))
        return next((c for c in self.config.context_buckets if c >= need), self.config.context_buckets[-1])

    def _want(self, shape: StepShape) -> None:
        if not self._is_ready(shape) and self.wanted is None:
            self.wanted = shape

    def _fit_prefill(self, d_part: int, rows: list[Row], decode: DecodeRows) -> StepShape | None:
        """The cheapest ready shape with `d_part` decode rows that holds every prefill row (and, with static
        attention, the decode rows' contexts), or None. If the cheapest is not ready, it becomes `wanted`."""
        chunks = [r.num_tokens for r in rows]
        ctxs = self._ctx_pages(rows + (decode.rows() if self._static_decode() else []))
        fits = sorted((r * t, r, t) for r, t in self.config.prefill_buckets if r >= len(chunks) and t >= max(chunks))
        best = None
        for _, r, t in fits:
            for c in ctxs:
                shape = StepShape(d_part, r, t, c)
                if best is None:
                    best = shape
                if self._is_ready(shape):
                    return shape
        if best is not None:
            self._want(best)
        return None

    def _reserve(self, s: Sequence, num_tokens: int, planned: set[int], may_preempt: bool = True) -> bool:
        """Make s's block table cover `num_tokens` positions, preempting the latest-admitted other sequences if the pool
        is dry (never one already in this plan). If nothing else can go, s itself is preempted and False returned."""
        need = self.pages.pages_for(num_tokens) - len(s.block_table)
        if need <= 0:
            return True
        while self.pages.num_available < need:
            if not may_preempt:
                return False
            victims = [v for v in self.running if v is not s and id(v) not in planned and not v.finalized
                       and v.status == "running" and v.last_sample[0] != self._next_step]
            if not victims:
                self._preempt(s)
                return False
            self._preempt(max(victims, key=lambda v: v.admitted_at))
        s.block_table += self.pages.allocate(need)
        return True

    def poison(self, s: Sequence) -> None:
        """s's logits were not finite, so the KV it wrote may be too: its pages leave the prefix cache now (a request
        that already mapped one attends over it and is caught the same way) and are never offered to it again."""
        s.poisoned = True
        self.pages.uncache(s.block_table)

    def _release_pages(self, s: Sequence) -> None:
        """Drop s's block table; the full pages its launched steps wrote stay cached (prefix caching) until evicted."""
        if self.pages.prefix_caching and not s.poisoned:
            self._cache_written_pages(s, s.num_computed)
        self.pages.release(s.block_table)
        s.block_table = []
        s.pages_cached = 0

    def _preempt(self, s: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens; the sequence is prefilled again from its full history.
        Freeing pages of a sequence still in flight is safe: the device runs steps in order, so the in-flight step's
        writes land before any later step that reuses the pages, and its sampled token is still valid."""
        self._release_pages(s)
        s.num_computed = 0
        s.prefill_target = 0
        s.status = "waiting"
        self.running.remove(s)
        self.waiting.appendleft(s)
        self.num_preemptions += 1


def _rows_wanted(group) -> int:
    """A choice group's branches that take a row in the step being planned: running, some of their (known number of)
    tokens not yet planned."""
    return sum(1 for b in group.branches if b.status == "running" and not b.finalized
               and len(b.output_ids) + b.pending_samples < b.max_new_tokens)

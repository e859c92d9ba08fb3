"""The engine tick: launch t+1 -> commit t -> finalize t+1's sampling.

With pipeline_depth=2 the step for t+1 is planned from what the host knows before t is committed, and dispatched
before t's tokens reach the host; with pipeline_depth=1 the same code commits each step right after launching it (the
blocking baseline). Sequences that finish while still inside a launched step are finalized at once (their result is
emitted) and released only when the last step referencing them has been committed: zombies.

Forward now, sample later: a grammar row's mask for t+1 depends on the token committed at t, but its forward does not.
A step with any such row is launched without its sampler (forward only, logits kept on the device); after commit t the
matchers advance, the masks are filled and uploaded, and t+1 is sampled ("finalized"). Steps whose rows are all free
sample inside the forward and finalize is a no-op for them, so they run a step ahead as before.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import logging

from jphoton.constraints import GrammarCompiler
from jphoton.engine import compiles
from jphoton.engine.pages import PagePool
from jphoton.engine.runner import DecodeSlot, Runner, StepResult
from jphoton.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from jphoton.engine.telemetry import StepRecord, Telemetry
from jphoton.sequence import Delta, Sequence

log = logging.getLogger("jphoton.engine")


@dataclasses.dataclass
class Output:
    """What a tick produced for one request."""

    seq: Sequence
    delta: Delta
    logprobs: list | None = None


class Engine:
    def __init__(self, model, *, sched: SchedulerConfig, num_pages: int, page_size: int, max_model_len: int,
                 pipeline_depth: int = 1, max_logprobs: int = 20, grammar: GrammarCompiler | None = None,
                 dispatch_thread: bool = False):
        if pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline_depth must be 1 (blocking) or 2 (pipelined), got {pipeline_depth!r}")
        self.depth = pipeline_depth
        self.pages = PagePool(num_pages, page_size)
        self.scheduler = Scheduler(sched, self.pages)
        self.runner = Runner(model, sched=sched, num_pages=num_pages, page_size=page_size,
                             max_model_len=max_model_len, max_logprobs=max_logprobs, dispatch_thread=dispatch_thread)
        self.max_model_len = max_model_len
        self.inflight: collections.deque[DecodeSlot] = collections.deque()
        self.sequences: dict[int, Sequence] = {}  # live (not yet released) sequences by request id
        self.num_steps = 0
        self.num_constrained_steps = 0
        self.grammar = grammar
        # Fill grammar masks on a worker thread, overlapping the rest of the commit and the next step's planning?
        # (benchmarks/constrained.py measures both; the switch costs GIL hand-offs.)
        self.overlap_masks = False
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jphoton-masks")
        self._mask_job = None  # (slot, host mask, future) while a step's grammar masks are being filled
        self._next = None  # (plan, record, packed input) of a step planned ahead, during a mask fill
        self.telemetry = Telemetry()
        self._records: dict[int, StepRecord] = {}
        # LLM(freeze_gc=True) sets this: after a tick in which something compiled (a shape first seen by an engine
        # built without warm-up), collect and freeze again, so that the compile's long-lived objects (jaxprs, lowering
        # caches) are not rescanned by every later full collection. On the H100 one such full pass took 98.7 ms inside a
        # B=32 decode tick (RESULTS.md, 2026-11-24 22:33); here it runs right after a compile that took seconds.
        self.refreeze_gc = False
        self._compiles_seen = compiles.num_compiles()

    # ---- requests --------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        need = self.pages.pages_for(len(seq.prompt_ids) + seq.max_new_tokens)
        if need > self.pages.num_pages:
            raise ValueError(f"request needs {need} KV pages ({len(seq.prompt_ids)} prompt + {seq.max_new_tokens} new "
                             f"tokens) but the whole pool has {self.pages.num_pages}")
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: int) -> Output | None:
        """Finalize a request now (result emitted with finish_reason "abort"); its pages come back once no in-flight
        step references it. Unknown or already finished ids are ignored."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.finalized:
            return None
        out = Output(seq, seq.finish("abort"))
        self._maybe_release(seq)
        return out

    def has_work(self) -> bool:
        return bool(self.inflight) or self._next is not None or self.scheduler.has_work()

    # ---- the tick --------------------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One tick: launch the next step if there is one, commit what the pipeline depth says is due, finalize the
        sampling of a step that waits for grammar masks."""
        outputs: list[Output] = []
        now = self.telemetry.now
        if self._next is not None:  # planned (and packed) last tick, before a grammar step's sampler
            plan, rec, packed = self._next
            self._next = None
        else:
            plan, rec, packed = self._plan()
        if plan is not None:
            rec.t_launch = now()
            self.inflight.append(self.runner.launch(plan, rec, defer_sampling=rec.constrained_rows > 0,
                                                    packed=packed))
            rec.t_launched = now()
            self._records[plan.step_id] = rec
            self.num_steps += 1
        keep = self.depth - 1 if plan is not None else 0
        while len(self.inflight) > keep:
            slot = self.inflight.popleft()
            if slot.awaiting_mask:  # depth 1: sample right away (every earlier token is committed)
                self._finalize(slot)
            step_plan = slot.plan
            rec = self._records.pop(step_plan.step_id)
            rec.t_commit = now()
            result = self.runner.fetch(slot)
            rec.t_ready = now()
            verdicts = self._advance_grammar(step_plan, result) if rec.constrained_rows else {}
            rec.t_advanced = now()
            waiting = next((s for s in self.inflight if s.awaiting_mask), None)
            if waiting is not None and self.overlap_masks:  # its masks need only the matchers: start them now
                self._start_masks(waiting, background=True)
            outputs += self._commit(step_plan, result, verdicts)
            rec.t_committed = now()
            self.telemetry.add(rec)
        waiting = next((s for s in self.inflight if s.awaiting_mask), None)
        if waiting is not None:  # depth 2: the step just launched has grammar rows
            if self.overlap_masks and self._mask_job is None:
                self._start_masks(waiting, background=True)
            # Plan and pack the step after it now: its input then rides in the masked sampler's transfer (one
            # host->device copy per step), and a background mask fill overlaps the planning.
            self._next = self._plan()
            self._finalize(waiting)
        if self.refreeze_gc and compiles.num_compiles() != self._compiles_seen:
            self._refreeze_gc()
        return outputs

    def _refreeze_gc(self) -> None:
        self._compiles_seen = compiles.num_compiles()
        gc.collect()
        gc.freeze()
        log.info("a tick compiled: garbage collector refrozen (%d objects frozen)", gc.get_freeze_count())

    def _plan(self):
        t_plan = self.telemetry.now()
        plan = self.scheduler.plan()
        if plan is None:
            return None, None, None
        kind = "mixed" if plan.decode and plan.prefill else "decode" if plan.decode else "prefill"
        rec = StepRecord(plan.step_id, kind, len(plan.rows), plan.num_tokens, t_plan=t_plan)
        rec.constrained_rows = sum(1 for r in plan.rows if r.samples and r.seq.constraint is not None)
        if rec.constrained_rows and self.num_constrained_steps == 0:
            log.info("grammar rows in the batch: their steps sample after the previous commit (forward now, "
                     "sample later)")
        self.num_constrained_steps += rec.constrained_rows > 0
        packed = self.runner.pack(plan)
        rec.t_planned = self.telemetry.now()
        return plan, rec, packed

    # ---- grammar rows ----------------------------------------------------------------------------------------------
    def _advance_grammar(self, plan: StepPlan, result: StepResult) -> dict[int, tuple[bool, bool, str]]:
        """Feed every live grammar row its committed token: {id(row): (accepted, grammar complete, error)}. Read out
        here, before any mask job runs, so that no matcher is touched from two threads."""
        guided = [r for r in plan.rows if r.samples and not r.seq.finalized and r.seq.constraint is not None]
        if not guided:
            return {}
        oks = self.grammar.advance([(r.seq.constraint, result.tokens[r.out_row]) for r in guided])
        return {id(r): (ok, r.seq.constraint.done, "" if ok else r.seq.constraint.error())
                for r, ok in zip(guided, oks, strict=True)}

    def _start_masks(self, slot: DecodeSlot, background: bool = False) -> None:
        """Fill the step's grammar masks (in the background: on a worker thread; llguidance releases the GIL); every
        token before the step is committed (or, mid-commit, fed to its matcher), so each matcher is in the state its
        row's mask needs."""
        rec = self._records[slot.plan.step_id]
        rec.t_finalize = self.telemetry.now()
        inp = self.runner.sampler_input(slot.plan, masked=True)
        rows = [(r.seq.constraint, r.out_row) for r in slot.plan.rows
                if r.samples and r.seq.constraint is not None and not r.seq.finalized
                and not r.seq.constraint.matcher.is_error()]  # zombies and failed rows keep the all-ones row
        if background:
            job = self._mask_pool.submit(self.grammar.fill_masks, rows, inp.mask)
        else:
            self.grammar.fill_masks(rows, inp.mask)
            job = None
        self._mask_job = (slot, inp, job)

    def _finalize(self, slot: DecodeSlot) -> None:
        """Sample a step that has grammar rows, with its masks; a step planned ahead (self._next) sends its input along
        in the same transfer and keeps the device copy for its launch."""
        if self._mask_job is None or self._mask_job[0] is not slot:
            self._start_masks(slot)
        _, inp, job = self._mask_job
        self._mask_job = None
        if job is not None:
            job.result()
        rec = self._records[slot.plan.step_id]
        rec.t_masked = self.telemetry.now()
        then = self._next[2] if self._next is not None and self._next[0] is not None else None
        carried = self.runner.finalize(slot, inp, then)
        if carried is not None:
            self._next = (self._next[0], self._next[1], carried)
        rec.t_finalized = self.telemetry.now()

    def _commit(self, plan: StepPlan, result: StepResult, grammar: dict[int, tuple[bool, bool, str]]) -> list[Output]:
        outputs = []
        tokens = result.tokens.tolist()  # Python ints at once: indexing the array per row cost ~0.2 us a row
        for row in plan.rows:
            seq = row.seq
            seq.inflight_refs -= 1
            if row.samples:
                seq.pending_samples -= 1
            if row.samples and seq.finish_reason is None:
                token = tokens[row.out_row]
                accepted, grammar_done, error = grammar.get(id(row), (True, False, "")) if grammar else (True, False, "")
                if not accepted:  # cannot happen with a correct mask; end this request only
                    log.error("request %d: grammar rejected token %d: %s", seq.request_id, token, error)
                    outputs.append(Output(seq, seq.finish("error", f"the grammar rejected token {token}: {error}")))
                    self._maybe_release(seq)
                    continue
                delta = seq.append(token, grammar_done=grammar_done)
                lp = None
                if seq.params.logprobs and result.logprobs is not None:
                    k = seq.params.logprobs
                    lp = [(token, float(result.logprobs[row.out_row, 0]),
                           {int(i): float(v) for i, v in zip(result.top_ids[row.out_row, :k],
                                                             result.logprobs[row.out_row, 1:k + 1], strict=True)})]
                    seq.logprobs.extend(lp)
                outputs.append(Output(seq, delta, lp))
            if seq.finish_reason is not None and not seq.inflight_refs:  # else release_if_done is a no-op
                self._maybe_release(seq)
        return outputs

    def _maybe_release(self, seq: Sequence) -> None:
        if self.scheduler.release_if_done(seq):
            del self.sequences[seq.request_id]

    # ---- introspection ---------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "kv_pages_total": self.pages.num_pages,
            "kv_pages_free": self.pages.num_free,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            "constrained_steps": self.num_constrained_steps,
            "input_transfers": self.runner.input_transfers,
            "inflight_steps": len(self.inflight),
        }

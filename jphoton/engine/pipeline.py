"""The engine tick, top to bottom: launch t+1 -> commit t -> finalize t+1's sampling.

One tick at pipeline depth 2 (the default), step t already on the device:

    host:   launch t+1 | plan+pack t+2 | wait for t's tokens, commit t | [grammar rows in t+1: fill masks, sample t+1]
    device: ..................... step t ....................... | step t+1 (carried-over tokens read on the device)

- Launch: the scheduler planned t+1 in the tick before, from what the host knew before t-1 was committed (so only the
  commit and the launch lie between two steps); a decode row whose input token is still on the device names the row of
  the previous step's output that holds it (`carry_from`). The runner packs the step into one
  host->device input and dispatches it into the free `DecodeSlot` (one per step in flight, in turn; outputs donated).
- Commit: the host copy of t's tokens (started at t's launch) is read; tokens are appended, stops checked, outputs
  emitted. At depth 1 the step just launched is committed in the same tick (the blocking loop); t+1 is planned and
  packed while t runs (its launch still waits for t's commit), so only the launch and the commit are in series.
- Depth 3 keeps two steps in flight after each launch (t+1 and t+2 are dispatched before t's tokens reach the host):
  the device has a step queued while the host's tick runs long, at one more step of latency per token. A step with
  grammar rows still waits for the commit before it (its masks need every earlier token).
- Zombies: a sequence that finishes at t is already in t+1 (and in t+2, planned before t's commit). It is finalized
  at once (its result emitted); its pages go back only when `inflight_refs` (launched steps that reference it) is 0.
- Forward now, sample later: a grammar row's mask for t+1 depends on the token committed at t, but its forward does
  not. A step with grammar rows is launched forward-only (logits kept on the device); after commit t the matchers
  advance, the masks are filled and the step is sampled ("finalized"). The step after it is planned first, so that its
  input rides in the masked sampler's transfer (one host->device copy per step). Steps whose rows are all free sample
  inside the forward, so they run a step ahead.

- K steps a launch (`decode_steps`): a decode-only step with no host decision due runs K decode steps in one program
  (scheduler.py `_decode_steps`); its commit appends each row's K tokens (`_commit_steps`), dropping what follows a
  row's end.

Invariants: a slot is reused only after the commit that read it; only the latest launched step can be finalized (the
next launch reads its tokens); a sequence's pages are released only when it is finalized and no launched step
references it.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
from collections.abc import Callable

from jphoton.constrain.automaton import AutomatonPool
from jphoton.constrain.compiler import GrammarCompiler
from jphoton.engine import compiles
from jphoton.engine.config import EngineConfig
from jphoton.engine.images import ImageSlots, placeholder_tokens
from jphoton.engine.lifecycle import Lifecycle
from jphoton.engine.loras import LoraSlots
from jphoton.engine.pages import PagePool
from jphoton.engine.plan import CONSTRAINED, LOGPROBS, StepPlan, step_tokens
from jphoton.engine.runner import Runner
from jphoton.engine.scheduler import Scheduler
from jphoton.engine.slots import NONFINITE, NONFINITE_ERROR, DecodeSlot, PlannedStep, StepResult
from jphoton.engine.telemetry import StepRecord, Telemetry
from jphoton.sequence import RequestOutput, Sequence

log = logging.getLogger("jphoton.engine")


@dataclasses.dataclass
class GrammarVerdict:
    """A grammar row's matcher after its committed token."""

    accepted: bool
    done: bool  # the grammar is complete: the request stops here
    error: str


ACCEPTED = GrammarVerdict(True, False, "")


class Engine(Lifecycle):
    """The tick (this module's docstring) and what it reads and writes; request bookkeeping: engine/lifecycle.py."""

    def __init__(self, model, config: EngineConfig, num_pages: int, grammar: GrammarCompiler | None = None):
        self.config = config
        self.depth = config.pipeline_depth
        self.pages = PagePool(num_pages, config.page_size, prefix_caching=config.prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.pages)
        self.runner = Runner(model, config, num_pages)
        self.loras = LoraSlots(config.max_loras)
        # the device's image cache (models with an image encoder): which image each slot holds (engine/images.py)
        self.images = ImageSlots(self.runner.vision.slots) if self.runner.vision is not None else None
        self.grammar = grammar
        # Device automata (jphoton/constrain/automaton.py): rows of the runner's tables, handed to regular constraints at add
        self.automata = AutomatonPool(self.runner.automaton_states) if self.runner.automaton_states else None
        if grammar is not None:
            grammar.use_automata(self.runner.automaton_states)
        self.num_automaton_steps = 0  # steps whose automaton rows sampled on the device
        self.inflight: collections.deque[DecodeSlot] = collections.deque()  # launched, not yet committed
        self.ahead: PlannedStep | None = None  # planned during the last tick's finalize; launched next tick
        self.sequences: dict[int, Sequence] = {}  # live (not yet released) sequences by request id
        self._next_branch_id = -1  # internal sequences (a choice request's branches) count down from -1
        self.num_steps = 0
        self.num_constrained_steps = 0
        self.telemetry = Telemetry()
        # LLM(freeze_gc=True) sets this: after a tick in which something compiled (a shape first seen by an engine
        # built without warm-up), collect and freeze again, so that the compile's long-lived objects are not rescanned
        # by every later full collection (a 98.7 ms full pass inside a B=32 tick on the H100, docs/decisions.md).
        self.refreeze_gc = False
        self._compiles_seen = compiles.num_compiles()
        # Shapes still compiling on the background thread (engine/warmup.py): no refreeze until it is done (its
        # compiles would make every tick refreeze); one refreeze after.
        self.compiling_in_background: Callable[[], bool] = lambda: False

    def has_work(self) -> bool:
        return bool(self.inflight) or self.ahead is not None or self.scheduler.has_work()

    # ---- the tick --------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One tick: launch the next step if there is one, commit what the pipeline depth says is due, finalize the
        sampling of a launched step that waits for grammar masks."""
        # 1. launch t+1
        step, self.ahead = self.ahead or self._plan(), None
        if step is not None:
            self._launch(step)
            # Plan and pack the next step now, while the device runs, so that only the commit and the launch lie
            # between one step's end and the next launch. Depth 1: t+1, launched after t's commit. Depth 2: t+2, unless
            # t+1 waits for grammar masks (its successor is planned after the commit, below, to ride in its
            # transfer); a row that finishes at t is then a zombie in t+2 as well (inflight_refs covers it).
            if self.depth == 1 or not self.inflight[-1].awaiting_mask:
                self.ahead = self._plan()
        # 2. commit t (depth 2 keeps the step just launched in flight, depth 3 the two last; depth 1 and an idle tick
        # commit everything; a step waiting for grammar masks needs every token before it committed)
        outputs: list[RequestOutput] = []
        keep = 0 if step is None else min(self.depth - 1, 1) if self.inflight[-1].awaiting_mask else self.depth - 1
        while len(self.inflight) > keep:
            slot = self.inflight.popleft()
            if slot.awaiting_mask:  # depth 1: sample right away (every earlier token is committed)
                self._finalize(slot)
            outputs += self._commit(slot)
        # 3. finalize t+1: a launched grammar step is sampled now that t is committed; the step after it is planned
        # first, so that its input rides in the sampler's transfer
        if self.inflight and self.inflight[-1].awaiting_mask:
            self.ahead = self._plan()
            self._finalize(self.inflight[-1])
        if (self.refreeze_gc and compiles.num_compiles() != self._compiles_seen
                and not self.compiling_in_background()):
            self._refreeze_gc()
        return outputs

    def _plan(self) -> PlannedStep | None:
        now = self.telemetry.now
        t_plan = now()
        plan = self.scheduler.plan()
        if plan is None:
            return None
        pinned = self._prepare_images(plan) if self.images is not None else ()
        kind = "mixed" if plan.decode and plan.prefill else "decode" if plan.decode else "prefill"
        rec = StepRecord(plan.step_id, kind, plan.num_rows, plan.num_tokens, plan.shape.steps, t_plan=t_plan)
        grammar_rows = automaton_rows = 0
        if plan.flags & CONSTRAINED:
            for r in plan.rows:
                c = r.seq.constraint
                if c is not None and r.samples and not (c.kind == "forced" and c.forced(r.sample_index)):
                    grammar_rows += 1  # (a choice branch's row is forced on the device: constrain/choice.py)
                    automaton_rows += c.device is not None
        rec.automaton_rows = automaton_rows
        # Automaton rows sample inside the step (its filtered variant reads the device tables) unless the step must be
        # sampled later anyway: host-mask rows (llguidance), logprobs (a second sampler), no filtered variant (yet).
        on_device = (automaton_rows > 0 and automaton_rows == grammar_rows and self.runner.has_filtered_variant(plan)
                     and not plan.flags & LOGPROBS)
        rec.constrained_rows = 0 if on_device else grammar_rows  # sampled at finalize, under host masks
        if rec.constrained_rows and self.num_constrained_steps == 0:
            log.info("grammar rows in the batch: their steps sample after the previous commit (forward now, "
                     "sample later)")
        if on_device and self.num_automaton_steps == 0:
            log.info("device automata: grammar rows sample inside the step (no host masks)")
        self.num_constrained_steps += rec.constrained_rows > 0
        self.num_automaton_steps += on_device
        step = PlannedStep(plan, rec, self.runner.pack(plan, on_device), automata=on_device, image_slots=pinned)
        rec.t_planned = rec.t_packed = now()
        return step

    def _prepare_images(self, plan: StepPlan) -> list[int]:
        """For each prefill chunk that covers an image run: take a slot of the image cache (pinned until the step's
        launch), dispatch the vision step into it unless it holds the image already (a repeated image), and point the
        chunk's placeholder tokens at the slot's rows. The vision step is dispatched now, so it runs on the device
        before this step and after the one in flight."""
        pinned = []
        rows = self.runner.vision.embed_rows
        for r in plan.prefill:
            s = r.seq
            start, length = s.image_run
            if s.image is None or r.start >= start + length or r.start + r.num_tokens <= start:
                continue
            slot, resident = self.images.acquire(s.image.digest)
            if not resident:
                self.runner.encode_image(slot, s.image.crops, s.image.pool_rows, s.image.pool_cols)
            pinned.append(slot)
            r.tokens = placeholder_tokens(r.start, r.tokens, start, length, slot, rows)
        return pinned

    def _launch(self, step: PlannedStep) -> None:
        rec = step.record
        rec.t_launch = self.telemetry.now()
        self.inflight.append(self.runner.launch(step, defer_sampling=rec.constrained_rows > 0))
        for slot in step.image_slots:  # (launched: a later vision step into the slot runs after this step's read)
            self.images.unpin(slot)
        if rec.automaton_rows:  # where the next step finds these rows' automaton state (packing.py)
            for r in step.plan.rows:
                if r.samples:
                    r.seq.automaton_on_device = step.automata
        rec.t_launched = self.telemetry.now()
        self.num_steps += 1

    def _finalize(self, slot: DecodeSlot) -> None:
        """Fill the grammar rows' masks (every token before the step is committed, so each matcher is in the state its
        row needs) and sample the step; a step planned ahead sends its input along in the same transfer."""
        now = self.telemetry.now
        plan, rec = slot.step.plan, slot.step.record
        rec.t_finalize = now()
        inp = self.runner.sampler_input(plan, masked=True)
        rows = [(r.seq.constraint, r.out_row) for r in plan.rows
                if r.samples and r.seq.constraint is not None and not r.seq.finalized
                and not r.seq.constraint.failed]  # zombies and failed rows keep the all-ones row
        if rec.automaton_rows:  # (an automaton row's mask is a row of its table, in the state the host holds)
            for c, out_row in rows:
                if c.device is not None:
                    inp.mask[out_row] = c.device.automaton.mask[c.device.state]
            rows = [(c, out_row) for c, out_row in rows if c.device is None]
        self.grammar.fill_masks(rows, inp.mask)
        rec.t_masked = now()
        self.runner.finalize(slot, inp, then=self.ahead.input if self.ahead is not None else None)
        rec.t_finalized = now()

    # ---- commit ----------------------------------------------------------------------------------------------------
    def _commit(self, slot: DecodeSlot) -> list[RequestOutput]:
        now = self.telemetry.now
        plan, rec = slot.step.plan, slot.step.record
        rec.t_commit = now()
        result = self.runner.fetch(slot)
        rec.t_ready = now()
        verdicts = self._advance_grammar(plan, result) if plan.flags & CONSTRAINED else {}
        rec.t_advanced = now()
        outputs: list[RequestOutput] = []
        tokens = result.tokens
        n_decode = len(plan.decode.seqs)
        if plan.shape.steps > 1:  # K tokens a row (plain rows only: scheduler.py `_decode_steps`)
            self._commit_steps(plan, tokens, outputs)
            rec.t_committed = now()
            self.telemetry.add(rec)
            return outputs
        plain = not verdicts and result.logprobs is None and (not n_decode or min(tokens[:n_decode]) >= 0)
        for out_row, seq in enumerate(plan.decode.seqs):  # decode rows: one sample each, at their own output row
            seq.inflight_refs -= 1
            seq.pending_samples -= 1
            if seq.finish_reason is None:
                if plain and seq.choice_group is None:  # (the usual row, inlined)
                    outputs.append(seq.output(seq.append(tokens[out_row])))
                else:
                    self._commit_sample(seq, out_row, tokens[out_row], result, verdicts, outputs)
            if seq.finish_reason is not None and not seq.inflight_refs:  # else release_if_done is a no-op
                self._maybe_release(seq)
        for row in plan.prefill:
            seq = row.seq
            seq.inflight_refs -= 1
            if row.samples:
                seq.pending_samples -= 1
                if seq.finish_reason is None:
                    self._commit_sample(seq, row.out_row, tokens[row.out_row], result, verdicts, outputs)
            elif tokens[row.out_row] == NONFINITE and seq.finish_reason is None:  # a chunk's KV is poisoned already
                self._fail(seq, NONFINITE_ERROR, outputs, poisoned=True)
            if seq.finish_reason is not None and not seq.inflight_refs:
                self._maybe_release(seq)
        rec.t_committed = now()
        self.telemetry.add(rec)
        return outputs

    def _commit_steps(self, plan: StepPlan, tokens: list[int], outputs: list[RequestOutput]) -> None:
        """A K-step launch's decode rows: each row's K tokens in order, until it finishes (the rest are dropped: the
        row ran on past its end on the device, into pages of its own)."""
        K, M = plan.shape.steps, self.runner.static.max_rows
        for out_row, seq in enumerate(plan.decode.seqs):
            seq.inflight_refs -= 1
            seq.pending_samples -= K
            for token in step_tokens(tokens, out_row, K, M):
                if seq.finish_reason is not None:
                    break
                if token < 0:  # NONFINITE
                    self._fail(seq, NONFINITE_ERROR, outputs, poisoned=True)
                    break
                outputs.append(seq.output(seq.append(token)))
            if seq.finish_reason is not None and not seq.inflight_refs:
                self._maybe_release(seq)

    def _commit_sample(self, seq: Sequence, out_row: int, token: int, result: StepResult,
                       verdicts: dict[int, GrammarVerdict], outputs: list[RequestOutput]) -> None:
        """Append a row's sampled token to its live sequence (grammar verdict, logprobs, choice branches)."""
        if token == NONFINITE:
            self._fail(seq, NONFINITE_ERROR, outputs, poisoned=True)
            return
        verdict = verdicts.get(out_row, ACCEPTED) if verdicts else ACCEPTED
        if not verdict.accepted:  # cannot happen with a correct mask; end this request only
            log.error("request %d: grammar rejected token %d: %s", seq.request_id, token, verdict.error)
            self._fail(seq, f"the grammar rejected token {token}: {verdict.error}", outputs)
            return
        delta = seq.append(token, grammar_done=verdict.done)
        lp = None
        if seq.params.logprobs is not None and result.logprobs is not None:
            k = seq.params.logprobs
            lp = [(token, float(result.logprobs[out_row, 0]),
                   {int(i): float(v) for i, v in zip(result.top_ids[out_row, :k], result.logprobs[out_row, 1:k + 1],
                                                     strict=True)})]
            seq.logprobs.extend(lp)
        if seq.choice_group is None:
            outputs.append(seq.output(delta, lp))
        elif seq.finished:
            self._branch_done(seq, outputs)

    def _advance_grammar(self, plan: StepPlan, result: StepResult) -> dict[int, GrammarVerdict]:
        """Feed every live grammar row its committed token: {output row: verdict}."""
        verdicts = {}
        on_host = []
        tokens = result.tokens
        for r in plan.rows:
            c = r.seq.constraint
            if c is None or not r.samples or r.seq.finalized:
                continue
            token = tokens[r.out_row]
            if token == NONFINITE:  # (the commit ends this request; its matcher never sees the marker)
                continue
            if c.kind == "forced":  # a choice branch: was its forced token taken? (a mismatch is a bug: its error)
                if not c.advance(int(token)):
                    verdicts[r.out_row] = GrammarVerdict(False, True, c.error())
                continue
            device = c.device
            if device is None:
                on_host.append(r)
                continue
            if not device.advance(token):
                verdicts[r.out_row] = GrammarVerdict(False, True, device.error_text)
            elif device.done_after(token):
                verdicts[r.out_row] = GrammarVerdict(True, True, "")
            # (else accepted, not done: the commit's default, no record per row)
        if on_host:
            oks = self.grammar.advance([(r.seq.constraint, result.tokens[r.out_row]) for r in on_host])
            verdicts.update({r.out_row: GrammarVerdict(ok, r.seq.constraint.done, "" if ok else r.seq.constraint.error())
                             for r, ok in zip(on_host, oks, strict=True)})
        return verdicts

    def _refreeze_gc(self) -> None:
        self._compiles_seen = compiles.num_compiles()
        gc.collect()
        gc.freeze()
        log.info("a tick compiled: garbage collector refrozen (%d objects frozen)", gc.get_freeze_count())

    # ---- introspection ---------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "kv_pages_total": self.pages.num_pages,
            "kv_pages_free": self.pages.num_free,
            "kv_pages_evictable": self.pages.num_evictable,  # cached prefixes nobody uses (free when needed)
            "prefix_hit_tokens": self.pages.hit_tokens,
            "prefix_query_tokens": self.pages.query_tokens,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            "constrained_steps": self.num_constrained_steps,
            "automaton_steps": self.num_automaton_steps,
            "automaton_states_used": self.automata.states_used if self.automata else 0,
            "input_transfers": self.runner.input_transfers,
            "inflight_steps": len(self.inflight),
            **self.loras.stats(),
            **(self.images.stats() if self.images is not None else {}),
        }

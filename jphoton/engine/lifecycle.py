"""A request's life outside the tick: admission (its LoRA slot reference, its automaton's device rows, a `choice`'s
branches; jphoton/requests.py checked that it fits the KV pool), aborts, errors, and release (its pages once no
launched step references it, its adapter slot, its automaton rows; a choice is released with its last branch).
Plain Python: `Lifecycle` is the part of `pipeline.Engine` that the tick calls but that is not the tick (it uses the
engine's scheduler, page pool, LoRA slots, automaton pool and runner).

Invariants: a sequence is in `sequences` from `add` until released; finalized (result emitted) comes before
released; a choice request never runs itself (its branches, ids counting down from -1, do).
"""

from __future__ import annotations

import logging

from jphoton.constrain.automaton import AutomatonState
from jphoton.constrain.choice import ChoiceGroup
from jphoton.sequence import RequestOutput, Sequence

log = logging.getLogger("jphoton.engine")


class Lifecycle:
    """Engine's request bookkeeping (mixed into engine/pipeline.py `Engine`, which owns the state it touches)."""

    # ---- admission and aborts ----------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request built by jphoton/requests.py (which checked it, its fit in the KV pool included). ValueError
        only for an adapter unloaded since it was checked."""
        if seq.params.lora is not None:  # a reference on the adapter's slot until the sequence is released
            seq.lora_slot, seq.lora_key = self.loras.acquire(seq.params.lora)
        if seq.choice_options is not None:  # scored on one branch per option (constrain/choice.py); seq never runs
            group = ChoiceGroup(seq, seq.choice_options, seq.stop_ids, self.pages.page_size, self._branch_id,
                                self.config.max_model_len)
            seq.choice_group = group
            for b in group.branches:
                b.lora_slot, b.lora_key = seq.lora_slot, seq.lora_key  # (the request's reference covers them)
                self.sequences[b.request_id] = b
                self.scheduler.add(b)
        self.sequences[seq.request_id] = seq
        if seq.constraint is not None and seq.constraint.automaton is not None:
            self._place_automaton(seq.constraint)
        if seq.choice_group is None:
            self.scheduler.add(seq)

    def _place_automaton(self, constraint) -> None:
        """Give the constraint's automaton rows of the device tables (written once; kept for later requests with the
        same constraint while rows last). No room: the row stays on llguidance's host masks."""
        a = constraint.automaton
        placement = None if self.automata is None else self.automata.place(constraint.automaton_key, a.num_states)
        if placement is None:
            log.info("device automaton tables full (%d states): this request's masks are built on the host",
                     self.automata.capacity if self.automata else 0)
            return
        if not placement.written:
            self.runner.write_automaton(placement.offset, a.next_state, a.mask)
            placement.written = True
        constraint.device = AutomatonState(a, placement)
    def _branch_id(self) -> int:
        self._next_branch_id -= 1
        return self._next_branch_id + 1

    def abort(self, request_id: int) -> RequestOutput | None:
        """Finalize a request now (result emitted with finish_reason "abort"); its pages come back once no in-flight
        step references it. Unknown or already finished ids are ignored."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.finalized or seq.request_id < 0:
            return None
        out = seq.output(seq.finish("abort"))
        self._maybe_release(seq)
        return out

    def load_lora(self, name: str, adapter) -> None:
        """Write an adapter (weights/peft.py) into a free slot and serve it as `name` (replacing an adapter of that
        name: requests running on the old one finish on it, its slot drains). NoFreeLoraSlot if no slot is free."""
        slot = self.loras.free_slot()
        self.runner.load_lora(slot, adapter)
        self.loras.loaded(name, slot, adapter.rank, adapter.source)

    def unload_lora(self, name: str) -> bool:
        """Stop serving `name` (False if not loaded); its slot is reused once the requests using it are released."""
        return self.loras.unload(name)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (pages in use stay with their sequences); returns the pages freed."""
        return self.pages.reset_cache()

    # ---- ends --------------------------------------------------------------------------------------------------------
    def _fail(self, seq: Sequence, error: str, outputs: list[RequestOutput], poisoned: bool = False) -> None:
        """End one request with finish_reason "error" (the others in the step go on). poisoned (its logits were not
        finite): its KV pages, and any it put in the prefix cache, are never served again."""
        if poisoned:
            log.error("request %d: %s", seq.request_id, error)
            self.scheduler.poison(seq)
        delta = seq.finish("error", error)
        if seq.choice_group is None:
            outputs.append(seq.output(delta))
        else:
            self._branch_done(seq, outputs)
        self._maybe_release(seq)

    def _branch_done(self, branch: Sequence, outputs: list[RequestOutput]) -> None:
        """A choice branch finished: once every branch has (or one failed), finalize the request with its pick."""
        group = branch.choice_group
        if group.parent.finalized:  # aborted
            return
        if branch.finish_reason == "error":
            for b in group.branches:
                if not b.finalized:
                    b.finish("abort")
                    self._maybe_release(b)
        if group.decided:
            outputs.append(group.parent.output(*group.finish()))
            self._maybe_release(group.parent)

    def _maybe_release(self, seq: Sequence) -> None:
        """Give a finalized sequence's pages back once no launched step references it. A choice request holds no
        pages: it is released with its last branch (and aborting it aborts its branches)."""
        group = seq.choice_group
        if group is None:
            if self.scheduler.release_if_done(seq):
                self._forget(seq)
            return
        if seq is group.parent:
            for b in group.branches:
                if not b.finalized:
                    b.finish("abort")
                self._maybe_release(b)
        elif self.scheduler.release_if_done(seq):
            del self.sequences[seq.request_id]
        parent = group.parent
        if parent.finalized and parent.status != "released" and group.released:
            parent.status = "released"
            self._forget(parent)

    def _forget(self, seq: Sequence) -> None:
        """A request is released: drop it, and its reference on a LoRA slot (a choice's branches share the parent's)."""
        del self.sequences[seq.request_id]
        if seq.lora_slot >= 0:
            self.loras.release(seq.lora_slot)
        device = seq.constraint.device if seq.constraint is not None else None
        if device is not None:  # its table rows stay for the next request with this constraint, until needed
            self.automata.release(device.placement)

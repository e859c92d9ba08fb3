"""Per-request host state: tokens, text, stop detection. Plain Python; knows nothing of devices."""

from __future__ import annotations

import dataclasses

from jphoton.params import Completion, SamplingParams
from jphoton.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass(slots=True)
class Delta:
    """What one commit adds to a request's output (what a stream yields)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What one engine tick produced for one request (`LLM.step`, `AsyncLLM.generate`)."""

    request_id: int
    delta: Delta  # the tokens and text this tick added; `finish_reason` set on the request's last output
    logprobs: list | None = None  # [(token, logprob, {top id: logprob})] when the request asked for logprobs
    prompt_tokens: int = 0
    completion_tokens: int = 0  # output tokens so far
    error: str | None = None  # why, when finish_reason is "error"
    choice: tuple[int, list[float]] | None = None  # a choice request's last output: (option index, every score)

    @property
    def finished(self) -> bool:
        return self.delta.finish_reason is not None


class Sequence:
    """One request's output as it grows: appends tokens, detokenizes, detects every stop condition.

    Stop strings are searched across token boundaries; text that could still be the start of a stop string is held back
    from the stream until it can't be, so a stream never shows text that the final result then cuts.
    """

    # (slots: the plan and the commit touch every running sequence each tick; `lab/probes/host_sim.py`)
    __slots__ = ("request_id", "prompt_ids", "params", "seed", "output_ids", "logprobs", "finish_reason", "error",
                 "_stop_ids", "stop_ids", "max_new_tokens", "_detok", "text", "_emitted", "_holdback", "status",
                 "block_table", "page_keys", "pages_cached", "num_computed", "prefill_target", "inflight_refs",
                 "pending_samples", "sample_flags", "admitted_at", "last_sample", "lora_slot", "lora_key", "constraint",
                 "automaton_on_device", "choice_options", "choice_group", "share_from", "choice_index", "choice_scores",
                 "poisoned", "image", "image_run", "spatial", "spatial_mode")

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, *, tokenizer: Tokenizer | None,
                 eos_token_ids: tuple[int, ...], max_model_len: int, seed: int):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.output_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stop_ids = tuple(sorted(self._stop_ids))
        limit = max_model_len - len(prompt_ids)
        self.max_new_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        self._detok = IncrementalDetokenizer(tokenizer, self.prompt_ids) if tokenizer is not None else None
        self.text = "" if tokenizer is not None else None
        self._emitted = 0  # characters of self.text already streamed
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        # Engine state (the scheduler and the tick loop own these; the reference decoder ignores them).
        self.status = "waiting"  # waiting -> running -> (preempted back to waiting) -> released
        self.block_table: list[int] = []  # KV pages, in position order
        self.page_keys: list = []  # prefix-cache keys of the first full pages (engine/pages.py), grown as needed
        self.pages_cached = 0  # leading block-table pages already offered to the prefix cache
        self.num_computed = 0  # tokens fed to a launched forward (their KV is written, or will be, in stream order)
        self.prefill_target = 0  # tokens to prefill on (re)admission: every token known on the host then
        self.inflight_refs = 0  # launched, uncommitted steps that contain this sequence (0, 1 or 2)
        self.pending_samples = 0  # sampled tokens still on the device (launched, not yet committed)
        self.sample_flags = 0  # what its rows ask of a step (engine/plan.py row_flags; set by Scheduler.add)
        self.admitted_at = -1  # admission order, for FIFO fairness and last-in-first-out preemption
        self.last_sample = (-1, -1)  # (step id, output row) of the latest launched sample: where a carry-over reads
        self.lora_slot = -1  # the LoRA adapter's device slot (engine/loras.py), -1: the base model
        self.lora_key = None  # that adapter load's id: part of the prefix-cache key of the pages this sequence writes
        self.constraint = None  # jphoton.constrain.compiler.Constraint: the grammar matcher, advanced at each commit
        self.automaton_on_device = False  # the latest launched sample ran under the device automaton (its state there)
        # `choice` requests (constrain/choice.py): the options as token ids (set at submission); the engine scores them
        # on internal branch sequences, which point back at their group and may share a leader's prompt pages.
        self.choice_options: list[list[int]] | None = None
        self.choice_group = None
        self.share_from: tuple[Sequence, int] | None = None  # (leader, tokens of its full prompt pages to map)
        self.choice_index: int | None = None
        self.choice_scores: list[float] | None = None
        self.poisoned = False  # its logits were not finite: its KV pages are never offered to the prefix cache
        # An image input (engine/images.py ImageInput) and its run of placeholder positions (start, length) in the
        # prompt: prefilled in one chunk with every position before it (a bidirectional prefix)
        self.image = None
        self.image_run: tuple[int, int] = (0, 0)
        # A point / detect request (image/spatial.py SpatialAnswer): its rows emit spatial ids, not text; mode for the
        # step input (0: a text request)
        self.spatial = None
        self.spatial_mode = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finalized(self) -> bool:
        """Result emitted; the sequence may still ride in an in-flight step (a zombie) until inflight_refs is 0."""
        return self.finish_reason is not None

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, every one known on the host (a prefill chunk's)."""
        n = len(self.prompt_ids)
        assert end <= n + len(self.output_ids), "tokens still on the device"
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    def append(self, token: int, grammar_done: bool = False) -> Delta:
        """Commit one sampled token; returns the delta to stream (possibly empty text). grammar_done: the request's
        constraint is complete with this token (a stop, like EOS)."""
        assert self.finish_reason is None, "append after finish"
        token = int(token)
        self.output_ids.append(token)
        if self.spatial is not None:  # an object's value or eos: no text
            if token in self._stop_ids:
                self.finish_reason = "stop"
            else:
                try:
                    if self.spatial.push(token):
                        self.finish_reason = "length"  # max_objects
                except ValueError as e:  # (a value out of turn: cannot happen with the engine's spatial step)
                    self.finish_reason, self.error = "error", str(e)
            return Delta([token], "", self.finish_reason)
        if self._detok is not None:
            self.text += self._detok.push(token)
            self._check_stop_strings()
        if self.finish_reason is None:
            if token in self._stop_ids or grammar_done:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
        return self._delta([token])

    def finish(self, reason: str, error: str | None = None) -> Delta:
        """End the request from outside (abort, error); flushes any held-back text."""
        if not self.finished:
            self.finish_reason, self.error = reason, error
        return self._delta([])

    def finish_with(self, token_ids: list[int], text: str | None, logprobs: list | None) -> Delta:
        """Finalize with an output decided elsewhere (a `choice` request's option): the whole output in one delta."""
        assert self.finish_reason is None, "finish_with after finish"
        self.output_ids = list(token_ids)
        if logprobs is not None:
            self.logprobs = list(logprobs)
        if self.text is not None:
            self.text = text
        self.finish_reason = "stop"
        return self._delta(list(token_ids))

    def output(self, delta: Delta, logprobs: list | None = None) -> RequestOutput:
        choice = (self.choice_index, self.choice_scores) if self.choice_index is not None else None
        return RequestOutput(self.request_id, delta, logprobs, len(self.prompt_ids), len(self.output_ids), self.error,
                             choice)

    def _check_stop_strings(self) -> None:
        if not self.params.stop:
            return
        start = max(0, self._emitted - self._holdback)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"

    def _delta(self, token_ids: list[int]) -> Delta:
        text = ""
        if self.text is not None:
            end = len(self.text) if self.finish_reason is not None else max(self._emitted,
                                                                             len(self.text) - self._holdback)
            text, self._emitted = self.text[self._emitted:end], end
        return Delta(token_ids, text, self.finish_reason)

    def completion(self) -> Completion:
        return Completion(prompt_token_ids=list(self.prompt_ids), token_ids=list(self.output_ids), text=self.text,
                          finish_reason=self.finish_reason or "abort", error=self.error,
                          logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
                          choice_index=self.choice_index, choice_scores=self.choice_scores,
                          objects=list(self.spatial.objects) if self.spatial is not None else None)

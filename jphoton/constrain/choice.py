"""`choice` requests scored as whole sequences (plain Python, no jax).

Token-level masking is not what a user means by "pick one of these": asked the capital of France with Paris / London /
Berlin / Madrid, a greedy masked decode took "L" (the likeliest first token) and was then forced through "ondon". Here
each option is scored by its total log-probability under the model, its end included (the likeliest of the model's
stop tokens after it), so "Paris" and "Paris, France" are told apart:

- the request becomes one internal *branch* sequence per option, a *forced* row (`ForcedTokens`): each step the device
  takes the option's next token, then the likeliest of the stop tokens, whatever it drew (engine/step.py `resample`;
  known when the step is planned, so a branch needs no mask and no wait for a commit, and rides the pipeline like a
  free row); the logprob of that token is the raw model's, so the branch's logprobs are the option's per-token
  scores. An end among more than FORCED_SET stop tokens is drawn under a host mask instead (a grammar row's step);
- at most `max_choice_rows` branches of a request decode at once (the scheduler admits the rest as rows free up), so
  that a choice adds a bounded number of rows to every step it shares with other streams;
- branches share the prompt's KV: the first branch (the leader) prefills the whole prompt, every other one maps its
  full pages (refcounted, read-only) and a copy of the last once the leader's prefill is launched, and starts as a
  decode row at the prompt's last position (engine/scheduler.py `_admit_branches`);
- when every branch is done the request is finalized with the best option (greedy) or one drawn from
  softmax(scores / temperature) with the request's seed.
"""

from __future__ import annotations

import math
import random

import numpy as np

from jphoton.params import SamplingParams
from jphoton.sequence import Delta, Sequence

FORCED_SET = 4  # candidates a forced row may name on the device (its end: the likeliest of the request's stop tokens)


class ForcedTokens:
    """A grammar row's constraint that allows exactly one token at each step (an option's tokens, in order), then only
    the stop tokens (none: the option alone). Same interface as constraints.Constraint."""

    kind = "forced"
    automaton = device = None  # (never a device automaton: its mask is filled on the host)

    def __init__(self, tokens: list[int], stop_ids: tuple[int, ...]):
        self.tokens = list(tokens)
        self.stop_ids = list(stop_ids)
        self.consumed = 0  # tokens committed so far
        self.rejected = -1  # a token the row should never have sampled (-1: none)

    @property
    def length(self) -> int:
        return len(self.tokens) + bool(self.stop_ids)

    @property
    def done(self) -> bool:
        return self.consumed >= self.length

    @property
    def failed(self) -> bool:
        return self.rejected >= 0

    def error(self) -> str:
        return f"token {self.rejected} is not the forced token" if self.failed else ""

    def forced(self, index: int) -> tuple[int, ...] | None:
        """The candidates for output token `index` when the device can force it (engine/step.py `resample`), else None
        (an end among more than FORCED_SET stop tokens: a host mask, `fill`)."""
        if index < len(self.tokens):
            return (self.tokens[index],)
        return tuple(self.stop_ids) if len(self.stop_ids) <= FORCED_SET else None

    def fill(self, mask: np.ndarray, row: int) -> None:
        """mask[row] = the allowed set as a bitmask (bit v % 32 of word v // 32)."""
        mask[row] = 0
        allowed = [self.tokens[self.consumed]] if self.consumed < len(self.tokens) else self.stop_ids
        for t in allowed:
            bit = 1 << (t & 31)
            mask[row, t >> 5] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words

    def advance(self, token: int) -> bool:
        ok = (token == self.tokens[self.consumed] if self.consumed < len(self.tokens)
              else token in self.stop_ids and self.consumed < self.length)
        if ok:
            self.consumed += 1
        else:
            self.rejected = token
        return ok


class ChoiceGroup:
    """One `choice` request: its branches and, once they are done, the decision (see the module docstring)."""

    def __init__(self, parent: Sequence, options: list[list[int]], stop_ids: tuple[int, ...], page_size: int,
                 new_id, max_model_len: int):
        self.parent = parent
        self.options = options
        p = parent.params
        # Full pages of the prompt that branches share: at least one prompt token stays to be prefilled by each branch
        # (its last logits score the option's first token).
        shared = page_size * ((len(parent.prompt_ids) - 1) // page_size)
        self.branches: list[Sequence] = []
        for tokens in options:
            forced = ForcedTokens(tokens, stop_ids)
            params = SamplingParams(max_tokens=forced.length, temperature=0.0, ignore_eos=True,
                                    logprobs=p.logprobs or 0)
            b = Sequence(new_id(), parent.prompt_ids, params, tokenizer=None, eos_token_ids=(),
                         max_model_len=max_model_len, seed=parent.seed)
            b.constraint = forced
            b.choice_group = self
            if self.branches and shared:
                b.share_from = (self.branches[0], shared)
            self.branches.append(b)

    @property
    def decided(self) -> bool:
        return all(b.finalized for b in self.branches)

    @property
    def released(self) -> bool:
        return all(b.status == "released" for b in self.branches)

    def scores(self) -> list[float]:
        """Each option's total log-probability (its tokens, then its end)."""
        return [sum(lp for _, lp, _ in b.logprobs) for b in self.branches]

    def finish(self) -> tuple[Delta, list | None]:
        """Finalize the parent with the chosen option (every branch must be finalized): (delta, logprobs)."""
        parent = self.parent
        # the branch that failed first (an error; the others were aborted because of it), else an aborted one
        failed = next((b for b in self.branches if b.finish_reason == "error"), None) or next(
            (b for b in self.branches if b.finish_reason not in ("stop", "length")), None)
        if failed is not None:
            return parent.finish(failed.finish_reason, failed.error), None
        scores = self.scores()
        index = pick(scores, parent.params.temperature, parent.seed)
        branch, tokens = self.branches[index], self.options[index]
        logprobs = branch.logprobs[:len(tokens)] if parent.params.logprobs is not None else None
        parent.choice_index, parent.choice_scores = index, scores
        text = parent.params.choice[index] if parent.text is not None else None
        return parent.finish_with(tokens, text, logprobs), logprobs


def pick(scores: list[float], temperature: float, seed: int) -> int:
    """Greedy: the best option (the first of equals). Sampling: an option drawn with probability softmax(scores /
    temperature), from the request's seed (same seed, same pick)."""
    if temperature == 0:
        return max(range(len(scores)), key=lambda i: (scores[i], -i))
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    u = random.Random(seed).random() * sum(weights)
    for i, w in enumerate(weights):
        u -= w
        if u < 0:
            return i
    return len(scores) - 1

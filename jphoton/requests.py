"""Request building: what a caller submits becomes Sequences the engine can run, or a ValueError that names the problem,
before anything is queued. Plain Python (no jax); safe from any thread (ids and seeds under a lock).

Owns the prompt checks (a text's size before any tokenizing, tokenized only as far as the context holds, ids inside
the vocabulary), the sampling checks (EngineConfig.limits, logprobs, stop ids, adapter names), the constraint compile,
a choice's options, whether it can fit the KV pool at all (the one check of it: the engine takes requests built here),
request ids and seeds. The engine config is read at each submission (it may be replaced).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from jphoton.params import (
    SamplingParams,
    check_choice_tokens,
    check_limits,
    short,
    text_bytes,
    text_size_error,
)
from jphoton.sequence import Sequence


class RequestBuilder:
    def __init__(self, model_config, tokenizer, model_name: str, max_model_len: int, grammar, pages, loras,
                 engine_config: Callable[[], Any], seed: int):
        self.config = model_config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.grammar = grammar
        self.pages, self.loras = pages, loras
        self._engine_config = engine_config
        self.eos_token_ids = eos_token_ids(model_config, tokenizer)
        self._lock = threading.RLock()  # (sequences() takes ids under it)
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0
        self._bytes_per_token: int | None = None

    @property
    def engine_config(self):
        return self._engine_config()

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer: pass prompts as "
                             "{'prompt_token_ids': [...]} (text output is unavailable too)")
        return self.tokenizer

    def check_prompt_size(self, num_bytes: int, rendered: bool = False) -> None:
        """Refuse text that is over the byte limit, or that cannot fit the context whatever it tokenizes to, before
        any tokenizing (a 15 MB prompt would hold a thread for ~20 s to learn it has 4 million tokens)."""
        error = text_size_error(num_bytes, **self.text_limits(), rendered=rendered)
        if error:
            raise ValueError(error)

    def text_limits(self) -> dict:
        """What `text_size_error` (jphoton/params.py) needs to refuse an oversized text prompt without this LLM (the
        gRPC server checks before it forwards a prompt to the engine process)."""
        return {"max_prompt_bytes": self.engine_config.limits.max_prompt_bytes,
                "bytes_per_token": self.max_bytes_per_token() if self.tokenizer is not None else 2**62,
                "max_model_len": self.max_model_len}

    def max_bytes_per_token(self) -> int:
        """Most UTF-8 bytes of input text one token can stand for (Tokenizer.max_input_bytes_per_token: the longest
        vocabulary entry in input bytes, times 4 if the tokenizer normalizes text)."""
        if self._bytes_per_token is None:
            tok = self.require_tokenizer()
            # A tokenizer without the method (a user's own): no bound, only the byte limit applies.
            if hasattr(tok, "max_input_bytes_per_token"):
                self._bytes_per_token = tok.max_input_bytes_per_token()
            else:
                self._bytes_per_token = 4 * tok.max_token_bytes() if hasattr(tok, "max_token_bytes") else 2**62
        return self._bytes_per_token

    def encode_within(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; ValueError for a text that cannot fit the context, found from a part of it when the
        text is long (Tokenizer.encode_within: a 2 MB prompt is refused in ~0.1 s, not tokenized whole in ~2 s)."""
        tok = self.require_tokenizer()
        if not hasattr(tok, "encode_within"):  # a user's own tokenizer
            return tok.encode(text, add_special_tokens=add_special_tokens)
        ids = tok.encode_within(text, self.max_model_len, add_special_tokens)
        if isinstance(ids, int):
            raise ValueError(f"prompt has at least {ids} tokens; the context holds {self.max_model_len}")
        return ids

    def prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("empty prompt" if not prompt else "empty prompt (only whitespace)")
            self.check_prompt_size(text_bytes(prompt))
            ids = self.encode_within(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt_token_ids"}
            if unknown or "prompt_token_ids" not in prompt:
                raise ValueError(f"a dict prompt must be {{'prompt_token_ids': [...]}}, got keys {sorted(prompt)}")
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, np.ndarray):
                ids = ids.tolist()
            if type(ids) is list and all(type(t) is int for t in ids):  # (the usual case, ~10x faster: served
                ids = list(ids)  # prompts are prepared on the engine's thread)
            elif not isinstance(ids, (list, tuple)) or not all(isinstance(t, (int, np.integer))
                                                               and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            else:
                ids = [int(t) for t in ids]
        else:
            raise ValueError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt (no tokens)")
        if len(ids) >= self.max_model_len:  # before the scan below: a 2 MB prompt is half a million ids
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len}")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.config.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def sequences(self, prompt_ids: list[list[int]], params: SamplingParams | Iterable[SamplingParams] | None,
                  request_ids: list[int] | None = None) -> list[Sequence]:
        """One Sequence per prompt (token ids, from `prompt_ids`), each with its SamplingParams (one for all, or one
        each), checked, its constraint compiled, its seed and request id drawn (or the ids given)."""
        if not prompt_ids:
            raise ValueError("no prompts given")
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompt_ids) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompt_ids):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompt_ids)} prompts")
        seqs = []
        for ids, p in zip(prompt_ids, plist, strict=True):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(p).__name__}")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len}")
            if p.max_tokens is not None and len(ids) + p.max_tokens > self.max_model_len and p.choice is None:
                raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds the context "
                                 f"({self.max_model_len}); lower max_tokens or pass max_tokens=None")
            check_limits(p, self.engine_config.limits)
            new_tokens = p.max_tokens or self.max_model_len - len(ids)
            options = None
            if p.choice is not None:  # one sequence per option, each the option and its end (constrain/choice.py)
                options = self.choice_options(p.choice, p.max_tokens, self.max_model_len - len(ids))
                new_tokens = max(map(len, options)) + 1
            need = self.pages.pages_for(len(ids) + new_tokens)
            if need > self.pages.num_pages:
                raise ValueError(f"request needs {need} KV pages but the whole pool holds {self.pages.num_pages}; "
                                 "lower max_tokens or give the engine more KV memory")
            if p.logprobs and p.logprobs > self.engine_config.max_logprobs:
                raise ValueError(f"logprobs={p.logprobs} exceeds this engine's max_logprobs={self.engine_config.max_logprobs}")
            bad = [t for t in p.stop_token_ids if t >= self.config.vocab_size]
            if bad:
                raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
            if p.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
            if p.lora is not None and p.lora not in self.loras:
                raise ValueError(self.loras.unknown(p.lora))
            constraint = self.grammar.compile(p)  # a bad schema/regex/grammar fails here, before anything is queued
            with self._lock:
                seed = p.seed if p.seed is not None else int(self._seed_rng.integers(0, 2**63))
                rid = request_ids[len(seqs)] if request_ids is not None else self.new_request_id()
            seq = Sequence(rid, ids, p, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                           max_model_len=self.max_model_len, seed=seed)
            seq.constraint = constraint
            seq.choice_options = options
            seqs.append(seq)
        return seqs

    def choice_options(self, options: tuple[str, ...], max_tokens: int | None, room: int) -> list[list[int]]:
        """A choice's options as token ids. ValueError for one longer than max_tokens, or that cannot fit the context
        (`room` tokens after the prompt) with its end (scoring the end takes one more position)."""
        tok = self.require_tokenizer()
        encoded = [tok.encode(o, add_special_tokens=False) for o in options]
        for i, ids in enumerate(encoded):
            name = f"choice option {i} ({short(options[i], 40)}) is {len(ids)} tokens"
            if not ids:
                raise ValueError(f"choice option {i} ({short(options[i], 40)}) is no tokens")
            if max_tokens is not None and len(ids) > max_tokens:
                raise ValueError(f"{name}; max_tokens is {max_tokens}")
            if len(ids) + 1 > room:
                raise ValueError(f"{name}; with its end it needs {len(ids) + 1} positions after the prompt and the "
                                 f"context has {room}")
        check_choice_tokens(encoded, self.engine_config.limits)
        return encoded

    def new_request_id(self) -> int:
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            return rid


def eos_token_ids(config, tokenizer) -> tuple[int, ...]:
    """The model's stop tokens: its config's EOS ids and its tokenizer's, those inside the vocabulary."""
    ids = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    # A resized random model may keep its preset's EOS ids past the vocabulary: they can never be sampled.
    return tuple(sorted(i for i in ids if 0 <= i < config.vocab_size))

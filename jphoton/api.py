"""The public Python API: `LLM` validates and tokenizes requests and hands them to a decoder."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jphoton.params import Completion, SamplingParams
from jphoton.reference import ReferenceDecoder
from jphoton.sequence import Delta, Sequence
from jphoton.weights import LoadedModel, load_model

log = logging.getLogger("jphoton")

Prompt = str | dict  # "text" or {"prompt_token_ids": [...]}
Message = dict  # {"role": ..., "content": ...}


class LLM:
    """Load a model and generate from it.

    model: a HF directory, a .gguf file, a jphoton store (from `jphoton convert`), `random:NAME[:layers=N]`, or None
    for the embedded SmolLM2-135M-Instruct. dtype: None = float32 on CPU, bfloat16 on GPU.
    """

    def __init__(self, model: str | None = None, *, dtype=None, max_model_len: int | None = None, seed: int = 0,
                 cache_converted: bool | None = None, progress: bool = False):
        self.model: LoadedModel = load_model(model, dtype, cache=cache_converted, progress=progress)
        self.config = self.model.config
        self.tokenizer = self.model.tokenizer
        limit = self.config.max_position_embeddings
        if max_model_len is not None and (not isinstance(max_model_len, int) or not 0 < max_model_len <= limit):
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_model_len!r}")
        self.max_model_len = max_model_len or limit
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0
        self._decoder = ReferenceDecoder(self.config, self.model.params)
        log.info("decoder: reference (dense KV cache, blocking loop)")

    # ---- public -----------------------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[Completion]:
        """Generate for one prompt or a list; returns one Completion per prompt, in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        seqs = self._make_sequences([self._prompt_ids(p) for p in prompts], params)
        self._decoder.run(seqs)
        return [s.completion() for s in seqs]

    def chat(self, conversations: Seq[Message] | Seq[Seq[Message]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Apply the model's chat template to each conversation (a list of messages), then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        tok = self._require_tokenizer()
        ids = [tok.encode_chat(list(conv)) for conv in conversations]
        return self.generate([{"prompt_token_ids": i} for i in ids], params)

    def stream_one(self, prompt: Prompt, params: SamplingParams | None = None,
                   on_delta: Callable[[Delta], None] | None = None) -> Completion:
        """Generate for one prompt, calling `on_delta` as each token is committed (what the CLI prints)."""
        seqs = self._make_sequences([self._prompt_ids(prompt)], params)
        self._decoder.run(seqs, None if on_delta is None else (lambda _s, d: on_delta(d)))
        return seqs[0].completion()

    def encode_chat(self, messages: Seq[Message]) -> list[int]:
        return self._require_tokenizer().encode_chat(list(messages))

    # ---- validation -------------------------------------------------------------------------------------------------
    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.model.source!r} has no tokenizer: pass prompts as "
                             "{'prompt_token_ids': [...]} (text output is unavailable too)")
        return self.tokenizer

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            ids = self._require_tokenizer().encode(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt_token_ids"}
            if unknown or "prompt_token_ids" not in prompt:
                raise ValueError(f"a dict prompt must be {{'prompt_token_ids': [...]}}, got keys {sorted(prompt)}")
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, np.ndarray):
                ids = ids.tolist()
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                             for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _make_sequences(self, prompt_ids: list[list[int]],
                        params: SamplingParams | Iterable[SamplingParams] | None) -> list[Sequence]:
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
            if p.max_tokens is not None and len(ids) + p.max_tokens > self.max_model_len:
                raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds the context "
                                 f"({self.max_model_len}); lower max_tokens or pass max_tokens=None")
            bad = [t for t in p.stop_token_ids if t >= self.config.vocab_size]
            if bad:
                raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
            if p.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
            seed = p.seed if p.seed is not None else int(self._seed_rng.integers(0, 2**63))
            seqs.append(Sequence(self._next_id, ids, p, tokenizer=self.tokenizer, eos_token_ids=self._eos_ids(),
                                 max_model_len=self.max_model_len, seed=seed))
            self._next_id += 1
        return seqs

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

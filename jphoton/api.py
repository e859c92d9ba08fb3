"""The public Python API: `LLM` validates and tokenizes requests and hands them to the engine."""

from __future__ import annotations

import collections
import gc
import logging
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import jax
import numpy as np

from jphoton.constraints import GrammarCompiler
from jphoton.engine import compiles
from jphoton.engine.engine import Engine, Output
from jphoton.engine.scheduler import SchedulerConfig
from jphoton.models.moe import check_backend as check_moe_backend
from jphoton.models.protocol import JaxModel, llama_family
from jphoton.params import Completion, SamplingParams
from jphoton.sequence import Delta, Sequence
from jphoton.weights import load_model
from jphoton.weights.store import cache_dir

log = logging.getLogger("jphoton")

Prompt = str | dict  # "text" or {"prompt_token_ids": [...]}
Message = dict  # {"role": ..., "content": ...}
DEFAULT_MAX_MODEL_LEN = 8192  # a longer context is opt-in (max_model_len=): it widens every block table


class LLM:
    """Load a model and serve it through the paged, continuously batched engine.

    model: a HF directory, a .gguf file, a jphoton store (from `jphoton convert`), `random:NAME[:layers=N]`, None for
    the embedded SmolLM2-135M-Instruct, or a `JaxModel` (your own forward function + params, see models/protocol.py).
    tokenizer: a HF tokenizer directory (or its tokenizer.json) to use instead of the model's own.
    moe_backend: how MoE layers run: "warp_decode" (Pallas kernels), "expert_centric" (grouped GEMM) or "auto" (warp
    decode for steps of at most models.moe.WARP_DECODE_MAX_TOKENS tokens). Ignored by dense models.
    matmul: how dense weight matmuls and the LM head run: "xla" (one-token steps padded to two rows, see
    models/matmul.py), "xla-plain", "pallas" (pallas_kernels/gemv.py for decode-sized steps and matrices below 10M
    elements, XLA otherwise), "fused" ("xla" plus, in decode-sized steps, the GEMV with SwiGLU in its epilogue for
    gate+up and the residual add + RMSNorm kernel after O and down) or "auto" ("fused" on GPU, the fastest step on the
    H100; "xla-plain" on CPU), or a hook object of models/matmul.py. Loaded
    weights are served in the fused layout (one QKV and one gate+up matrix per layer, models/llama.py `fuse_params`).
    attention: "dynamic" (plain-JAX loop over the real context; the CPU default), "static" (plain-JAX gather over a
    context bucket per step), "pallas" (decode rows through the Pallas kernel in pallas_kernels/paged_decode_attention.py,
    whose loop follows each row's length, so decode-only steps have no context bucket; prefill rows as "static";
    interpret mode, slow, on CPU) or "auto" ("pallas" on GPU, "dynamic" on CPU).
    dtype: None = float32 on CPU, bfloat16 on GPU. pipeline_depth: 1 = blocking loop, 2 = pipelined.
    dispatch_thread: make the device calls on a dispatcher thread, in order, while this thread commits, plans and
    builds grammar masks (engine/dispatch.py). Off by default: on the H100 it shortened the 32-stream step period by
    10% and slowed 1 and 8 streams by up to 12% (RESULTS.md).
    freeze_gc: once built, collect and `gc.freeze()` every object alive (the model, JAX's and the importer's modules):
    the cyclic GC's full collections would otherwise scan them all from inside the engine loop. On the H100 host with
    torch and transformers also loaded, one decode tick at B=128 took 726 ms while every other took ~2.4 ms; a full
    collection here costs 80-180 ms with jax alone (RESULTS.md). vLLM freezes its start-up objects for the same reason.
    Without warm-up, a tick that compiles a new shape freezes again after it (the compile's objects would otherwise
    be rescanned: a 98.7 ms full pass inside a B=32 tick on the H100, RESULTS.md).
    Bucket sets fix every step shape up front; all of them are compiled at start-up (`warmup=True`), so serving
    never compiles.
    """

    def __init__(self, model: str | JaxModel | None = None, *, dtype=None, max_model_len: int | None = None,
                 seed: int = 0, pipeline_depth: int = 1, page_size: int = 16, num_kv_pages: int | None = None,
                 kv_memory_fraction: float = 0.85, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 decode_buckets: tuple[int, ...] | None = None,
                 prefill_buckets: tuple[tuple[int, int], ...] | None = None,
                 context_buckets: tuple[int, ...] | None = None, attention: str = "auto",
                 unroll_layers: bool | None = None, max_logprobs: int = 20,
                 cache_converted: bool | None = None, progress: bool = True, warmup: bool = True,
                 tokenizer: str | os.PathLike | None = None, moe_backend: str = "auto", matmul: str = "auto",
                 dispatch_thread: bool = False, freeze_gc: bool = True):
        compiles.install()
        if os.environ.get("JPHOTON_XLA_CACHE", "1") != "0":
            compiles.enable_persistent_cache(str(cache_dir().parent / "xla"))
        accelerator = jax.default_backend() != "cpu"
        if attention == "auto":
            # GPU: decode rows through the Pallas kernel (1.4-3.2x the static gather on the H100, RESULTS.md), prefill
            # rows over static context buckets (an XLA data-dependent loop would sync the host every iteration).
            # CPU: the plain-JAX loop (the kernel would run in interpret mode there: correct, slow).
            attention = "pallas" if accelerator else "dynamic"
        if attention not in ("static", "dynamic", "pallas"):
            raise ValueError(f"attention must be 'auto', 'static', 'dynamic' or 'pallas', got {attention!r}")
        if unroll_layers is None:
            unroll_layers = accelerator
        check_moe_backend(moe_backend)
        if isinstance(model, JaxModel):
            self.model = model
        else:
            loaded = load_model(model, dtype, cache=cache_converted, progress=progress)
            self.model = llama_family(loaded.config, loaded.params, loaded.tokenizer, loaded.source,
                                      unroll_layers=unroll_layers, moe_backend=moe_backend, matmul=matmul, fuse=True)
        self.config = self.model.config
        self.tokenizer = self.model.tokenizer
        if tokenizer is not None:  # e.g. random weights of a real shape with that model's real tokenizer
            self.tokenizer = _load_tokenizer(tokenizer, self.config.vocab_size)
        limit = self.config.max_position_embeddings
        if max_model_len is not None and (not isinstance(max_model_len, int) or not 0 < max_model_len <= limit):
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_model_len!r}")
        self.max_model_len = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0
        pages_per_seq = -(-self.max_model_len // page_size)
        if attention in ("static", "pallas"):  # "pallas": the buckets serve prefill rows only
            context_buckets = tuple(context_buckets or _default_context_buckets(pages_per_seq))
            if context_buckets[-1] < pages_per_seq:
                raise ValueError(f"the largest context bucket ({context_buckets[-1]} pages) must cover max_model_len "
                                 f"({pages_per_seq} pages of {page_size})")
        else:
            context_buckets = ()
        decode_buckets = tuple(decode_buckets or _pow2_buckets(max_num_seqs))
        if self.model.min_decode_rows > 1:  # e.g. one-row steps would pad every matmul (models/matmul.py)
            rounded = tuple(sorted({max(b, self.model.min_decode_rows) for b in decode_buckets}))
            if rounded != decode_buckets:
                log.info("decode buckets %s -> %s: this model's matmuls run decode steps of >= %d rows",
                         decode_buckets, rounded, self.model.min_decode_rows)
            decode_buckets = rounded
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            decode_buckets=decode_buckets,
            prefill_buckets=prefill_buckets or _default_prefill_buckets(max_num_batched_tokens),
            context_buckets=context_buckets, pallas_decode=attention == "pallas")
        self.attention = attention
        if num_kv_pages is None:
            num_kv_pages = _default_num_pages(self.config, self.max_model_len, page_size, max_num_seqs,
                                              kv_memory_fraction, self.model.params)
        self.grammar = GrammarCompiler(self.tokenizer, self.config.vocab_size, self._eos_ids())
        self.engine = Engine(self.model, sched=sched, num_pages=num_kv_pages, page_size=page_size,
                             max_model_len=self.max_model_len, pipeline_depth=pipeline_depth, max_logprobs=max_logprobs,
                             grammar=self.grammar, dispatch_thread=dispatch_thread)
        buckets = f", context buckets {context_buckets} pages" if context_buckets else ""
        if attention == "pallas":
            from pallas_kernels.paged_decode_attention import path_name

            attn_desc = f"{path_name()} for decode rows, plain-JAX paged (static{buckets}) for prefill rows"
        else:
            attn_desc = f"plain-JAX paged ({attention}{buckets})"
        log.info("engine: %d KV pages x %d tokens (%.1f MiB), pipeline depth %d, attention: %s, layers %s, device "
                 "calls %s", num_kv_pages, page_size, self.engine.runner.kv_bytes / 2**20, pipeline_depth, attn_desc,
                 "unrolled" if unroll_layers else "scanned",
                 "on a dispatcher thread" if dispatch_thread else "inline")
        if warmup:
            self.engine.runner.warmup(progress=progress)
        if freeze_gc:
            _freeze_gc()
            self.engine.refreeze_gc = True  # and again after any tick that compiled (warmup=False)
        self._outputs: dict[int, collections.deque[Output]] = {}

    # ---- public -----------------------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[Completion]:
        """Generate for one prompt or a list; returns one Completion per prompt, in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        seqs = self._make_sequences([self._prompt_ids(p) for p in prompts], params)
        for s in seqs:
            self._submit(s)
        try:
            while not all(s.finalized for s in seqs):
                self._tick()
        finally:
            for s in seqs:
                self._close(s)
        return [s.completion() for s in seqs]

    def chat(self, conversations: Seq[Message] | Seq[Seq[Message]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Apply the model's chat template to each conversation (a list of messages), then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        tok = self._require_tokenizer()
        ids = [tok.encode_chat(list(conv)) for conv in conversations]
        return self.generate([{"prompt_token_ids": i} for i in ids], params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[Delta]:
        """Yield deltas (`.text`, `.token_ids`, `.finish_reason` on the last) as tokens are committed. Closing the
        iterator early aborts the request and returns its KV pages."""
        [seq] = self._make_sequences([self._prompt_ids(prompt)], params)
        return self._stream(seq)

    def stream_one(self, prompt: Prompt, params: SamplingParams | None = None,
                   on_delta: Callable[[Delta], None] | None = None) -> Completion:
        """Generate for one prompt, calling `on_delta` as each token is committed (what the CLI prints)."""
        [seq] = self._make_sequences([self._prompt_ids(prompt)], params)
        for delta in self._stream(seq):
            if on_delta is not None:
                on_delta(delta)
        return seq.completion()

    def _stream(self, seq: Sequence) -> Iterator[Delta]:
        self._submit(seq)
        try:
            queue = self._outputs[seq.request_id]
            while True:
                while not queue and not seq.finalized:
                    self._tick()
                while queue:
                    yield queue.popleft().delta
                if seq.finalized:
                    return
        finally:
            self._close(seq)

    def encode_chat(self, messages: Seq[Message]) -> list[int]:
        return self._require_tokenizer().encode_chat(list(messages))

    def stats(self) -> dict:
        """kv_pages_total/free, running, waiting, preemptions, steps, num_compiles (from JAX's compile events)."""
        return {**self.engine.stats(), "num_compiles": compiles.num_compiles()}

    # ---- the engine loop (synchronous: runs in the caller's thread) -------------------------------------------------
    def _submit(self, seq: Sequence) -> None:
        self._outputs[seq.request_id] = collections.deque()
        self.engine.add(seq)

    def _tick(self) -> None:
        for out in self.engine.step():
            queue = self._outputs.get(out.seq.request_id)
            if queue is not None:
                queue.append(out)

    def _close(self, seq: Sequence) -> None:
        """Abort if unfinished, then run the pipeline until no launched step references the sequence (so its pages are
        back before the caller looks at stats)."""
        self.engine.abort(seq.request_id)
        while seq.status != "released" and self.engine.has_work():
            self._tick()
        self._outputs.pop(seq.request_id, None)

    # ---- validation -------------------------------------------------------------------------------------------------
    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.model.name!r} has no tokenizer: pass prompts as "
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
            pool = self.engine.pages
            need = pool.pages_for(len(ids) + (p.max_tokens or self.max_model_len - len(ids)))
            if need > pool.num_pages:
                raise ValueError(f"request needs {need} KV pages but the whole pool holds {pool.num_pages}; "
                                 "lower max_tokens or give the engine more KV memory")
            if p.logprobs and p.logprobs > self.max_logprobs:
                raise ValueError(f"logprobs={p.logprobs} exceeds this engine's max_logprobs={self.max_logprobs}")
            bad = [t for t in p.stop_token_ids if t >= self.config.vocab_size]
            if bad:
                raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
            if p.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
            constraint = self.grammar.compile(p)  # a bad schema/regex/grammar fails here, before anything is queued
            seed = p.seed if p.seed is not None else int(self._seed_rng.integers(0, 2**63))
            seq = Sequence(self._next_id, ids, p, tokenizer=self.tokenizer, eos_token_ids=self._eos_ids(),
                           max_model_len=self.max_model_len, seed=seed)
            seq.constraint = constraint
            seqs.append(seq)
            self._next_id += 1
        return seqs

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        # A resized random model may keep its preset's EOS ids past the vocabulary: they can never be sampled.
        return tuple(sorted(i for i in ids if 0 <= i < self.config.vocab_size))


def _load_tokenizer(path, vocab_size: int):
    from jphoton.tokenizer import Tokenizer

    p = pathlib.Path(path)
    tok = Tokenizer.from_hf_dir(p if p.is_dir() else p.parent) if p.exists() else None
    if tok is None:
        raise ValueError(f"tokenizer={str(path)!r}: no tokenizer.json there")
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {vocab_size}")
    return tok


def _geometric_buckets(start: int, factor: int, last: int) -> tuple[int, ...]:
    """start, start*factor, ... below `last`, then `last` itself."""
    out, b = [], start
    while b < last:
        out.append(b)
        b *= factor
    return (*out, last)


def _freeze_gc() -> None:
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d objects frozen (full collections no longer scan them)", gc.get_freeze_count())


def _pow2_buckets(n: int) -> tuple[int, ...]:
    return _geometric_buckets(1, 2, n)


def _default_prefill_buckets(budget: int) -> tuple[tuple[int, int], ...]:
    shapes = [(1, 32), (1, 128), (4, 128), (1, 512)]
    fit = tuple((r, t) for r, t in shapes if r * t <= budget)
    return fit or ((1, budget),)


def _default_context_buckets(pages_per_seq: int) -> tuple[int, ...]:
    """Powers of four from 512 tokens (32 pages of 16) up to the whole context: few compiles, at most 4x waste."""
    return _geometric_buckets(32, 4, pages_per_seq)


def _default_num_pages(cfg, max_model_len: int, page_size: int, max_num_seqs: int, fraction: float, params) -> int:
    """Enough pages for max_num_seqs full contexts, capped by free device memory (accelerators) or 256 MiB (CPU)."""
    dtype_bytes = jax.tree_util.tree_leaves(params)[0].dtype.itemsize
    page_bytes = 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    wanted = max_num_seqs * -(-max_model_len // page_size)
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "bytes_limit" in stats:
        budget = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * fraction)
    else:
        budget = 256 * 2**20
    return max(1, min(wanted, budget // page_bytes))

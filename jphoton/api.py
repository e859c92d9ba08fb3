"""The public Python API: `LLM`, the facade over the request builder (jphoton/requests.py), the engine and its loop
(engine/driver.py): generate, chat, stream, step by step, LoRA adapters, stats."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import jax

from jphoton.constrain.compiler import GrammarCompiler
from jphoton.engine import compile_worker, compiles
from jphoton.engine import warmup as warmup_lib
from jphoton.engine.config import EngineConfig, default_prefill
from jphoton.engine.driver import Driver
from jphoton.engine.loras import NoFreeLoraSlot
from jphoton.engine.pipeline import Engine
from jphoton.engine.runner import default_num_pages
from jphoton.engine.telemetry import Telemetry
from jphoton.engine.warmup import Warmup
from jphoton.image import skills as skill_prep
from jphoton.image import spatial
from jphoton.models.moe import check_backend as check_moe_backend
from jphoton.models.protocol import JaxModel, llama_family, moondream_family
from jphoton.models.tensor_parallel import make_mesh
from jphoton.params import (
    Completion,
    SamplingParams,
    SpatialParams,
    short,
    text_bytes,
    utf8_len,
)
from jphoton.requests import RequestBuilder, eos_token_ids
from jphoton.sequence import Delta, RequestOutput, Sequence
from jphoton.weights import load_model
from jphoton.weights import moondream as moondream_weights
from jphoton.weights.peft import load_peft_adapter
from jphoton.weights.store import cache_dir

log = logging.getLogger("jphoton")

Prompt = str | dict  # "text" or {"prompt_token_ids": [...]}
SKILL_DEFAULTS = skill_prep.DEFAULTS  # Moondream's reference settings
MAX_OBJECTS_LIMIT = 1000  # a point / detect request's max_objects at most (3 positions an object)
Message = dict  # {"role": ..., "content": ...}


class Stream:
    """What `LLM.stream` returns: an iterator of Deltas, and a context manager whose exit (like `close()`) aborts the
    request if it has not finished."""

    def __init__(self, deltas: Iterator[Delta], request_id: int):
        self._deltas = deltas
        self.request_id = request_id  # (for `LLM.abort`)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Delta:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()  # the generator's `finally` aborts and waits for the pages (LLM._stream)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LLM:
    """Load a model and serve it through the paged, continuously batched, pipelined engine.

    model: a HF directory, a .gguf file, a jphoton store (`jphoton convert`), `random:NAME[:layers=N]`, None for the
    embedded SmolLM2-135M-Instruct, or a `JaxModel` (your own forward function + params, models/protocol.py).
    tokenizer: a HF tokenizer directory (or its tokenizer.json) to use instead of the model's own.
    config: an `EngineConfig`; keyword options (`max_num_seqs=`, `pipeline_depth=`, `attention=`, ...: every field of
    EngineConfig and of its groups, see `EngineConfig.option_names()`) are applied on top of it. The defaults are the
    fast path for the device: pipelined decoding, Pallas kernels on GPU, the first request's step shapes compiled
    before this returns and the rest in the background (`stats()["all_shapes_ready"]`, `wait_until_ready()`).
    """

    def __init__(self, model: str | os.PathLike | JaxModel | None = None, *, config: EngineConfig | None = None,
                 tokenizer: str | os.PathLike | None = None, **options):
        cfg = EngineConfig.from_kwargs(config, **options).resolve_kernels(jax.default_backend())
        check_moe_backend(cfg.kernels.moe_backend)
        compiles.install()
        if os.environ.get("JPHOTON_XLA_CACHE", "1") != "0":
            compiles.enable_persistent_cache(str(cache_dir().parent / "xla"))
        tp = cfg.tensor_parallel_size
        if isinstance(model, JaxModel):
            if (model.tensor_parallel[0].size if model.tensor_parallel else 1) != tp:
                raise ValueError(f"tensor_parallel_size={tp}: build the JaxModel with llama_family(..., "
                                 f"tensor_parallel_size={tp}) (a model's forward must be written per shard)")
            self.model = model
        elif moondream_weights.is_source(model):  # an image model (models/moondream.py)
            mcfg, params, tok, name = moondream_weights.load(model, cfg.dtype)
            self.model = moondream_family(mcfg, params, tok, name, matmul=cfg.kernels.matmul,
                                          unroll_layers=cfg.kernels.unroll_layers,
                                          vision_attention="auto" if cfg.kernels.attention in ("auto", "pallas")
                                          else "xla", moe_backend=cfg.kernels.moe_backend)
            del params  # (the serving layout's copies replace the loaded arrays: free them now)
        else:
            k = cfg.kernels
            # random weights are made in the serving layout, on their shards (a model larger than one device)
            loaded = load_model(model, cfg.dtype, cache=cfg.cache_converted, progress=cfg.progress,
                                mesh=make_mesh(tp) if tp > 1 else None, serving_layout=True,
                                per_layer=k.unroll_layers)
            self.model = llama_family(loaded.config, loaded.params, loaded.tokenizer, loaded.source,
                                      unroll_layers=k.unroll_layers, moe_backend=k.moe_backend, matmul=k.matmul,
                                      fuse=True, tensor_parallel_size=tp)
        if self.model.vision is not None:
            cfg = _room_for_images(cfg, self.model.vision.prefix_len, options)
        use_worker = compile_worker.wanted(cfg, self.model)
        self.config = self.model.config  # the model's config (ModelConfig); the engine's is `engine_config`
        self.tokenizer = self.model.tokenizer
        if tokenizer is not None:  # e.g. random weights of a real shape with that model's real tokenizer
            self.tokenizer = _load_tokenizer(tokenizer, self.config.vocab_size)
        cfg = cfg.resolve_shapes(self.config.max_position_embeddings, self.model.min_decode_rows)
        if cfg.num_kv_pages is None:
            cfg = dataclasses.replace(cfg, num_kv_pages=default_num_pages(self.config, cfg, self.model.params))
        self.engine_config: EngineConfig = cfg
        self.max_model_len = cfg.max_model_len
        self._lock = threading.RLock()  # (the count of callers ticking)
        # The engine state (scheduler, slots, output queues) is touched under _engine_lock only. Several threads may call
        # generate/stream at once: each ticks the engine in turn (their requests share the batches) and every output
        # goes to its own request's queue, whoever ticked. While an AsyncLLM drives this LLM, its thread alone ticks;
        # other callers add their requests under the lock and wait for its ticks (_stepped).
        self._engine_lock = threading.RLock()
        self._stepped = threading.Condition(self._engine_lock)
        self._driving_thread: int | None = None  # the thread that owns the loop while an AsyncLLM drives this LLM
        self._wake_driver: Callable[[], None] | None = None  # its wake-up, called when a request is added
        self._callers = 0  # threads inside _run_until (generate/stream/close) right now
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer)
        self.grammar = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        self.engine = Engine(self.model, cfg, cfg.num_kv_pages, self.grammar)
        # validation, tokenizing, constraint compiles, ids and seeds (jphoton/requests.py), under this LLM's config
        self.requests = RequestBuilder(self.config, self.tokenizer, self.model.name, self.max_model_len, self.grammar,
                                       self.engine.pages, self.engine.loras, lambda: self.engine_config, cfg.seed)
        self.driver = Driver(self)  # the engine loop (engine/driver.py): `step` is one of its ticks
        log.info("engine: %s", _describe(cfg, self.engine.runner.kv_bytes))
        self.warmup = Warmup(self.engine.runner, self.engine.scheduler, cfg.warmup, cfg.progress,
                             worker=cfg if use_worker else None)
        self.warmup.start()
        self.engine.compiling_in_background = lambda: self.warmup.running
        self.run_programs_once()  # the first shapes (every one with warmup="full")
        if cfg.freeze_gc:
            _freeze_gc()
            self.engine.refreeze_gc = True  # and again after any tick that compiled (warmup=False)
        self._outputs: dict[int, collections.deque[RequestOutput]] = {}

    # ---- one call, many prompts --------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[Completion]:
        """Generate for one prompt or a list; returns one Completion per prompt, in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run_all(self.requests.sequences([self.requests.prompt_ids(p) for p in prompts], params))

    def chat(self, conversations: Seq[Message] | Seq[Seq[Message]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Apply the model's chat template to each conversation (a list of messages), then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.encode_chat(conv) for conv in conversations]
        return self.generate([{"prompt_token_ids": i} for i in ids], params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Stream:
        """Deltas (`.text`, `.token_ids`, `.finish_reason` on the last) as tokens are committed. Use it in a `with`
        block (or call `.close()`): leaving the block early aborts the request and returns its KV pages. A stream you
        stop reading but still hold keeps its request (and pages) until it is closed or garbage-collected."""
        [seq] = self.requests.sequences([self.requests.prompt_ids(prompt)], params)
        return Stream(self._stream(seq), seq.request_id)

    def stream_one(self, prompt: Prompt, params: SamplingParams | None = None,
                   on_delta: Callable[[Delta], None] | None = None) -> Completion:
        """Generate for one prompt, calling `on_delta` as each token is committed (what the CLI prints)."""
        [seq] = self.requests.sequences([self.requests.prompt_ids(prompt)], params)
        for delta in self._stream(seq):
            if on_delta is not None:
                on_delta(delta)
        return seq.completion()

    def encode_chat(self, messages: Seq[Message]) -> list[int]:
        """The chat template applied to `messages` ({"role", "content"} dicts), as token ids. Raises ValueError for no
        messages or a blank last message (an empty prompt, as for text)."""
        messages = list(messages)
        if not messages:
            raise ValueError("empty chat: no messages")
        bad = [m for m in messages if not isinstance(m, dict) or not isinstance(m.get("content"), str)]
        if bad:
            raise ValueError(f"a chat message is a dict with a string 'content', got {short(bad[0])}")
        if not messages[-1]["content"].strip():
            raise ValueError("empty prompt: the last chat message is blank")
        self.requests.check_prompt_size(sum(text_bytes(m["content"]) for m in messages))
        tok = self.requests.require_tokenizer()
        text = tok.apply_chat_template(messages)
        self.requests.check_prompt_size(utf8_len(text), rendered=True)
        return self.requests.encode_within(text, add_special_tokens=False)  # (the template writes BOS where the model wants)

    # ---- image skills (a model with an image encoder: Moondream) --------------------------------------------------
    def query(self, image, question: str | Seq[str], params: SamplingParams | Seq[SamplingParams] | None = None, *,
              stream: bool = False):
        """Answer a question about an image (encoded bytes, a PIL image, an HxWx3 uint8 array; None: a text-only
        query). Lists (of images, of questions, or both of one length) ask several at once and return a list of
        Completions; stream=True (one request) returns a `Stream`. params default to the reference's (temperature
        0.5, top_p 0.3, max_tokens 768)."""
        return self._skill("query", image, question, params, stream)

    def caption(self, image, length: str = "normal", params: SamplingParams | Seq[SamplingParams] | None = None, *,
                stream: bool = False):
        """Describe an image: length "short", "normal" or "long". A list of images returns a list (as `query`)."""
        return self._skill("caption", image, length, params, stream)

    def point(self, image, obj: str | Seq[str], max_objects: int = spatial.DEFAULT_MAX_OBJECTS):
        """Where `obj` is in the image: a list of (x, y), normalized to [0, 1] (the reference's greedy point skill:
        at most max_objects). Lists (of images, of objects, or both of one length) return a list of such lists."""
        return self._spatial_skill("point", image, obj, max_objects)

    def detect(self, image, obj: str | Seq[str], max_objects: int = spatial.DEFAULT_MAX_OBJECTS):
        """Boxes around `obj` in the image: a list of (x_min, y_min, x_max, y_max), normalized to [0, 1] (the
        reference's greedy detect skill: at most max_objects). Lists as in `point`."""
        return self._spatial_skill("detect", image, obj, max_objects)

    def _spatial_skill(self, skill: str, image, obj, max_objects: int):
        many = isinstance(image, list) or isinstance(obj, list)
        completions = self._skill(skill, image, obj, SpatialParams(max_objects), False)
        answers = [self.spatial_answer(c) for c in (completions if many else [completions])]
        return answers if many else answers[0]

    def spatial_answer(self, completion: Completion) -> list[tuple[float, ...]]:
        """A point / detect Completion's objects, normalized to [0, 1] (ValueError if the request failed)."""
        if completion.finish_reason == "error":
            raise ValueError(completion.error)
        r = self.model.vision.region_bins
        return spatial.normalize(completion.objects or [], *r)

    def prepare_skill(self, skill: str, image, text: str, params: SamplingParams | None = None, *,
                      request_id: int | None = None) -> Sequence:
        """A query (text = the question), caption (text = the length), point or detect (text = the object; params:
        `SpatialParams(max_objects)`) request, validated, its image decoded and cropped (this thread does the work:
        call it off the engine's), not queued (`add_request` queues it)."""
        if skill not in ("query", "caption", "point", "detect"):
            raise ValueError(f"unknown skill {skill!r}; expected 'query', 'caption', 'point' or 'detect'")
        answer = None
        if skill in ("point", "detect"):
            if self.model.spatial is None:
                raise ValueError(f"{skill}: model {self.model.name!r} has no spatial skills (a Moondream checkpoint does)")
            limit = params.max_objects if isinstance(params, SpatialParams) else spatial.DEFAULT_MAX_OBJECTS
            if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_OBJECTS_LIMIT:
                raise ValueError(f"{skill}: max_objects must be an integer in [1, {MAX_OBJECTS_LIMIT}], got {limit!r}")
            if not isinstance(text, str):
                raise ValueError(f"{skill}: the object must be a string, got {type(text).__name__}")
            self.requests.check_prompt_size(text_bytes(text))
            answer = spatial.SpatialAnswer(skill, limit)
            params = SamplingParams(max_tokens=answer.steps_needed(), temperature=0.0)
        elif isinstance(params, SpatialParams):
            raise ValueError(f"{skill}: SpatialParams are for point / detect")
        vision = self.model.vision
        if vision is None:
            raise ValueError(f"{skill}: model {self.model.name!r} takes no images (a Moondream checkpoint does)")
        limits = self.engine_config.limits
        prepared = None if image is None else skill_prep.prepare(image, vision, limits.max_image_pixels,
                                                                 limits.max_image_bytes)
        if skill == "query":
            if not isinstance(text, str):
                raise ValueError(f"query: the question must be a string, got {type(text).__name__}")
            self.requests.check_prompt_size(text_bytes(text))
        ids, run = skill_prep.skill_prompt(skill, self.requests.encode_within, vision.embed_rows,
                                           with_image=prepared is not None, question=text, length=text, obj=text,
                                           answer_suffixes=vision.answer_suffixes)
        if answer is not None and len(ids) + answer.steps_needed() > self.requests.max_model_len:
            raise ValueError(f"{skill}: max_objects={answer.max_objects} needs {answer.steps_needed()} positions "
                             f"after the {len(ids)}-token prompt; the context holds {self.requests.max_model_len}")
        [seq] = self.requests.sequences([ids], params if params is not None else SKILL_DEFAULTS,
                                        None if request_id is None else [request_id])
        seq.image, seq.image_run = prepared, run
        if answer is not None:
            seq.spatial, seq.spatial_mode = answer, answer.mode
        return seq

    def _skill(self, skill: str, image, text, params, stream: bool):
        many = isinstance(image, list) or isinstance(text, list)
        if not many:
            seq = self.prepare_skill(skill, image, text, params)
            if stream:
                return Stream(self._stream(seq), seq.request_id)
            return self._run_all([seq])[0]
        if stream:
            raise ValueError(f"{skill}: stream=True takes one request (got lists)")
        n = len(image) if isinstance(image, list) else len(text)
        images = image if isinstance(image, list) else [image] * n
        texts = text if isinstance(text, list) else [text] * n
        if len(images) != len(texts):
            raise ValueError(f"{skill}: {len(images)} images for {len(texts)} texts")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
        if len(plist) != n:
            raise ValueError(f"{len(plist)} SamplingParams for {n} requests")
        return self._run_all([self.prepare_skill(skill, i, t, p) for i, t, p in zip(images, texts, plist, strict=True)])

    def _run_all(self, seqs: list[Sequence]) -> list[Completion]:
        for s in seqs:
            self._submit(s)
        try:
            self._run_until(lambda: all(s.finalized for s in seqs))
        finally:
            for s in seqs:
                self._close(s)
        return [s.completion() for s in seqs]

    # ---- step by step (what AsyncLLM, the server and the benchmarks drive) ----------------------------------------
    def prepare_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                        request_id: int | None = None) -> Sequence:
        """Validate and tokenize a request without queueing it (safe from any thread); `add_request` queues it.
        Raises ValueError on bad input. request_id: one taken with `new_request_id()` (default: a new one)."""
        ids = self.requests.prompt_ids(prompt)
        [seq] = self.requests.sequences([ids], params, None if request_id is None else [request_id])
        return seq

    def new_request_id(self) -> int:
        """A request id, unique for this LLM (for a request prepared later: `prepare_request(request_id=...)`)."""
        return self.requests.new_request_id()

    def add_request(self, prompt: Prompt | Sequence, params: SamplingParams | None = None) -> int:
        """Queue a request (a prompt, or what `prepare_request` returned) and return its id; `step` runs it."""
        seq = prompt if isinstance(prompt, Sequence) else self.prepare_request(prompt, params)
        with self._engine_lock:
            self.engine.add(seq)
        self._wake()
        return seq.request_id

    def step(self) -> list[RequestOutput]:
        """One engine tick: launch the next step, commit the one before, finalize grammar sampling. Returns what each
        request got (its last output has `finished` set). Outputs of `generate`/`stream` requests go to them too."""
        self._check_driver()
        with self._stepped:
            outputs = self.driver.tick()
            self._stepped.notify_all()
        return outputs

    def route(self, out: RequestOutput) -> None:
        """A tick's output to its `generate`/`stream` caller's queue, if it has one (Driver.tick calls it)."""
        queue = self._outputs.get(out.request_id)
        if queue is not None:
            queue.append(out)

    @contextlib.contextmanager
    def driving(self, deliver, reject, answer=None, wake=None):
        """Drive the engine loop from this thread for the block (AsyncLLM's engine thread, the server's engine
        process): only it may `step`; `generate`/`stream` from other threads add their requests and wait for its
        ticks. The callbacks are `Driver.attach`'s; yields the driver."""
        if self._driving_thread is not None:
            raise RuntimeError("this LLM is driven by another thread already (an AsyncLLM or a server)")
        self._driving_thread, self._wake_driver = threading.get_ident(), wake
        self.driver.attach(deliver, reject, answer, wake)
        try:
            yield self.driver
        finally:
            self._driving_thread = self._wake_driver = None
            self.driver.attach(lambda key, out: None, lambda key, message: None)

    def abort(self, request_id: int) -> RequestOutput | None:
        """End a request now (finish_reason "abort"); its KV pages come back once no launched step references it.
        Returns its last output, or None if it is unknown or already finished. A `generate`/`stream` request's pages
        (and its record) are back when this returns, unless other callers' requests are stepped by hand (`step`) or
        by an AsyncLLM, whose ticks then do it; a stream of it ends with this output."""
        with self._engine_lock:
            out = self.engine.abort(request_id)
            queue = self._outputs.pop(request_id, None)  # (its stream holds the deque: nothing more comes to it)
            if out is None or queue is None:
                return out
            queue.append(out)
            seq = self.engine.sequences.get(request_id)
            # Land its in-flight steps now, if this thread may tick and every live request's outputs have a reader
            # (a tick here would take the outputs of a request stepped by hand): else nobody might tick again.
            drain = (seq is not None and self._driving_thread is None
                     and all(rid < 0 or rid in self._outputs for rid in self.engine.sequences if rid != request_id))
        if drain:
            self._run_until(lambda: seq.status == "released" or not self.engine.has_work())
        return out

    def has_unfinished_requests(self) -> bool:
        """Anything queued, running, or still in flight on the device."""
        return self.engine.has_work()

    @property
    def telemetry(self) -> Telemetry:
        """Host timestamps of every committed step (plan, launch, commit, finalize), engine/telemetry.py."""
        return self.engine.telemetry

    def stats(self) -> dict:
        """kv_pages_total/free/evictable (idle: free + evictable == total), prefix_hit_tokens / prefix_query_tokens,
        running, waiting, preemptions, steps, num_compiles (from JAX's compile events), and the warm-up's
        shapes_compiled / shapes_total / all_shapes_ready."""
        return {**self.engine.stats(), "num_compiles": compiles.num_compiles(), **self.warmup.stats()}

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (e.g. after changing weights in place); returns the KV pages freed.
        Pages that running requests use stay theirs."""
        with self._engine_lock:
            return self.engine.reset_prefix_cache()

    # ---- LoRA adapters (engine/loras.py, models/lora.py) -------------------------------------------------------------
    def load_lora(self, name: str, path: str | os.PathLike, *, timeout: float | None = 60.0,
                  allowed_dirs: Seq[str | os.PathLike] | None = None) -> dict:
        """Serve the HF PEFT LoRA adapter in `path` (adapter_config.json + adapter_model.safetensors) as `name`, for
        requests with `SamplingParams(lora=name)`. Loading a name again replaces it: requests already running finish
        on the old weights. Needs `LLM(max_loras=N)`; compiles nothing. If every slot is taken and one is draining (an
        unloaded adapter still used by running requests), waits up to `timeout` seconds for it (the engine keeps
        serving); raises NoFreeLoraSlot otherwise, ValueError for an adapter that does not fit. Returns its entry in
        `list_loras()`. allowed_dirs: as for `read_lora`."""
        adapter = self.read_lora(path, allowed_dirs=allowed_dirs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.install_lora(name, adapter)
            except NoFreeLoraSlot as e:
                if not e.draining or (deadline is not None and time.monotonic() > deadline):
                    raise
            # a slot frees when its requests are released: run the engine meanwhile (or wait for its driver)
            self._run_until(lambda: not self.engine.has_work() or any(s.free for s in self.engine.loras.slots))

    def read_lora(self, path: str | os.PathLike, *, allowed_dirs: Seq[str | os.PathLike] | None = None):
        """Read and check a PEFT adapter for this model (no engine state touched; safe from any thread). ValueError
        names what does not fit (weights that are not finite in the engine's dtype included); LoRA must be on
        (`max_loras`). allowed_dirs: open no file outside these directories (symlinks resolved; a relative path is
        taken under the first), with one message for any path that is not an adapter there (what the server's
        `--lora-dir` uses, weights/peft.py)."""
        if not self.engine.loras.slots:
            raise ValueError("LoRA is off for this engine: create it with LLM(..., max_loras=N)")
        dtype = jax.tree_util.tree_leaves(self.engine.runner.lora_weights)[0].dtype  # (the params' dtype)
        return load_peft_adapter(path, self.config, self.engine_config.max_lora_rank, allowed_dirs=allowed_dirs,
                                 max_abs=float(jax.numpy.finfo(dtype).max))

    def install_lora(self, name: str, adapter) -> dict:
        """Put an adapter from `read_lora` into a free slot as `name`, now (never waits): NoFreeLoraSlot if none is
        free. Returns its entry in `list_loras()`."""
        if not isinstance(name, str) or not 0 < len(name) <= 128 or not name.isprintable():  # (ListLoras echoes it)
            raise ValueError(f"a LoRA adapter name is 1 to 128 printable characters, got {short(name)}")
        with self._engine_lock:
            self.engine.load_lora(name, adapter)
            return next(e for e in self.engine.loras.listing() if e["name"] == name)

    def unload_lora(self, name: str) -> bool:
        """Stop serving adapter `name`: new requests naming it are refused at once; requests already running finish on
        it and its slot is reused after them. False if no adapter of that name is loaded."""
        with self._engine_lock:
            return self.engine.unload_lora(name)

    def text_limits(self) -> dict:
        """What `text_size_error` (jphoton/params.py) needs to refuse an oversized text prompt without this LLM (the
        gRPC server checks before it forwards a prompt to the engine process)."""
        return self.requests.text_limits()

    def list_loras(self) -> list[dict]:
        """The loaded adapters: name, slot, rank, source (path) and running (requests using it now)."""
        with self._engine_lock:
            return self.engine.loras.listing()

    def wait_until_ready(self, timeout: float | None = None) -> bool:
        """Block until every step shape is compiled (warmup="background" compiles them while serving), then, if no
        request is running, run each program once (`run_programs_once`); True once they are, False if `timeout`
        seconds pass first. After it, no request compiles anything."""
        if not self.warmup.wait(timeout):
            return False
        self.run_programs_once()
        return True

    def run_programs_once(self, limit: int | None = None) -> int:
        """Run each compiled step program not yet run in this process once, on padding rows, if the engine is idle
        (else nothing); at most `limit` of them. A program's first execution costs far more than later ones (up to
        0.4 s for a 1B decode step on an H100): paid here, not by a request. Not on the CPU backend, where a first run
        costs nothing extra and is real compute (`warmup.FIRST_RUNS_ON_CPU`). Returns how many ran."""
        if jax.process_count() > 1:  # (every process would have to run the same programs at the same time)
            return 0
        if jax.default_backend() == "cpu" and not warmup_lib.FIRST_RUNS_ON_CPU:
            return 0
        with self._engine_lock:
            if self.has_unfinished_requests() or self.engine.has_work():
                return 0
            runner = self.engine.runner
            todo = [k for k in self.warmup.ready_programs() if k not in runner.first_ran][:limit]
            t0 = time.perf_counter()
            for key in todo:
                runner.first_run(key)
            if todo and limit is None:
                log.info("ran %d programs once in %.2fs (their first execution costs more than later ones)",
                         len(todo), time.perf_counter() - t0)
            return len(todo)

    def device_step_ms(self, rows: int, *, context: int = 0, steps: int = 30, sampler: str | None = None,
                       lora_rows: int = 0, decode_steps: int = 1) -> float:
        """Milliseconds per decode-only step of `rows` rows dispatched back to back with no host work between: the
        device's own step time, which the pipelined loop should match. Each row attends over `context` tokens (0:
        padding rows); sampler="masked" adds the grammar sampler after each step, "filtered" runs the step's filtered
        variant (top-k / top-p and device automata sample in it); lora_rows: that many rows use LoRA slots 0, 1, ... in
        turn (the step's LoRA variant; needs max_loras); decode_steps: K-step launches (the engine's `decode_steps`),
        per decode step. Needs an idle engine (it overwrites KV pages, so the prefix
        cache is emptied first); compiles the shape if warm-up did not."""
        if sampler not in (None, "masked", "filtered"):
            raise ValueError(f"sampler must be None, 'masked' or 'filtered', got {sampler!r}")
        if self.has_unfinished_requests():
            raise RuntimeError("device_step_ms needs an idle engine: requests are still live")
        self.reset_prefix_cache()  # the timed steps write over pages, cached prefixes' included
        return 1e3 * self.engine.runner.time_decode_steps(rows, context, steps, masked_sampler=sampler == "masked",
                                                          lora_rows=lora_rows, filtered=sampler == "filtered",
                                                          decode_steps=decode_steps)

    # ---- the engine loop for generate/stream (synchronous: runs in the caller's thread) ------------------------------
    def _stream(self, seq: Sequence) -> Iterator[Delta]:
        self._submit(seq)
        try:
            queue = self._outputs[seq.request_id]
            while True:
                self._run_until(lambda: queue or seq.finalized)
                while queue:
                    yield queue.popleft().delta
                if seq.finalized:
                    return
        finally:
            self._close(seq)

    def _check_driver(self) -> None:
        """Only an AsyncLLM's thread steps the LLM while one drives it (a tick elsewhere would take its outputs)."""
        if self._driving_thread not in (None, threading.get_ident()):
            raise RuntimeError("an AsyncLLM (or the server) drives this LLM from its engine thread: call generate/"
                               "stream (they wait for its ticks) or go through the AsyncLLM, not step()")

    def _driven_elsewhere(self) -> bool:
        return self._driving_thread not in (None, threading.get_ident())

    def _submit(self, seq: Sequence) -> None:
        with self._engine_lock:
            self._outputs[seq.request_id] = collections.deque()
            self.engine.add(seq)
        self._wake()

    def _wake(self) -> None:
        wake = self._wake_driver
        if wake is not None:
            wake()

    def _run_until(self, done: Callable[[], Any]) -> None:
        """Tick the engine until done() (checked under the engine lock); while another thread drives the engine (an
        AsyncLLM), wait for its ticks instead. Between ticks the lock is let go so other callers can add requests."""
        with self._lock:
            self._callers += 1
        try:
            while True:
                with self._stepped:
                    if done():
                        return
                    if self._driven_elsewhere():
                        self._stepped.wait(0.05)
                        continue
                    self.step()
                if self._callers > 1:  # let another caller take the lock (Python locks are not fair); alone, never:
                    time.sleep(0)  # a yield per tick cost the blocking loop up to 1.7 ms a step on the H100
        finally:
            with self._lock:
                self._callers -= 1

    def _tick(self) -> None:
        self.step()

    def _close(self, seq: Sequence) -> None:
        """Abort if unfinished, then run the pipeline until no launched step references the sequence (so its pages are
        back before the caller looks at stats)."""
        with self._engine_lock:
            self.engine.abort(seq.request_id)
        self._run_until(lambda: seq.status == "released" or not self.engine.has_work())
        with self._engine_lock:
            self._outputs.pop(seq.request_id, None)

def _room_for_images(cfg: EngineConfig, prefix_len: int, options: dict) -> EngineConfig:
    """An image prefix (BOS + the image's embeddings) is prefilled in one chunk: a step must hold it. For an image
    model the default token budget grows to 1024 and the default prefill buckets gain (1, 768) and (1, 1024) rows;
    a budget or bucket set given too small is refused."""
    if cfg.max_num_batched_tokens <= prefix_len:
        if "max_num_batched_tokens" in options:
            raise ValueError(f"max_num_batched_tokens={cfg.max_num_batched_tokens}: an image prefix of this model is "
                             f"{prefix_len} positions, prefilled in one step (use at least {prefix_len + 1})")
        cfg = dataclasses.replace(cfg, max_num_batched_tokens=1024)
    b = cfg.buckets
    if b.prefill is None:
        big = tuple((1, t) for t in (768, 1024) if prefix_len < t <= cfg.max_num_batched_tokens)
        prefill = tuple(sorted(set(default_prefill(cfg.max_num_batched_tokens) + big), key=lambda rt: rt[0] * rt[1]))
        cfg = dataclasses.replace(cfg, buckets=dataclasses.replace(b, prefill=prefill))
    elif max(t for _, t in b.prefill) <= prefix_len:
        raise ValueError(f"prefill_buckets={b.prefill}: an image prefix of this model is {prefix_len} positions, "
                         f"prefilled in one chunk (a bucket needs at least {prefix_len + 1} tokens a row)")
    log.info("image model: token budget %d, prefill buckets %s", cfg.max_num_batched_tokens, cfg.buckets.prefill)
    return cfg


def _load_tokenizer(path, vocab_size: int):
    from jphoton.text.tokenizer import Tokenizer

    p = pathlib.Path(path)
    tok = Tokenizer.from_hf_dir(p if p.is_dir() else p.parent) if p.exists() else None
    if tok is None:
        raise ValueError(f"tokenizer={str(path)!r}: no tokenizer.json there")
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {vocab_size}")
    return tok


def _freeze_gc() -> None:
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d objects frozen (full collections no longer scan them)", gc.get_freeze_count())


def _describe(cfg: EngineConfig, kv_bytes: int) -> str:
    """The log line that says which paths run."""
    from jphoton.models import matmul

    k, b = cfg.kernels, cfg.buckets
    if k.attention == "pallas":
        from pallas_kernels import paged_decode_attention, paged_prefill_attention

        attention = (f"{paged_decode_attention.path_name()} for decode rows, "
                     f"{paged_prefill_attention.path_name()} for prefill rows")
    else:
        attention = {"static": "plain-JAX static context buckets", "dynamic": "plain-JAX dynamic loop"}[k.attention]
    mm = matmul.resolve(k.matmul) if isinstance(k.matmul, str) else type(k.matmul).__name__
    return (f"{cfg.num_kv_pages} KV pages x {cfg.page_size} tokens ({kv_bytes / 2**20:.1f} MiB), pipeline depth "
            f"{cfg.pipeline_depth}, max_model_len {cfg.max_model_len}, attention: {attention}, matmul {mm}, "
            f"layers {'unrolled' if k.unroll_layers else 'scanned'}, "
            f"{f'tensor parallel over {cfg.tensor_parallel_size} devices, ' if cfg.tensor_parallel_size > 1 else ''}"
            f"buckets: decode {b.decode}, prefill {b.prefill}, "
            f"context {b.context}")

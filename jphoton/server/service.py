"""The jphoton.v1.Engine servicer: proto request -> prompt + SamplingParams, engine outputs -> streamed messages, and
every failure -> the gRPC status a client can act on.

The status codes are the contract (docs/serving.md, "Status codes"; README.md in short): INVALID_ARGUMENT for bad
input of any kind, with nothing queued; ALREADY_EXISTS for a live request_id; RESOURCE_EXHAUSTED for a full queue or
no free LoRA slot; FAILED_PRECONDITION for LoRA off; UNAVAILABLE while loading, stopping or once the engine is gone
(every later call too); ABORTED after the tokens a request produced before it failed mid-flight; INTERNAL for a server
bug, never a user error. All handlers run on the server's event loop, so the bookkeeping below needs no locks.
An image skill's image is decoded and cropped here, on worker threads (a bad one is refused before the engine hears of
it); only its crops go on to the engine (in a child process: through the pipe).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import secrets
import time

import grpc

from jphoton.async_llm import AsyncLLM
from jphoton.engine.driver import PREPARE_THREADS, SkillPrompt
from jphoton.image import skills, spatial
from jphoton.params import SamplingParams, SpatialParams, short
from jphoton.server import jphoton_pb2 as pb
from jphoton.server.engine_loop import request_limits
from jphoton.server.engine_process import LORA_WAIT_S, EngineDied, EngineProcess, LoraError, Rejected, lora_error
from jphoton.server.metrics import Metrics
from jphoton.server.wire import (
    DEFAULT_BOUNDS,
    NOT_PARSED,
    BadRequest,
    RequestBounds,
    decode_generate_request,
    lenient,
    lora_name_error,
    request_id_error,
)

log = logging.getLogger("jphoton.server")

SERVICE_NAME = "jphoton.v1.Engine"
MAX_STATUS_CHARS = 1000  # longest status message sent (an error never echoes a whole request back)
_SCALAR_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")  # proto3 `optional`: unset = the default
_LORA_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "no_slot": grpc.StatusCode.RESOURCE_EXHAUSTED,
               "off": grpc.StatusCode.FAILED_PRECONDITION, "unavailable": grpc.StatusCode.UNAVAILABLE}
MAX_PATH_CHARS = 4096  # LoadLoraRequest.path


class Admission:
    """Bounds the requests the server holds (admitted, not finished), so a burst is refused at once with
    RESOURCE_EXHAUSTED instead of queueing without limit. `capacity` may be changed at run time."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"max_queue must be >= 1, got {capacity}")
        self.capacity = capacity
        self.count = 0

    def try_acquire(self) -> bool:
        if self.count >= self.capacity:
            return False
        self.count += 1
        return True

    def release(self) -> None:
        self.count -= 1


class EngineServicer:
    """lora_dirs: the directories LoadLora may load adapters from (the server's --lora-dir; none: LoadLora refused)."""

    def __init__(self, admission: Admission, metrics: Metrics | None = None, lora_dirs=()):
        self.admission = admission
        self.metrics = metrics
        self.lora_dirs = tuple(str(d) for d in lora_dirs)
        self.llm = None  # the LLM when it runs in this process (AsyncLLM), else None
        self.engine: AsyncLLM | EngineProcess | None = None
        self.bounds = DEFAULT_BOUNDS  # what a GenerateRequest may hold: the engine's (set by attach)
        self.image_limits: dict | None = None  # the engine's image_geometry, max_image_pixels, max_image_bytes (images)
        self._image_pool: concurrent.futures.ThreadPoolExecutor | None = None  # decodes and crops images
        self.failure: str | None = None  # the server's watchdog: why the engine cannot serve now (stalled)
        self.draining = False
        self.calls = 0  # Generate calls admitted (logged per frontend at stop)
        self._live: dict[str, int] = {}  # client request id -> engine request id, while the stream is open

    def attach(self, llm) -> None:
        """Start serving `llm` (an LLM in this process, its loop in AsyncLLM's thread; or a started EngineProcess)."""
        if isinstance(llm, EngineProcess):
            limits = llm.request_limits
            self.engine = llm
        else:
            self.llm = llm
            limits = request_limits(llm)
            self.engine = AsyncLLM(llm)
        self.bounds = RequestBounds.of(limits)
        if limits.get("image_geometry") is not None:
            self.image_limits = {k: limits.get(k) for k in ("image_geometry", "max_image_pixels", "max_image_bytes",
                                                            "region_bins")}

    def engine_failure(self) -> str | None:
        """Why the attached engine cannot serve (its process or thread died, or it stalled), or None."""
        if self.engine is None:
            return None
        return self.failure or getattr(self.engine, "error", None)

    def stats(self, engine_stats: dict | None = None) -> dict | None:
        if self.engine is None:
            return None
        s = engine_stats if engine_stats is not None else self.engine.stats()
        return {**s, "queued": self.admission.count, "max_queue": self.admission.capacity}

    # ---- RPCs ------------------------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        t_arrival = time.perf_counter()
        if isinstance(request, BadRequest):
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        engine = await self._ready(context)
        if request is NOT_PARSED:  # it arrived while the model was loading (not parsed then), and the model is ready
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, "the model was still loading; retry")
        try:
            prompt = self._prompt(request)
            if isinstance(prompt, SkillPrompt) and prompt.skill in spatial.MODES:
                if request.HasField("sampling") or request.lora:
                    raise ValueError(f"skill {prompt.skill!r} decodes greedily: sampling and lora do not apply")
                params = SpatialParams(request.max_objects or spatial.DEFAULT_MAX_OBJECTS)
            else:
                if request.max_objects:
                    raise ValueError("max_objects is for skills 'point' and 'detect'")
                params = sampling_params(request.sampling, request.lora,
                                         skills.DEFAULTS if isinstance(prompt, SkillPrompt) else None)
        except ValueError as e:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or self._new_id()
        if rid in self._live:
            await self._fail(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already live")
        if not self.admission.try_acquire():
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server queue is full ({self.admission.capacity} unfinished requests); retry later")
        try:
            if isinstance(prompt, SkillPrompt) and prompt.image is not None:
                prompt = await self._prepare_image(prompt, context)
                if rid in self._live:  # (taken by another call while this one's image was prepared)
                    await self._fail(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already live")
            try:
                # an engine process keeps the client's id while several frontends share it (Abort via another one)
                named = {"name": rid} if isinstance(engine, EngineProcess) else {}
                engine_id, outputs = engine.submit(prompt, params, **named)
            except ValueError as e:
                await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:  # the engine loop (or process) died (EngineDied)
                await self._fail(context, grpc.StatusCode.UNAVAILABLE, _gone(str(e)))
            self._live[rid] = engine_id
            self.calls += 1
            try:
                spatial_skill = prompt.skill if isinstance(params, SpatialParams) else None
                async for msg in self._stream(engine_id, outputs, rid, t_arrival, context, spatial_skill):
                    yield msg
            finally:
                del self._live[rid]
        finally:
            self.admission.release()

    async def Abort(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        error = request_id_error(request.request_id)
        if error:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        if self.engine is None:
            return pb.AbortResponse(found=False)
        engine = await self._ready(context, draining_ok=True)
        engine_id = self._live.get(request.request_id)
        if engine_id is not None:
            engine.abort(engine_id)  # the stream then ends normally, with finish_reason "abort"
            return pb.AbortResponse(found=True)
        if isinstance(engine, EngineProcess) and engine.frontends > 1:  # a stream on another frontend?
            try:
                return pb.AbortResponse(found=await engine.abort_named(request.request_id))
            except EngineDied as e:
                await _abort(context, grpc.StatusCode.UNAVAILABLE, _gone(str(e)))
        return pb.AbortResponse(found=False)

    async def GetModelInfo(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        engine = await self._ready(context, draining_ok=True)
        return pb.ModelInfo(**engine.info)

    async def GetStats(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        engine = await self._ready(context, draining_ok=True)
        try:
            fresh = await engine.fresh_stats()
        except EngineDied as e:  # it died while we asked: its last numbers are stale
            await _abort(context, grpc.StatusCode.UNAVAILABLE, _gone(str(e)))
        s = self.stats(fresh)
        return pb.Stats(kv_pages_total=s["kv_pages_total"], kv_pages_free=s["kv_pages_free"], running=s["running"],
                        waiting=s["waiting"], num_compiles=s["num_compiles"], queued=s["queued"],
                        max_queue=s["max_queue"], preemptions=s.get("preemptions", 0), steps=s.get("steps", 0),
                        shapes_compiled=s["shapes_compiled"], shapes_total=s["shapes_total"],
                        all_shapes_ready=s["all_shapes_ready"], kv_pages_evictable=s.get("kv_pages_evictable", 0),
                        prefix_hit_tokens=s.get("prefix_hit_tokens", 0),
                        prefix_query_tokens=s.get("prefix_query_tokens", 0),
                        lora_slots_total=s.get("lora_slots_total", 0), lora_slots_loaded=s.get("lora_slots_loaded", 0),
                        lora_slots_draining=s.get("lora_slots_draining", 0),
                        lora_slots_free=s.get("lora_slots_free", 0))

    async def LoadLora(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        if not request.name or not request.path:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "LoadLora needs a name and the path of a HF PEFT adapter directory")
        error = lora_name_error(request.name)
        if error:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        engine = await self._ready(context)
        if not engine.stats().get("lora_slots_total", 0):
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                         "LoRA is off for this server: start it with LoRA slots (jphoton serve --max-loras N)")
        # Adapters only from the operator's directories, and one answer for any other path (existing or not, a file,
        # a directory, a symlink out): a caller learns nothing of the server's file system. The engine checks again,
        # for every file it opens (LLM.read_lora's allowed_dirs).
        if len(request.path) > MAX_PATH_CHARS or not _adapter_dir_allowed(request.path, self.lora_dirs):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, _adapter_path_refused())
        info = await self._lora(context, "load_lora", request.name, request.path, allowed_dirs=list(self.lora_dirs))
        return pb.LoraInfo(**info)

    async def UnloadLora(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        error = lora_name_error(request.name) if request.name else None
        if error:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        return pb.UnloadLoraResponse(found=await self._lora(context, "unload_lora", request.name))

    async def ListLoras(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        loras = await self._lora(context, "list_loras", draining_ok=True)
        return pb.ListLorasResponse(loras=[pb.LoraInfo(**e) for e in loras])

    # ---- helpers ---------------------------------------------------------------------------------------------------
    async def _lora(self, context, method: str, *args, draining_ok: bool = False, **kwargs):
        """LLM.load_lora / unload_lora / list_loras on the engine (in its process, or on a worker thread of this one:
        they may wait for a draining slot), failures as the status codes above."""
        engine = await self._ready(context, draining_ok=draining_ok)
        try:
            if isinstance(engine, EngineProcess):
                return await getattr(engine, method)(*args, **kwargs)
            if method == "load_lora":
                kwargs["timeout"] = LORA_WAIT_S
            return await asyncio.to_thread(getattr(self.llm, method), *args, **kwargs)
        except (LoraError, EngineDied) as e:  # the engine process sorted it already / is gone
            error = e if isinstance(e, LoraError) else LoraError("unavailable", _gone(str(e)))
        except Exception as e:  # noqa: BLE001 - in this process: sorted into status codes; a bug is INTERNAL and logged
            error = lora_error(self.llm, e)
        await _abort(context, _LORA_CODES.get(error.kind, grpc.StatusCode.INTERNAL), str(error))

    async def _stream(self, engine_id: int, outputs: asyncio.Queue, rid: str, t_arrival: float, context,
                      spatial_skill: str | None = None):
        """Turn the engine's Outputs into messages. Outputs that queued up while the client was slow are merged into
        one message (fewer, larger writes under load). Leaving early (client cancel, deadline) aborts the request:
        the engine frees its KV pages once no in-flight step references it. A point / detect request's values are
        kept here and sent as points / boxes in its last message."""
        values: list[int] = []
        finished = False
        first = True
        last_token_at = None
        try:
            while not finished:
                batch = [await outputs.get()]
                if first and isinstance(batch[0], Rejected):  # preparing it failed (bad input): nothing was queued
                    finished = True
                    await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, batch[0].message)
                while _is_output(batch[-1]) and batch[-1].delta.finish_reason is None and not outputs.empty():
                    batch.append(outputs.get_nowait())
                gone = None if _is_output(batch[-1]) else batch.pop()  # None (AsyncLLM) or EngineDied: no engine
                if gone is not None:
                    finished = True  # nothing left to abort
                    if not batch:  # (else the outputs that came before it are sent first)
                        await self._fail_gone(context, gone)
                        return
                now = time.perf_counter()
                msg = pb.GenerateResponse()
                if first:
                    msg.request_id = rid
                for out in batch:
                    d = out.delta
                    if spatial_skill is not None:
                        values += d.token_ids
                    elif d.token_ids:
                        msg.token_ids.extend(d.token_ids)
                        if self.metrics is not None:
                            if last_token_at is None:
                                self.metrics.ttft.observe(now - t_arrival)
                            else:
                                self.metrics.itl.observe((now - last_token_at) / len(d.token_ids))
                        last_token_at = now
                    msg.text += d.text
                    if out.logprobs:
                        for token, logprob, top in out.logprobs:
                            msg.logprobs.add(token_id=token, logprob=logprob, top_token_ids=top.keys(),
                                             top_logprobs=top.values())
                out = batch[-1]
                reason = out.delta.finish_reason
                if reason is not None:
                    finished = True
                    msg.finish_reason = reason
                    msg.usage.prompt_tokens = out.prompt_tokens
                    msg.usage.completion_tokens = out.completion_tokens
                    if out.choice is not None:
                        msg.choice_index, scores = out.choice
                        msg.choice_scores.extend(scores)
                    if spatial_skill is not None and reason != "error":
                        found = spatial.answer_of(spatial_skill, values).normalized(*self.image_limits["region_bins"])
                        for o in found:
                            if spatial_skill == "point":
                                msg.points.add(x=o[0], y=o[1])
                            else:
                                msg.boxes.add(x_min=o[0], y_min=o[1], x_max=o[2], y_max=o[3])
                if self.metrics is not None:
                    self.metrics.generation_tokens.inc(len(msg.token_ids))
                    if first:
                        self.metrics.prompt_tokens.inc(out.prompt_tokens)
                    if finished:
                        self.metrics.e2e.observe(now - t_arrival)
                first = False
                yield msg
                if gone is not None:
                    await self._fail_gone(context, gone)
                if reason == "error":
                    # Mid-flight failure of this request only (e.g. its grammar matcher rejected a token): the client
                    # has every token produced so far, and learns why from the status.
                    await self._fail(context, grpc.StatusCode.ABORTED, out.error or "request failed")
                if reason is not None:
                    self._count("OK", reason)
        finally:
            if not finished:
                self._count("CANCELLED", "")
                self.engine.abort(engine_id)

    async def _fail_gone(self, context, gone) -> None:
        why = str(gone) if isinstance(gone, EngineDied) else (self.engine_failure() or "engine loop died")
        await self._fail(context, grpc.StatusCode.UNAVAILABLE, _gone(why))

    async def _ready(self, context, draining_ok: bool = False) -> AsyncLLM:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when health is SERVING")
        failure = self.engine_failure()
        if failure:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, _gone(failure))
        if self.draining and not draining_ok:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        return self.engine

    def _prompt(self, request) -> str | dict | SkillPrompt:
        if request.skill or request.image or request.length:
            return self._skill_prompt(request)
        kind = request.WhichOneof("input")
        if kind is None:
            raise ValueError("no input: set text or token_ids")
        if kind == "token_ids":
            if request.chat:
                raise ValueError("chat=true applies the chat template to text; it cannot be used with token_ids")
            return {"prompt_token_ids": list(request.token_ids.ids)}
        text = request.text  # (its size was checked against the engine's limits when the request was decoded)
        if not text:
            raise ValueError("empty prompt: text is empty")
        if request.chat:
            return self.engine.chat_prompt([{"role": "user", "content": text}])
        return text

    def _skill_prompt(self, request) -> SkillPrompt:
        """An image skill (GenerateRequest's skill, image, length) as the driver's SkillPrompt; ValueError if invalid."""
        skill = request.skill
        if self.image_limits is None:
            raise ValueError(f"model {self.engine.info['name']!r} takes no images: image, skill and length are for a "
                             "Moondream checkpoint")
        if not skill:
            raise ValueError("an image or a length needs skill 'query', 'caption', 'point' or 'detect'")
        if skill not in ("query", "caption", *spatial.MODES):
            raise ValueError("skill must be 'query', 'caption', 'point' or 'detect' (empty: text generation), got "
                             f"{short(skill)}")
        if request.WhichOneof("input") == "token_ids" or request.chat:
            raise ValueError(f"skill {skill!r} builds its own prompt: token_ids and chat do not apply")
        if skill in spatial.MODES:
            if self.image_limits.get("region_bins") is None:
                raise ValueError(f"model {self.engine.info['name']!r} has no point / detect skills")
            if request.length:
                raise ValueError("length is for skill 'caption'")
            if not request.image:
                raise ValueError(f"skill {skill!r} needs an image")
            if not request.text.strip():
                raise ValueError(f"skill {skill!r}: the object (text) is empty")
            return SkillPrompt(skill, request.image, request.text)
        if skill == "caption":
            if request.text:
                raise ValueError("skill 'caption' takes no text (length picks short, normal or long)")
            text = request.length or "normal"
        else:
            if request.length:
                raise ValueError("length is for skill 'caption'")
            if not request.text.strip():
                raise ValueError("skill 'query': the question (text) is empty")
            text = request.text
        return SkillPrompt(skill, request.image or None, text)

    async def _prepare_image(self, prompt: SkillPrompt, context) -> SkillPrompt:
        """Decode and crop the image on a worker thread of this process (a bad one fails here, at once: nothing
        reaches the engine, and only the crops cross to an engine process), or fail the call with INVALID_ARGUMENT."""
        if self._image_pool is None:
            self._image_pool = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="jphoton-image")
        lim = self.image_limits
        try:
            image = await asyncio.get_running_loop().run_in_executor(
                self._image_pool, skills.prepare, prompt.image, lim["image_geometry"], lim["max_image_pixels"],
                lim["max_image_bytes"])
        except ValueError as e:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - Pillow on hostile bytes: fail the request, not the server
            log.exception("preparing an image failed")
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, f"image: cannot decode: {type(e).__name__}")
        return SkillPrompt(prompt.skill, image, prompt.text)

    def _new_id(self) -> str:
        """Unguessable, so that no client can Abort another's request by counting."""
        while True:
            rid = f"jphoton-{secrets.token_hex(12)}"
            if rid not in self._live:
                return rid

    async def _fail(self, context, code: grpc.StatusCode, message: str) -> None:
        """End the call with `code` (raises, as context.abort does), counting it in the metrics. The message travels in
        a header: cut so that it always fits a client's header limit (8 KiB by default)."""
        self._count(code.name, "error" if code == grpc.StatusCode.ABORTED else "")
        await _abort(context, code, message)

    def _count(self, code: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(code=code, finish_reason=reason).inc()


def _is_output(item) -> bool:
    return item is not None and not isinstance(item, EngineDied)


def _gone(why: str) -> str:
    return f"the engine is gone ({why}); retry on another server or once this one is restarted"


def _adapter_path_refused() -> str:
    from jphoton.weights.peft import ADAPTER_PATH_REFUSED

    return ADAPTER_PATH_REFUSED


def _adapter_dir_allowed(path: str, lora_dirs: tuple[str, ...]) -> bool:
    """Whether `path` (relative: under the first of `lora_dirs`) is a directory inside one of them, symlinks
    resolved (jphoton.weights.peft.resolve_adapter_dir)."""
    from jphoton.weights.peft import resolve_adapter_dir

    try:
        resolve_adapter_dir(path, lora_dirs)
    except ValueError:
        return False
    return bool(lora_dirs)


async def _abort(context, code: grpc.StatusCode, message: str) -> None:
    """context.abort (raises), the message cut so that it always fits a client's header limit (8 KiB by default)."""
    if len(message) > MAX_STATUS_CHARS:
        message = f"{message[:MAX_STATUS_CHARS]}... ({len(message)} characters)"
    await context.abort(code, message)


def sampling_params(msg, lora: str = "", defaults: SamplingParams | None = None) -> SamplingParams:
    """The proto's SamplingParams as jphoton's; unset fields keep `defaults`' (None: jphoton's defaults); `lora`:
    GenerateRequest.lora (empty: the base model). Raises ValueError if invalid."""
    kw = {name: getattr(msg, name) for name in _SCALAR_FIELDS if msg.HasField(name)}
    if lora:
        kw["lora"] = lora
    if msg.stop:
        kw["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.ignore_eos:
        kw["ignore_eos"] = True
    kind = msg.WhichOneof("constraint")
    if kind == "choice":
        kw["choice"] = tuple(msg.choice.options)
    elif kind is not None:
        kw[kind] = getattr(msg, kind)
    return SamplingParams(**kw) if defaults is None else dataclasses.replace(defaults, **kw)


def method_handlers(servicer: EngineServicer) -> grpc.GenericRpcHandler:
    """The Engine service's handlers, with the lenient deserializers above (instead of the generated
    add_EngineServicer_to_server, whose deserializers raise and so answer INTERNAL)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            # (not parsed while the model loads: the call is answered UNAVAILABLE without it)
            request_deserializer=lambda data: (NOT_PARSED if servicer.engine is None
                                               else decode_generate_request(data, servicer.bounds)),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=lenient(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=lenient(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=lenient(pb.GetStatsRequest),
            response_serializer=pb.Stats.SerializeToString),
        "LoadLora": grpc.unary_unary_rpc_method_handler(
            servicer.LoadLora, request_deserializer=lenient(pb.LoadLoraRequest),
            response_serializer=pb.LoraInfo.SerializeToString),
        "UnloadLora": grpc.unary_unary_rpc_method_handler(
            servicer.UnloadLora, request_deserializer=lenient(pb.UnloadLoraRequest),
            response_serializer=pb.UnloadLoraResponse.SerializeToString),
        "ListLoras": grpc.unary_unary_rpc_method_handler(
            servicer.ListLoras, request_deserializer=lenient(pb.ListLorasRequest),
            response_serializer=pb.ListLorasResponse.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

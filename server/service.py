"""The jphoton.v1.Engine servicer: proto request -> prompt + SamplingParams, engine outputs -> streamed messages, and
every failure -> the gRPC status a client can act on.

Status codes (the contract, also in README.md):
  INVALID_ARGUMENT    bad input of any kind (what LLM/SamplingParams reject with ValueError, no input, chat with token
                      ids, two constraints, undecodable bytes, a LoRA adapter that is not loaded); nothing is queued.
                      LoadLora: a bad name, path or adapter
  ALREADY_EXISTS      request_id names a request that is still live
  RESOURCE_EXHAUSTED  the server already holds --max-queue unfinished requests; LoadLora: every LoRA slot is taken
                      (and none drained within 60 s)
  FAILED_PRECONDITION LoadLora on a server without LoRA slots
  UNAVAILABLE         the model is still loading, or the server is shutting down
  ABORTED             the request failed mid-flight (e.g. its grammar matcher rejected a token): the tokens produced so
                      far are sent first, then the last message with finish_reason "error", then this status
  INTERNAL            the engine loop died: a server bug, never a user error
All handlers run on the server's event loop, so the bookkeeping below needs no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import grpc
from google.protobuf.message import DecodeError

from jphoton.async_llm import AsyncLLM
from jphoton.params import SamplingParams, text_size_error
from server import jphoton_pb2 as pb
from server.engine_process import LORA_WAIT_S, EngineDied, EngineProcess, LoraError, Rejected, lora_error
from server.metrics import Metrics

log = logging.getLogger("jphoton.server")

SERVICE_NAME = "jphoton.v1.Engine"
MAX_STATUS_CHARS = 1000  # longest status message sent (an error never echoes a whole request back)
_SCALAR_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")  # proto3 `optional`: unset = the default
_LORA_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "no_slot": grpc.StatusCode.RESOURCE_EXHAUSTED,
               "off": grpc.StatusCode.FAILED_PRECONDITION, "unavailable": grpc.StatusCode.UNAVAILABLE}


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


@dataclasses.dataclass
class BadRequest:
    """What a request deserializer returns for bytes it cannot accept; the handler answers INVALID_ARGUMENT."""

    reason: str


class EngineServicer:
    def __init__(self, admission: Admission, metrics: Metrics | None = None):
        self.admission = admission
        self.metrics = metrics
        self.llm = None  # the LLM when it runs in this process (AsyncLLM), else None
        self.engine: AsyncLLM | EngineProcess | None = None
        self.draining = False
        self.calls = 0  # Generate calls admitted (logged per frontend at stop)
        self._live: dict[str, int] = {}  # client request id -> engine request id, while the stream is open

    def attach(self, llm) -> None:
        """Start serving `llm` (an LLM in this process, its loop in AsyncLLM's thread; or a started EngineProcess)."""
        if isinstance(llm, EngineProcess):
            self.engine = llm
        else:
            self.llm = llm
            self.engine = AsyncLLM(llm)

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
        try:
            prompt = self._prompt(request)
            params = sampling_params(request.sampling, request.lora)
        except ValueError as e:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or self._new_id()
        if rid in self._live:
            await self._fail(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already live")
        if not self.admission.try_acquire():
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server queue is full ({self.admission.capacity} unfinished requests); retry later")
        try:
            try:
                # an engine process keeps the client's id while several frontends share it (Abort via another one)
                named = {"name": rid} if isinstance(engine, EngineProcess) else {}
                engine_id, outputs = engine.submit(prompt, params, **named)
            except ValueError as e:
                await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:  # the engine loop (or process) died
                await self._fail(context, grpc.StatusCode.INTERNAL, str(e))
            self._live[rid] = engine_id
            self.calls += 1
            try:
                async for msg in self._stream(engine_id, outputs, rid, t_arrival, context):
                    yield msg
            finally:
                del self._live[rid]
        finally:
            self.admission.release()

    async def Abort(self, request, context):
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        engine_id = self._live.get(request.request_id)
        if engine_id is not None and self.engine is not None:
            self.engine.abort(engine_id)  # the stream then ends normally, with finish_reason "abort"
            return pb.AbortResponse(found=True)
        if isinstance(self.engine, EngineProcess) and self.engine.frontends > 1:  # a stream on another frontend?
            return pb.AbortResponse(found=await self.engine.abort_named(request.request_id))
        return pb.AbortResponse(found=False)

    async def GetModelInfo(self, request, context):
        engine = await self._ready(context, draining_ok=True)
        return pb.ModelInfo(**engine.info)

    async def GetStats(self, request, context):
        engine = await self._ready(context, draining_ok=True)
        s = self.stats(await engine.fresh_stats())
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
        info = await self._lora(context, "load_lora", request.name, request.path)
        return pb.LoraInfo(**info)

    async def UnloadLora(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return pb.UnloadLoraResponse(found=await self._lora(context, "unload_lora", request.name))

    async def ListLoras(self, request, context):
        if isinstance(request, BadRequest):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        loras = await self._lora(context, "list_loras", draining_ok=True)
        return pb.ListLorasResponse(loras=[pb.LoraInfo(**e) for e in loras])

    # ---- helpers ---------------------------------------------------------------------------------------------------
    async def _lora(self, context, method: str, *args, draining_ok: bool = False):
        """LLM.load_lora / unload_lora / list_loras on the engine (in its process, or on a worker thread of this one:
        they may wait for a draining slot), failures as the status codes above."""
        engine = await self._ready(context, draining_ok=draining_ok)
        try:
            if isinstance(engine, EngineProcess):
                return await getattr(engine, method)(*args)
            kwargs = {"timeout": LORA_WAIT_S} if method == "load_lora" else {}
            return await asyncio.to_thread(getattr(self.llm, method), *args, **kwargs)
        except (LoraError, EngineDied) as e:  # the engine process sorted it already / is gone
            error = e if isinstance(e, LoraError) else LoraError("internal", str(e))
        except Exception as e:  # noqa: BLE001 - in this process: sorted into status codes; a bug is INTERNAL and logged
            error = lora_error(self.llm, e)
        await _abort(context, _LORA_CODES.get(error.kind, grpc.StatusCode.INTERNAL), str(error))

    async def _stream(self, engine_id: int, outputs: asyncio.Queue, rid: str, t_arrival: float, context):
        """Turn the engine's Outputs into messages. Outputs that queued up while the client was slow are merged into
        one message (fewer, larger writes under load). Leaving early (client cancel, deadline) aborts the request:
        the engine frees its KV pages once no in-flight step references it."""
        finished = False
        first = True
        last_token_at = None
        try:
            while not finished:
                batch = [await outputs.get()]
                if first and isinstance(batch[0], Rejected):  # preparing it failed (bad input): nothing was queued
                    finished = True
                    await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, batch[0].message)
                while batch[-1] is not None and batch[-1].delta.finish_reason is None and not outputs.empty():
                    batch.append(outputs.get_nowait())
                if batch[-1] is None:
                    finished = True  # nothing left to abort: the engine loop is gone
                    await self._fail(context, grpc.StatusCode.INTERNAL, "engine loop died; see the server log")
                now = time.perf_counter()
                msg = pb.GenerateResponse()
                if first:
                    msg.request_id = rid
                for out in batch:
                    d = out.delta
                    if d.token_ids:
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
                if self.metrics is not None:
                    self.metrics.generation_tokens.inc(len(msg.token_ids))
                    if first:
                        self.metrics.prompt_tokens.inc(out.prompt_tokens)
                    if finished:
                        self.metrics.e2e.observe(now - t_arrival)
                first = False
                yield msg
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

    async def _ready(self, context, draining_ok: bool = False) -> AsyncLLM:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when health is SERVING")
        if self.draining and not draining_ok:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        return self.engine

    def _prompt(self, request) -> str | dict:
        kind = request.WhichOneof("input")
        if kind is None:
            raise ValueError("no input: set text or token_ids")
        if kind == "token_ids":
            if request.chat:
                raise ValueError("chat=true applies the chat template to text; it cannot be used with token_ids")
            return {"prompt_token_ids": list(request.token_ids.ids)}
        text = request.text
        if not text:
            raise ValueError("empty prompt: text is empty")
        # Refused here, before a megabytes-long prompt is pickled to the engine (len() counts characters, never more
        # than the UTF-8 bytes: a sound lower bound). The engine checks again, exactly.
        limits = getattr(self.engine, "text_limits", None)
        error = limits and text_size_error(len(text), **limits)
        if error:
            raise ValueError(error)
        if request.chat:
            return self.engine.chat_prompt([{"role": "user", "content": text}])
        return text

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


async def _abort(context, code: grpc.StatusCode, message: str) -> None:
    """context.abort (raises), the message cut so that it always fits a client's header limit (8 KiB by default)."""
    if len(message) > MAX_STATUS_CHARS:
        message = f"{message[:MAX_STATUS_CHARS]}... ({len(message)} characters)"
    await context.abort(code, message)


def sampling_params(msg, lora: str = "") -> SamplingParams:
    """The proto's SamplingParams as jphoton's; unset fields keep jphoton's defaults; `lora`: GenerateRequest.lora
    (empty: the base model). Raises ValueError if invalid."""
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
    return SamplingParams(**kw)


# ---- request decoding ---------------------------------------------------------------------------------------------
# A oneof keeps only the last field the parser sees, so a request that carries two constraints (or both a text and
# token ids) would silently run with one of them. The Generate deserializer looks at the wire bytes to refuse that, and
# turns undecodable bytes into INVALID_ARGUMENT rather than grpc's INTERNAL.
_CONSTRAINT_NUMBERS = {f.number: f.name for f in pb.SamplingParams.DESCRIPTOR.oneofs_by_name["constraint"].fields}
_SAMPLING_NUMBER = pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].number
_INPUT_NUMBERS = {f.number: f.name for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields}
_TEXT_NUMBER = pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number


def lenient(message_cls):
    """A request deserializer that returns BadRequest instead of raising on undecodable bytes."""
    def decode(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return BadRequest(f"cannot decode {message_cls.DESCRIPTOR.name}: {e}")
    return decode


def decode_generate_request(data: bytes, text_limits: dict | None = None):
    """The request, or BadRequest. With the engine's `text_limits` (LLM.text_limits), a text too long to be served is
    refused from its size on the wire, before the message is parsed (a 15 MB prompt is never copied into a str)."""
    if text_limits:
        try:
            sizes = [len(value) for field, value in _wire_fields(data) if field == _TEXT_NUMBER and value is not None]
        except (IndexError, ValueError):  # malformed: the parser below says how
            sizes = []
        error = sizes and text_size_error(sizes[-1], **text_limits)
        if error:
            return BadRequest(error)
    try:
        request = pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return BadRequest(f"cannot decode GenerateRequest: {e}")
    inputs, constraints = set(), set()
    for field, value in _wire_fields(data):
        if field in _INPUT_NUMBERS:
            inputs.add(_INPUT_NUMBERS[field])
        elif field == _SAMPLING_NUMBER and value is not None:
            constraints |= {_CONSTRAINT_NUMBERS[f] for f, _ in _wire_fields(value) if f in _CONSTRAINT_NUMBERS}
    if len(inputs) > 1:
        return BadRequest(f"set one input, text or token_ids, not both (got {sorted(inputs)})")
    if len(constraints) > 1:
        return BadRequest(f"at most one constraint per request, got {sorted(constraints)}")
    return request


def _wire_fields(data: bytes):
    """(field number, bytes for length-delimited fields else None) of each top-level field in protobuf wire format.
    Only called on bytes the protobuf parser has accepted."""
    data = memoryview(data)  # field values are views, not copies (a text field may be megabytes)
    i, n = 0, len(data)

    def varint():
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7

    while i < n:
        tag = varint()
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            varint()
            yield field, None
        elif wire == 1:
            i += 8
            yield field, None
        elif wire == 2:
            size = varint()
            yield field, data[i:i + size]
            i += size
        elif wire == 5:
            i += 4
            yield field, None
        else:  # groups (wire types 3/4): not used by this proto; stop scanning rather than guess
            return


def method_handlers(servicer: EngineServicer) -> grpc.GenericRpcHandler:
    """The Engine service's handlers, with the lenient deserializers above (instead of the generated
    add_EngineServicer_to_server, whose deserializers raise and so answer INTERNAL)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=lambda data: decode_generate_request(data, getattr(servicer.engine, "text_limits", None)),
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

"""Request bytes -> a parsed request or BadRequest, in time bounded by the engine's limits (a hostile message of
millions of fields is refused from its size or from one cheap parse, never walked in Python). Owns RequestBounds (what a
GenerateRequest may weigh for one engine) and the name/id checks every RPC shares. Plain protobuf: no grpc, no jax.
"""

from __future__ import annotations

import dataclasses

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from jphoton.engine.config import Limits
from jphoton.params import text_size_error
from jphoton.server import jphoton_pb2 as pb

MAX_REQUEST_ID_CHARS = 256  # GenerateRequest / AbortRequest.request_id (echoed on the first message)
MAX_LORA_NAME_CHARS = 128  # a LoRA adapter's name (as LLM.install_lora's bound; ListLoras echoes it)
MAX_STOP_TOKEN_IDS = 1024  # SamplingParams.stop_token_ids, unless the engine's limits say otherwise
MAX_SMALL_REQUEST_BYTES = 64 * 2**10  # any request but a GenerateRequest (a few names and ids at most)


@dataclasses.dataclass
class BadRequest:
    """What a request deserializer returns for bytes it cannot accept; the handler answers INVALID_ARGUMENT."""

    reason: str


def request_id_error(rid: str) -> str | None:
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        return (f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters (got {len(rid)} characters"
                f"{'' if rid.isprintable() else ', some of them control characters'})")
    return None


def lora_name_error(name: str) -> str | None:
    if not 0 < len(name) <= MAX_LORA_NAME_CHARS or not name.isprintable():
        return (f"a LoRA adapter name is 1 to {MAX_LORA_NAME_CHARS} printable characters (got {len(name)} characters"
                f"{'' if name.isprintable() else ', some of them control characters'})")
    return None


# ---- request decoding ---------------------------------------------------------------------------------------------
# Every check runs on whole messages, in protobuf's C parser (upb): no Python loop over the wire's fields, which a 15 MB
# message of millions of empty fields made take tens of seconds, and which an unknown group in front of the fields
# used to stop (so that two inputs or two constraints got through, the last one winning). Step by step:
#   1. the message's size against what a request within the engine's limits can weigh (RequestBounds.message_bytes):
#      a bigger one is refused before it is parsed at all; one bigger than everything but a text prompt and an image
#      can weigh (RequestBounds.other_bytes) is parsed into a message that knows only `text` and `image` (every other
#      field, nested ones included, is one unknown field: skipped at ~5 ns, a 15 MB blob of packed ids in one copy),
#      and refused if its bytes besides those are more than that: only a text or an image may make a request big;
#   2. the bytes are parsed into a *shadow* GenerateRequest (the real descriptors, changed so that parsing is cheap
#      and tells more): the oneofs' members are plain fields with presence, so that two members set show as two
#      (the real message keeps the last one parsed); strings are bytes (sizes in bytes, no UTF-8 check); repeated
#      strings (stop, choice options) are singular, since a repeated one costs ~40 ns an element to parse, 8 million
#      empty ones 0.6 s with the GIL held, against ~13 ns for a field parsed over and over;
#   3. on the shadow: the oneof rules, the token id and stop_token_id counts, the text's size in bytes
#      (text_size_error, with the engine's text limits), the image's (max_image_bytes; 0: the model takes none) and
#      the bytes that parsing left out or merged (every stop string and option but the last, fields sent twice,
#      unpacked ids: len(data) - shadow.ByteSize()) against what the limits allow (RequestBounds.repeated_bytes):
#      this bounds how many elements the real parse will make;
#   4. the real parse, then counts that are O(1) on it (stop strings, choice options, request_id and lora lengths).
# Parsing holds the GIL (upb does not release it), so a worker thread would not keep health checks answering during
# it; what bounds the time is steps 1 and 3. Default limits: a 15 MB message of empty fields is refused from its size
# in microseconds; one within the size bound (~9 MB) costs one parse that knows only `text` (at most ~13 ns a field
# for top-level fields repeated, ~60 ms at 9 MB on the 2-core CI box), and the messages parsed in full are at most
# other_bytes (~0.9 MB) besides their text.
DEFAULT_CONTEXT = 2**17  # tokens, for the bounds when the engine's context is not known (a stand-in engine)


@dataclasses.dataclass(frozen=True)
class RequestBounds:
    """What a GenerateRequest may hold for one engine (`of(request_limits)`: LLM.text_limits() and EngineConfig.limits,
    as server.engine_loop.request_limits reports them), and so what it can weigh on the wire."""

    text_limits: dict | None  # text_size_error's keywords (None: the engine's are not known)
    max_model_len: int | None
    max_prompt_bytes: int
    max_stop_strings: int
    max_stop_bytes: int
    max_constraint_bytes: int
    max_choices: int
    max_stop_token_ids: int
    max_image_bytes: int  # 0: the model takes no images (request_limits has no "image_geometry")

    @classmethod
    def of(cls, limits: dict | None) -> RequestBounds:
        given = dict(limits or {})
        merged = {**dataclasses.asdict(Limits()), **given}
        text_keys = ("max_prompt_bytes", "bytes_per_token", "max_model_len")
        return cls(text_limits={k: given[k] for k in text_keys} if all(k in given for k in text_keys) else None,
                   max_model_len=given.get("max_model_len"), max_prompt_bytes=merged["max_prompt_bytes"],
                   max_stop_strings=merged["max_stop_strings"], max_stop_bytes=merged["max_stop_bytes"],
                   max_constraint_bytes=merged["max_constraint_bytes"], max_choices=merged["max_choices"],
                   max_stop_token_ids=merged.get("max_stop_token_ids", MAX_STOP_TOKEN_IDS),
                   max_image_bytes=merged["max_image_bytes"] if given.get("image_geometry") else 0)

    @property
    def repeated_bytes(self) -> int:
        """The most bytes that parsing can drop or merge (step 3 above) in a request within these limits: every stop
        string and choice option but the last, with their tags; token ids and stop token ids sent unpacked (a tag
        each); and 64 KiB for fields sent twice."""
        context = self.max_model_len or DEFAULT_CONTEXT
        return (self.max_stop_strings * (self.max_stop_bytes + 4) + self.max_constraint_bytes + 5 * self.max_choices
                + 6 * context + 6 * self.max_stop_token_ids + 2**16)

    @property
    def other_bytes(self) -> int:
        """The most a request within these limits weighs besides its text: token ids (up to 6 bytes each, unpacked),
        every stop string and constraint (twice what parsing may drop), request_id, lora and the scalars (64 KiB)."""
        return 6 * (self.max_model_len or DEFAULT_CONTEXT) + 2 * self.repeated_bytes + 2**16

    @property
    def message_bytes(self) -> int:
        """The most a request within these limits weighs on the wire."""
        return self.max_prompt_bytes + self.max_image_bytes + self.other_bytes


DEFAULT_BOUNDS = RequestBounds.of(None)


class _NotParsed:
    """A GenerateRequest that arrived while the model was loading: not parsed (the call is answered UNAVAILABLE)."""


NOT_PARSED = _NotParsed()


def _shadow_classes() -> dict[str, type]:
    """The shadow messages (step 2 above): jphoton.proto's, in a pool of their own, with oneof members as plain fields
    with presence, strings as bytes and repeated strings singular. Same field numbers and wire types: every message
    the real parser accepts, the shadow parser accepts, and it sees the same fields."""
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    real_package, shadow_package = f".{file.package}.", "jphoton_shadow.v1"
    file.name, file.package = "jphoton_shadow.proto", shadow_package
    del file.service[:]
    for message in file.message_type:
        synthetic = {f.oneof_index for f in message.field if f.proto3_optional}  # proto3 `optional` fields' oneofs
        del message.oneof_decl[:]
        for f in message.field:
            if f.type_name.startswith(real_package):
                f.type_name = f".{shadow_package}.{f.type_name[len(real_package):]}"
            member = f.HasField("oneof_index") and f.oneof_index not in synthetic  # of a real oneof
            optional = f.proto3_optional
            f.ClearField("oneof_index")
            f.proto3_optional = False
            if f.type == F.TYPE_STRING:
                f.type = F.TYPE_BYTES
                if f.label == F.LABEL_REPEATED:
                    f.label = F.LABEL_OPTIONAL
            if optional or (member and f.type != F.TYPE_MESSAGE):  # presence: a synthetic oneof of its own
                f.proto3_optional = True
                f.oneof_index = len(message.oneof_decl)
                message.oneof_decl.add(name=f"_{f.name}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{shadow_package}.{m.name}"))
            for m in file.message_type}


def _text_only_class() -> type:
    """GenerateRequest as a message of two fields, `bytes text = 2` and `bytes image = 7` (step 1 above)."""
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="jphoton_text_only.proto", package="jphoton_text_only.v1",
                                              syntax="proto3")
    message = file.message_type.add(name="TextOnly")
    for name in ("text", "image"):
        number = pb.GenerateRequest.DESCRIPTOR.fields_by_name[name].number
        message.field.add(name=name, number=number, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("jphoton_text_only.v1.TextOnly"))


_ShadowGenerateRequest = _shadow_classes()["GenerateRequest"]
_TextOnly = _text_only_class()
_INPUTS = tuple(f.name for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields)
_CONSTRAINTS = tuple(f.name for f in pb.SamplingParams.DESCRIPTOR.oneofs_by_name["constraint"].fields)


def lenient(message_cls, max_bytes: int = MAX_SMALL_REQUEST_BYTES):
    """A request deserializer that returns BadRequest instead of raising on undecodable bytes, or on more than
    `max_bytes` (these requests hold a few names and ids)."""
    name = message_cls.DESCRIPTOR.name

    def decode(data: bytes):
        if len(data) > max_bytes:
            return BadRequest(f"{name} is {len(data)} bytes; this server accepts at most {max_bytes}")
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return BadRequest(f"cannot decode {name}: {e}")
    return decode


def decode_generate_request(data: bytes, bounds: RequestBounds = DEFAULT_BOUNDS):
    """The request, or BadRequest (the steps above)."""
    if len(data) > bounds.message_bytes:
        return BadRequest(f"request is {len(data)} bytes; requests to this engine are at most {bounds.message_bytes} "
                          f"bytes (its limits: max_prompt_bytes {bounds.max_prompt_bytes}, max_image_bytes "
                          f"{bounds.max_image_bytes}, a context of "
                          f"{bounds.max_model_len or DEFAULT_CONTEXT} tokens, stop strings, constraints)")
    if len(data) > bounds.other_bytes:  # only a text or an image may make it this big
        try:
            big = _TextOnly.FromString(data)
        except DecodeError as e:
            return BadRequest(f"cannot decode GenerateRequest: {e}")
        rest = len(data) - len(big.text) - len(big.image)
        if rest > bounds.other_bytes:
            return BadRequest(f"request is {rest} bytes besides its text and image; a request within this engine's "
                              f"limits is at most {bounds.other_bytes} (its context of "
                              f"{bounds.max_model_len or DEFAULT_CONTEXT} tokens, stop strings, constraints)")
    try:
        shadow = _ShadowGenerateRequest.FromString(data)
    except DecodeError as e:
        return BadRequest(f"cannot decode GenerateRequest: {e}")
    error = _shadow_error(shadow, len(data), bounds)
    if error:
        return BadRequest(error)
    try:
        request = pb.GenerateRequest.FromString(data)
    except DecodeError as e:  # e.g. a string that is not UTF-8
        return BadRequest(f"cannot decode GenerateRequest: {e}")
    error = _request_error(request, bounds)
    return BadRequest(error) if error else request


def _shadow_error(shadow, size: int, bounds: RequestBounds) -> str | None:
    """Step 3: every check here is O(1) on the parsed shadow but ByteSize (C, linear in its few fields left)."""
    if len(shadow.request_id) > 4 * MAX_REQUEST_ID_CHARS:  # (UTF-8: at most 4 bytes a character)
        return f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters (got {len(shadow.request_id)} bytes)"
    if len(shadow.lora) > 4 * MAX_LORA_NAME_CHARS:
        return f"a LoRA adapter name is 1 to {MAX_LORA_NAME_CHARS} printable characters (got {len(shadow.lora)} bytes)"
    inputs = [name for name in _INPUTS if shadow.HasField(name)]
    if len(inputs) > 1:
        return f"set one input, text or token_ids, not both (got {inputs})"
    sampling = shadow.sampling
    constraints = [name for name in _CONSTRAINTS if sampling.HasField(name)]
    if len(constraints) > 1:
        return f"at most one constraint per request, got {constraints}"
    if len(sampling.stop_token_ids) > bounds.max_stop_token_ids:
        return (f"{len(sampling.stop_token_ids)} stop_token_ids; this server accepts at most "
                f"{bounds.max_stop_token_ids}")
    if inputs == ["token_ids"] and bounds.max_model_len and len(shadow.token_ids.ids) >= bounds.max_model_len:
        return f"prompt has {len(shadow.token_ids.ids)} tokens; the context holds {bounds.max_model_len}"
    if len(shadow.image) > bounds.max_image_bytes:
        if not bounds.max_image_bytes:
            return "this model takes no images (image, skill and length are for a Moondream checkpoint)"
        return f"image: {len(shadow.image)} bytes, more than max_image_bytes={bounds.max_image_bytes}"
    if inputs == ["text"] and bounds.text_limits:
        error = text_size_error(len(shadow.text), **bounds.text_limits)  # UTF-8 bytes: the engine's measure
        if error:
            return error
    dropped = size - shadow.ByteSize()
    if dropped > bounds.repeated_bytes:
        return (f"request repeats {dropped} bytes of fields (stop strings, choice options, fields sent more than once); "
                f"a request within this engine's limits repeats at most {bounds.repeated_bytes} (max_stop_strings "
                f"{bounds.max_stop_strings}, max_choices {bounds.max_choices}, max_constraint_bytes "
                f"{bounds.max_constraint_bytes})")
    return None


def _request_error(request, bounds: RequestBounds) -> str | None:
    """Step 4: counts and lengths of the parsed request (O(1) each), before anything copies its lists."""
    error = request_id_error(request.request_id) or (request.lora and lora_name_error(request.lora))
    if error:
        return error
    sampling = request.sampling
    if len(sampling.stop) > bounds.max_stop_strings:  # (as jphoton.params.check_limits says it)
        return f"{len(sampling.stop)} stop strings; this engine accepts at most {bounds.max_stop_strings} (max_stop_strings)"
    if len(sampling.choice.options) > bounds.max_choices:
        return (f"choice has {len(sampling.choice.options)} options; this engine accepts at most {bounds.max_choices} "
                "(max_choices)")
    return None

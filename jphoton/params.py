"""SamplingParams and Completion: what a caller asks for and what it gets back. Validation lives here, at submission."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

FINISH_REASONS = ("stop", "length", "abort", "error")
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "choice")
_FLOAT32_TINY = 1.1754944e-38


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 256  # None: until the context is full
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed => same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many top logprobs per generated token (and the chosen token's)
    # Constrained decoding: at most one of these (see jphoton/constrain/compiler.py). The output then matches the constraint;
    # generation stops when the grammar is complete (EOS is allowed only where the grammar may end).
    json_schema: str | dict | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None  # the whole output matches this regex
    grammar: str | None = None  # a Lark or GBNF grammar
    # the output is one of these strings: the one the model scores highest as a whole sequence, end included (sampled
    # by those scores at temperature > 0); constrain/choice.py
    choice: tuple[str, ...] | None = None
    lora: str | None = None  # the name of a loaded LoRA adapter (LLM.load_lora); None: the base model

    def __post_init__(self):
        # Lists are accepted for convenience and frozen into tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.json_schema, dict):  # kept as text so params stay hashable
            try:
                object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
            except (TypeError, ValueError) as e:
                raise ValueError(f"json_schema is not JSON-serializable: {short(str(e), 200)}") from None
            except RecursionError:
                raise ValueError("json_schema is nested too deeply") from None
        if isinstance(self.choice, (list, tuple)):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    def validate(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {short(self.max_tokens)}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {short(self.temperature)}")
        if not _is_number(self.top_p) or not _FLOAT32_TINY <= self.top_p <= 1:
            # below float32's smallest normal number the device flushes it to 0 (every row would sample token 0)
            raise ValueError(f"top_p must be in [{_FLOAT32_TINY:.4g}, 1], got {short(self.top_p)}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {short(self.top_k)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64) (a 64-bit seed), got {short(self.seed)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {short(self.stop)}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer or None, got {short(self.logprobs)}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {short(self.stop_token_ids)}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be an adapter name (a non-empty string) or None, got {short(self.lora)}")
        self._validate_constraint()

    def _validate_constraint(self) -> None:
        """Shape checks only; whether the grammar compiles is checked at submission, against the tokenizer."""
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one constraint per request, got {given}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise ValueError(f"json_schema must be a dict or JSON text, got {type(self.json_schema).__name__}")
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError("json_schema is nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {short(value)}")
        if self.grammar is not None and not self.grammar.strip():  # (a regex of spaces is a fine regex)
            raise ValueError("grammar is blank: it has no rules")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {short(self.choice)}")

    @property
    def constraint(self) -> tuple[str, str | tuple[str, ...]] | None:
        """(kind, spec) of the request's constraint, or None for free generation."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
        return cls(**d)


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


def _checked_init(self, *args, **kwargs):
    unknown = set(kwargs) - _FIELDS
    if unknown:  # a ValueError like every other bad field, not the dataclass's TypeError
        raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _checked_init


def text_size_error(num_bytes: int, max_prompt_bytes: int, bytes_per_token: int, max_model_len: int,
                    rendered: bool = False) -> str | None:
    """Why a text prompt of `num_bytes` UTF-8 bytes is refused before any tokenizing, or None. `bytes_per_token`: the
    most input bytes one token can stand for (jphoton/requests.py `RequestBuilder.max_bytes_per_token`). rendered: a
    chat after its template (the byte limit was checked on the messages)."""
    if num_bytes > max_prompt_bytes and not rendered:
        return f"prompt is {num_bytes} bytes; this engine accepts at most {max_prompt_bytes} (max_prompt_bytes)"
    least = -(-num_bytes // bytes_per_token)
    if least >= max_model_len:
        return f"prompt has at least {least} tokens ({num_bytes} bytes of text); the context holds {max_model_len}"
    return None


def check_limits(p: SamplingParams, limits) -> None:
    """A request's stop strings and constraint against the engine's Limits (engine/config.py): ValueError naming the
    limit. Cheap: runs before the constraint is compiled."""
    if len(p.stop_token_ids) > limits.max_stop_token_ids:
        raise ValueError(f"{len(p.stop_token_ids)} stop_token_ids; this engine accepts at most "
                         f"{limits.max_stop_token_ids} (max_stop_token_ids)")
    if len(p.stop) > limits.max_stop_strings:
        raise ValueError(f"{len(p.stop)} stop strings; this engine accepts at most {limits.max_stop_strings} "
                         "(max_stop_strings)")
    longest = max((utf8_len(t) for t in p.stop), default=0)
    if longest > limits.max_stop_bytes:
        raise ValueError(f"a stop string of {longest} bytes; this engine accepts at most {limits.max_stop_bytes} "
                         "(max_stop_bytes)")
    spec = p.constraint
    if spec is None:
        return
    kind, value = spec
    if kind == "choice" and len(value) > limits.max_choices:
        raise ValueError(f"choice has {len(value)} options; this engine accepts at most {limits.max_choices} "
                         "(max_choices)")
    size = sum(map(utf8_len, value)) if kind == "choice" else utf8_len(value)
    if size > limits.max_constraint_bytes:
        raise ValueError(f"{kind} is {size} bytes; this engine accepts at most {limits.max_constraint_bytes} "
                         "(max_constraint_bytes)")
    if kind == "json_schema":
        count = schema_properties(value, limits.max_schema_properties)
        if count > limits.max_schema_properties:
            raise ValueError(f"json_schema has more than {limits.max_schema_properties} properties (all objects "
                             f"together); this engine accepts at most {limits.max_schema_properties} "
                             "(max_schema_properties)")


def check_choice_tokens(options: list[list[int]], limits) -> None:
    """A choice's tokenized options against `max_choice_tokens`: what scoring them costs the engine is one row-step per
    token and one for each option's end (constrain/choice.py)."""
    cost = sum(map(len, options)) + len(options)
    if cost > limits.max_choice_tokens:
        raise ValueError(f"choice options are {cost} tokens to score (each option's tokens + 1 for its end); this "
                         f"engine accepts at most {limits.max_choice_tokens} (max_choice_tokens)")


def schema_properties(schema: str, stop_after: int | None = None) -> int:
    """How many properties a JSON schema (text) declares, every object's together (`properties` and
    `patternProperties` maps, wherever they sit: $defs, anyOf, items...); counting stops past `stop_after`. 0 for text
    that is not JSON (validate() refused it already)."""
    try:
        doc = json.loads(schema)
    except (ValueError, RecursionError):
        return 0
    count, todo = 0, [doc]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            for key in ("properties", "patternProperties"):
                props = v.get(key)
                if isinstance(props, dict):
                    count += len(props)
            if stop_after is not None and count > stop_after:
                return count
            todo += v.values()
        elif isinstance(v, list):
            todo += v
    return count


def text_bytes(text: str) -> int:
    """UTF-8 length of a prompt; ValueError for text that is not valid Unicode (lone surrogates: what Python makes of
    undecodable bytes in argv or a file read with errors="surrogateescape")."""
    try:
        return len(text) if text.isascii() else len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("prompt is not valid UTF-8 text (it holds undecodable bytes)") from None


def utf8_len(text: str) -> int:
    """UTF-8 length of `text` without encoding it when that is not needed (ASCII-only text: its length)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: an error message never echoes a whole (possibly huge) input, which over
    gRPC would not even fit the client's header limit."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class SpatialParams:
    """A point / detect request's settings (LLM.prepare_skill): at most max_objects objects (greedy, as the
    reference decodes them)."""

    max_objects: int = 50


@dataclasses.dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the model has no tokenizer
    finish_reason: str  # one of FINISH_REASONS
    error: str | None = None  # the message when finish_reason == "error"
    # With SamplingParams(logprobs=k): per generated token, (token id, its logprob, {top-k id: logprob}).
    logprobs: list[tuple[int, float, dict[int, float]]] | None = None
    # With SamplingParams(choice=...): the option chosen (index into `choice`) and every option's score, its total
    # log-probability under the model, end included (constrain/choice.py).
    choice_index: int | None = None
    choice_scores: list[float] | None = None
    # A point / detect request: each object's bins, (x, y) or (x, y, w, h) (LLM.point / detect normalize them)
    objects: list[tuple[int, ...]] | None = None

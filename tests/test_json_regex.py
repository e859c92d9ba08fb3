"""JSON schemas as regexes (jphoton/constrain/json_regex.py): each regex accepts exactly what llguidance's compact JSON
grammar of the schema accepts. Checked byte by byte (llguidance over a vocabulary of the 256 bytes against outlines-core's index
of the regex: at every prefix of random walks, the same next bytes and the same verdict on the end), token by token on
the embedded model's tokenizer (the device automaton against llguidance's masks), and on sample documents; schemas
outside the subset give None."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from automaton_walk import compare_walks
from schemas import COLOURS, PERSON, WEATHER

from benchmarks.constrained import SCHEMA
from jphoton.constrain.json_regex import schema_to_regex

JSON_OPTIONS = {"whitespace_flexible": False}  # as the engine compiles schemas (jphoton/constrain/compiler.py)


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def integer(lo=None, hi=None) -> dict:
    return {"type": "integer", **({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}


STRINGS = obj(plain={"type": "string"}, short={"type": "string", "maxLength": 3},
              middle={"type": "string", "minLength": 2, "maxLength": 4, "title": "annotations are ignored"},
              zip={"type": "string", "pattern": "^[0-9]{5}$"}, search={"type": "string", "pattern": "[0-9]{2}"},
              dot={"type": "string", "pattern": r'^a.b"?\\?\d\w+$'}, alt={"type": "string", "pattern": "^(ab|c)*x?$"},
              cls={"type": "string", "pattern": r"^[A-Fa-f_\-.]{1,3}\.$"}, ends={"type": "string", "pattern": "ab$"})
INTEGERS = obj(any=integer(), span=integer(-40, 50), neg=integer(-1234, -17), pos=integer(17, 98765),
               above=integer(-40), below=integer(hi=7), zero=integer(0, 0), belowneg=integer(hi=-20))
SCALARS = obj(**{"n": {"type": "number"}, "b": {"type": "boolean"}, "z": {"type": "null"},
                 "e": {"enum": ["a\nb", 'q"\\\x7f\x01/é', 12, 1, -2, 1.5, -0.0, 100.0, True, None]},
                 "c": {"const": "x"}, "te": {"type": "string", "enum": ["x", "y"]},
                 'k"\\\x01\x7fé': {"type": "null"}})
ARRAYS = obj(ints={"type": "array", "items": {"type": "integer"}},
             bools={"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
             none={"type": "array", "items": {"type": "null"}, "maxItems": 0},
             nested={"type": "array", "items": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1},
                     "maxItems": 2},
             objs={"type": "array", "items": obj(), "minItems": 1})
SUPPORTED = {"person": PERSON, "colours": COLOURS, "benchmark": SCHEMA, "strings": STRINGS, "integers": INTEGERS,
             "scalars": SCALARS, "arrays": ARRAYS, "top_string": {"type": "string"},
             "top_zip": {"type": "string", "pattern": "^[0-9]{5}$"},
             "top_integer": integer(-5, 300), "top_enum": {"enum": [1, 12, "a", None]}, "empty": obj()}

UNSUPPORTED = [
    WEATHER,  # number bounds
    {"type": "number", "minimum": 0},
    integer(0.5, 3),
    {"type": "integer", "exclusiveMinimum": 0},
    {"type": "integer", "multipleOf": 2},
    {"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a"]},  # extra properties allowed
    {"type": "object", "properties": {"a": {"type": "null"}}, "additionalProperties": False},  # "a" optional
    {"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a"], "additionalProperties": True},
    {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
    {**obj(), "minProperties": 0},
    {**obj(), "patternProperties": {"^x": {"type": "null"}}},
    {"type": "string", "format": "date"},
    {"type": "string", "pattern": "^[0-9]+$", "maxLength": 4},  # llguidance intersects the two
    {"type": "string", "pattern": r"^\s$"},
    {"type": "string", "pattern": "^[^a]$"},
    {"type": "string", "pattern": "^(?=a)a$"},
    {"type": "string", "pattern": "^a|b$"},
    {"type": "string", "pattern": "^[A-z]$"},  # the range holds "\\", which JSON escapes
    {"type": "array", "items": {"type": "null"}, "uniqueItems": True},
    {"type": "array"},
    {"type": "array", "items": [{"type": "null"}]},
    {"type": "array", "prefixItems": [{"type": "null"}], "items": {"type": "null"}},
    {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    {"oneOf": [{"type": "null"}]},
    {"allOf": [{"type": "null"}]},
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "null"}}},
    {"type": ["string", "null"]},
    {"minLength": 3},
    {},
    {"enum": [{"a": 1}]},
    {"enum": [2**63]},
    {"type": "integer", "enum": [1, "a"]},
    {"type": "string", "minLength": -1},
    # a top-level string with a length bound or a ".": outlines-core's build is exponential in the bound
    {"type": "string", "maxLength": 24},
    {"type": "string", "minLength": 1},
    {"type": "string", "pattern": "^.{3}$"},
    "not json",
    [],
]


# ---- the bytes view: llguidance over a vocabulary of the 256 bytes (token b is byte b; EOS is 256) ----------------
class _ByteTokenizer:
    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def bytewise():
    import llguidance
    from outlines_core import Vocabulary

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), n_vocab=257, eos_token=256)
    return lltok, Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def grammar(schema) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def llguidance_accepts(bytewise, schema, doc: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(bytewise[0], grammar(schema), log_level=0)
    data = list(doc.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


def byte_walks(bytewise, schema, walks: int = 30, steps: int = 150, seed: int = 0) -> int:
    """Random walks (a third uniform over the allowed bytes, a third over the allowed ASCII bytes, a third leaning to
    closing bytes to reach the end) of llguidance and the regex's index side by side; the steps compared."""
    import llguidance
    from outlines_core import Index

    lltok, vocabulary = bytewise
    index = Index(schema_to_regex(schema), vocabulary)
    transitions, g = index.get_transitions(), grammar(schema)
    rng = np.random.default_rng(seed)
    compared = 0
    for w in range(walks):
        matcher, state, doc = llguidance.LLMatcher(lltok, g, log_level=0), index.get_initial_state(), b""
        for _ in range(steps):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[:257]
            expected = set(np.flatnonzero(bits).tolist())
            got = set(transitions.get(state, {})) | ({256} if index.is_final_state(state) else set())
            compared += 1
            assert expected == got, f"after {doc!r}: llguidance only {sorted(expected - got)[:8]}, " \
                                    f"regex only {sorted(got - expected)[:8]}"
            options = sorted(expected - {256})
            if not options:
                break
            ascii_ = [b for b in options if b < 128]
            closing = [b for b in options if b in b'"]},:']
            if w % 3 == 1 and ascii_:
                options = ascii_
            elif w % 3 == 2:
                options = closing if closing and rng.random() < 0.3 else ascii_ or options
            b = int(rng.choice(options))
            assert matcher.consume_token(b)
            state, doc = transitions[state][b], doc + bytes([b])
    return compared


# ---- the tokens view: the embedded model's tokenizer --------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab():
    """(token bytes, AutomatonVocab, llguidance tokenizer) of the embedded model, read from its GGUF (no engine)."""
    import llguidance

    from jphoton.constrain.automaton import AutomatonVocab, token_bytes
    from jphoton.weights.embedded import embedded_model_path
    from jphoton.weights.gguf_file import open_gguf, read_config, read_tokenizer

    reader = open_gguf(embedded_model_path())
    tok, vocab_size = read_tokenizer(reader), read_config(reader, embedded_model_path()).vocab_size
    voc = AutomatonVocab(token_bytes(tok), vocab_size, (tok.eos_token_id,))
    return token_bytes(tok), voc, llguidance.LLTokenizer(tok.hf_json(), n_vocab=vocab_size, eos_token=list(voc.eos_ids))


def build(vocab, schema):
    import llguidance

    from jphoton.constrain.automaton import TokenAutomaton

    _, voc, lltok = vocab
    g = grammar(schema)
    return TokenAutomaton.build(schema_to_regex(schema), voc, 4000, lambda: llguidance.LLMatcher(lltok, g)), g


# ---- tests --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SUPPORTED))
def test_the_regex_allows_the_bytes_llguidance_allows(bytewise, name):
    assert byte_walks(bytewise, SUPPORTED[name]) > 60


@pytest.mark.parametrize("name", ["person", "colours", "benchmark", "strings", "integers", "scalars", "arrays",
                                  "top_integer", "top_enum"])
def test_the_automaton_allows_the_tokens_llguidance_allows(vocab, name):
    schema = SUPPORTED[name]
    automaton, g = build(vocab, schema)
    assert automaton is not None
    tokens, voc, lltok = vocab
    # walks cost ~2 ms a step (llguidance's mask over the whole vocabulary): a few hundred steps a schema
    assert compare_walks(lltok, g, automaton, voc.vocab_size, walks=4, steps=60, short_bias=tokens) >= 8


def test_a_top_level_number_gets_no_automaton(bytewise, vocab):
    """The regex is right ("1" may go on with ".5"), but outlines-core's index has no transition from an accepting state
    to a non-accepting one ("1" -> "1."): the schema stays on llguidance. Inside a document, numbers are served."""
    for schema in ({"type": "number"}, {"enum": [1, 1.5]}):
        assert llguidance_accepts(bytewise, schema, "1.5") and re.fullmatch(schema_to_regex(schema), "1.5")
        assert build(vocab, schema)[0] is None
    assert build(vocab, {"type": "array", "items": {"type": "number"}})[0] is not None


@pytest.mark.parametrize("schema", UNSUPPORTED, ids=lambda s: json.dumps(s)[:60])
def test_schemas_outside_the_subset_give_none(schema):
    assert schema_to_regex(schema) is None


def in_s(*docs: str) -> list[str]:
    """As the value of "s" (a top-level bounded string gets no regex)."""
    return [f'{{"s":{d}}}' for d in docs]


DOCUMENTS = [  # (schema, documents llguidance accepts, documents it does not)
    (PERSON, ['{"name":"Ann","age":31,"address":{"city":"Oslo","zip":"01234"}}'],
     ['{"name": "Ann","age":31,"address":{"city":"Oslo","zip":"01234"}}',  # whitespace
      '{"age":31,"name":"Ann","address":{"city":"Oslo","zip":"01234"}}',  # order
      '{"name":"Ann","age":131,"address":{"city":"Oslo","zip":"01234"}}',
      '{"name":"Ann","age":31,"address":{"city":"Oslo","zip":"1234"}}']),
    (COLOURS, ['{"colours":["red"]}', '{"colours":["red","red","blue","green"]}'],
     ['{"colours":[]}', '{"colours":["red","red","blue","green","red"]}', '{"colours":["pink"]}']),
    (obj(s={"type": "string", "maxLength": 2}), in_s('""', '"ab"', '"\\n\\u001F"', '"\\u007f\\""', '"é😀"'),
     in_s('"abc"', '"\\/"', '"\\u0041"', '"\\u00e9"', '"\x7f"', '"\n"', '"\\x"', "ab")),
    (obj(s={"type": "string", "pattern": "^a.b$"}), in_s('"axb"', '"a\\tb"', '"a\\u000db"', '"aéb"'),
     in_s('"a\\nb"', '"a\\u000Ab"', '"xaxb"')),
    ({"type": "string", "pattern": "b+"}, ['"b"', '"abba"', '"\\nb\\""'], ['""', '"a"']),
    ({"type": "number"}, ["0", "-0", "1.5", "-12.5e+3", "1E5", "1e-05"], ["01", "1.", ".5", "+1", "1e", "- 1", "1.5e"]),
    (integer(-40, 50), ["-40", "-0", "0", "7", "50"], ["-41", "51", "00", "-00", "+7", "7.0", "1e1"]),
    (integer(-40), ["-40", "0", "123456"], ["-0", "-41"]),
    (integer(hi=0), ["0", "-1", "-99999"], ["-0", "1"]),
    (integer(), ["0", "-0", "-12", "12"], ["01", "-01", "1.0"]),
    ({"enum": ["a\nb", 1.0, -0.0, 2.5, None, True]}, ['"a\\nb"', '"a\\u000ab"', "1", "-0", "2.5", "null", "true"],
     ['"a\nb"', "1.0", "0", "-0.0", "2.50", "false"]),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}, ["[true]", "[true,false]"],
     ["[]", "[true,true,true]", "[true,]", "[ true]"]),
    (obj(**{'a"b': {"type": "null"}}), ['{"a\\"b":null}'], ['{"a\\u0022b":null}']),
]


@pytest.mark.parametrize("schema,valid,invalid", DOCUMENTS, ids=lambda x: json.dumps(x)[:40])
def test_sample_documents(bytewise, schema, valid, invalid):
    """Python's re reads these regexes as Rust's regex does (classes, escapes, counted repetition)."""
    regex = schema_to_regex(schema)
    for doc in valid + invalid:
        expected = doc in valid
        assert llguidance_accepts(bytewise, schema, doc) == expected, doc
        assert bool(re.fullmatch(regex, doc)) == expected, doc


@pytest.mark.parametrize("lo,hi", [(None, None), (-40, 50), (-40, 0), (-40, -1), (0, 0), (-1234, -17), (17, 98765),
                                   (None, 7), (None, -20), (None, 0), (-40, None), (0, None), (123, None), (5, 5)])
def test_integer_ranges(lo, hi):
    """Every integer near the bounds: llguidance's integers are canonical decimals in the range, plus "-0" where the
    range is unbounded or both bounds are given around 0 (checked against llguidance in test_sample_documents)."""
    regex = re.compile(schema_to_regex(integer(lo, hi)))
    minus_zero = (lo is None and hi is None) or (lo is not None and hi is not None and lo < 0 <= hi)
    assert bool(regex.fullmatch("-0")) == minus_zero
    for n in range(-1500, 1500):
        assert bool(regex.fullmatch(str(n))) == ((lo is None or n >= lo) and (hi is None or n <= hi)), n
    for text in ("00", "01", "-00", "-01", "+1", "1.0", ""):
        assert not regex.fullmatch(text)
    if hi is None:
        assert regex.fullmatch("123456789012")
    if lo is None:
        assert regex.fullmatch("-123456789012")

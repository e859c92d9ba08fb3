r"""A JSON schema as a regex, for the device automata (jphoton/constrain/automaton.py): the regex accepts exactly the
documents that llguidance's compact JSON grammar of the schema accepts (`whitespace_flexible: False`: no whitespace,
separators "," and ":", properties in the schema's order), so that outlines-core can compile it into a token DFA.
Only a subset of JSON schema is translated; anything else gives None and stays on llguidance. The details follow
llguidance (parser/src/json/, derivre's JSON quoting), checked byte by byte (tests/test_json_regex.py): strings hold raw
characters but `"`, `\`, U+0000-U+001F and U+007F, the escapes \" \\ \b \f \n \r \t, and \u00XX only for U+0000-U+001F
and U+007F (either hex case); lengths count decoded characters; a pattern is a search (unanchored unless it has ^ / $)
in Rust syntax with ASCII \d and \w; integers have no leading zeros, and "-0" only where the range is unbounded or
both bounds are given around 0.
"""

from __future__ import annotations

import json
import math
import re

_ANNOTATIONS = {"title", "description", "examples", "$schema", "$comment", "default"}
_META = set("\\.+*?()|[]{}^$#&-~")  # what Rust's regex_syntax::escape escapes

# One character of a JSON string's content, as llguidance encodes it (its decoded character: any)
_CHAR = r'(?:[^"\\\x00-\x1F\x7F]|\\["\\bfnrt]|\\u00[01][0-9a-fA-F]|\\u007[fF])'
# ... any but "\n" (a pattern's ".")
_DOT = r'(?:[^"\\\x00-\x1F\x7F]|\\["\\bfrt]|\\u00(?:0[0-9b-fB-F]|1[0-9a-fA-F])|\\u007[fF])'
_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SHORT = {"\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
_CLASS_SAFE = {chr(c) for c in range(0x20, 0x7F)} - set('"\\[]^&~-')


class _Unsupported(Exception):
    pass


def schema_to_regex(schema) -> str | None:
    """The regex of the schema's compact JSON documents, or None outside the supported subset."""
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        regex = _value(schema)
        # outlines-core also determinizes the regex's unanchored search, where the '"' of every \" escape may start a
        # new document: for a top-level string with a length bound (or a "."), exponential in the bound (0.5 s at 12
        # characters, minutes and gigabytes at 24)
        _need(not regex.startswith('"') or (_CHAR + "{" not in regex and _DOT not in regex))
        regex.encode("utf-8")  # a lone surrogate (from a "\\ud800" escape) has no UTF-8 form: unsupported
        return regex
    except (_Unsupported, ValueError, RecursionError):
        return None


def _need(ok: bool) -> None:
    if not ok:
        raise _Unsupported


def _value(s) -> str:
    _need(isinstance(s, dict))
    keys = set(s) - _ANNOTATIONS
    kind = s.get("type")
    if "enum" in keys or "const" in keys:
        _need(len(keys - {"type"}) == 1)
        values = s["enum"] if "enum" in keys else [s["const"]]
        _need(isinstance(values, list) and len(values) > 0)
        if kind is not None:  # a type that every value has (llguidance would drop the others)
            types = {"string": str, "boolean": bool, "null": type(None), "integer": int, "number": (int, float)}
            _need(isinstance(kind, str) and kind in types)
            _need(all(isinstance(v, types[kind]) and isinstance(v, bool) == (kind == "boolean") for v in values))
        # longest first: outlines-core's DFA is leftmost-first, an alternative that matched at the end of the document
        # would hide longer ones ("1|12" after "1")
        return "(?:" + "|".join(sorted((_literal(v) for v in values), key=len, reverse=True)) + ")"
    allowed = {"null": set(), "boolean": set(), "number": set(), "integer": {"minimum", "maximum"},
               "string": {"minLength", "maxLength", "pattern"}, "array": {"items", "minItems", "maxItems"},
               "object": {"properties", "required", "additionalProperties"}}
    _need(isinstance(kind, str) and kind in allowed and keys - {"type"} <= allowed[kind])
    if kind in ("null", "boolean", "number"):
        return {"null": "null", "boolean": "(?:true|false)", "number": _NUMBER}[kind]
    if kind == "integer":
        return _integer(_bound(s.get("minimum")), _bound(s.get("maximum")))
    if kind == "string":
        lo, hi = _count(s.get("minLength", 0)), s.get("maxLength")
        if "pattern" in s:
            _need(lo == 0 and hi is None and isinstance(s["pattern"], str))  # llguidance intersects them
            return f'"{_pattern(s["pattern"])}"'
        return f'"{_CHAR}{_repeat(lo, hi)}"'
    if kind == "array":
        _need(isinstance(s.get("items"), dict))
        item = _value(s["items"])
        lo, hi = _count(s.get("minItems", 0)), s.get("maxItems")
        _need(hi is None or _count(hi) >= lo)
        if hi == 0:
            return r"\[\]"
        rest = f"(?:,{item}){_repeat(max(lo - 1, 0), None if hi is None else hi - 1)}"
        return rf"\[{item}{rest}\]" if lo else rf"\[(?:{item}{rest})?\]"
    props, required = s.get("properties", {}), s.get("required", [])
    # every property required, nothing else allowed: one document shape, in the schema's order
    _need(s.get("additionalProperties") is False and isinstance(props, dict) and isinstance(required, list))
    _need(all(isinstance(r, str) for r in [*required, *props]) and set(required) == set(props))
    fields = [_escape(json.dumps(name, ensure_ascii=False)) + ":" + _value(sub) for name, sub in props.items()]
    return r"\{" + ",".join(fields) + r"\}"


def _count(n) -> int:
    _need(isinstance(n, int) and not isinstance(n, bool) and n >= 0)
    return n


def _bound(b) -> int | None:
    if b is None:
        return None
    _need(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b == int(b))
    _need(abs(b) < 2**53)
    return int(b)


def _repeat(lo: int, hi: int | None) -> str:
    if hi is not None:
        _need(lo <= _count(hi))
    return "*" if (lo, hi) == (0, None) else f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _META else c for c in text)


def _char(c: str) -> str:
    """Every encoding llguidance allows for the character c inside a JSON string (a regex atom)."""
    o = ord(c)
    if c in '"\\':
        return "(?:\\\\" + _escape(c) + ")"
    if o < 0x20 or o == 0x7F:
        hi, lo = divmod(o, 16)
        lo = f"{lo:x}" if lo < 10 else f"[{lo:x}{lo:X}]"
        forms = [f"\\\\u00{hi:x}{lo}"] + (["\\\\" + _SHORT[c]] if c in _SHORT else [])
        return "(?:" + "|".join(forms) + ")"
    return _escape(c)


def _literal(v) -> str:
    """A const / enum value as llguidance accepts it."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, int):
        _need(abs(v) < 2**53)
        return _escape(str(v))
    if isinstance(v, float):  # printed as Rust prints an f64: no exponent, no ".0"
        text = repr(v)
        _need(math.isfinite(v) and "e" not in text)
        return _escape(text.removesuffix(".0"))
    _need(isinstance(v, str))
    return '"' + "".join(_char(c) for c in v) + '"'


def _integer(lo: int | None, hi: int | None) -> str:
    """Integers in [lo, hi] as llguidance writes them (its rx_int_range): no leading zeros or "+"; "-0" only where both
    bounds are missing or lo < 0 <= hi."""
    if lo is None and hi is None:
        return "-?(?:0|[1-9][0-9]*)"
    _need(lo is None or hi is None or lo <= hi)
    parts = []
    if hi is None or hi >= 0:
        parts.append(_naturals(max(lo or 0, 0), hi))
    if lo is None or lo < 0:  # magnitudes of the negative part
        spans_zero = lo is not None and hi is not None and hi >= 0
        first = 0 if spans_zero else 1 if hi is None or hi >= 0 else -hi
        parts.append("-" + _naturals(first, None if lo is None else -lo))
    return "(?:" + "|".join(parts) + ")"


def _naturals(lo: int, hi: int | None) -> str:
    """Decimals of lo..hi (hi None: unbounded), lo >= 0, without leading zeros."""
    parts = []
    while hi is None or lo <= hi:
        width = len(str(lo))
        top = 10**width - 1 if hi is None else min(hi, 10**width - 1)
        parts.append(_digits(str(lo), str(top)))
        if hi is None:
            parts.append(f"[1-9][0-9]{{{width},}}")
            break
        lo = top + 1
    # widest first (outlines-core's DFA is leftmost-first: see _value's enum)
    return "(?:" + "|".join(reversed(parts)) + ")"


def _digits(a: str, b: str) -> str:
    """Digit strings of len(a) == len(b) from a to b."""
    if a == b:
        return a
    if a[0] == b[0]:
        return a[0] + _digits(a[1:], b[1:])
    n = len(a) - 1
    tail = f"[0-9]{{{n}}}" if n > 1 else "[0-9]" * n
    first, last = int(a[0]), int(b[0])
    parts = []
    if a[1:] != "0" * n:  # a's leading digit with tails from a's
        parts.append(a[0] + "(?:" + _digits(a[1:], "9" * n) + ")")
        first += 1
    if b[1:] != "9" * n:
        parts.append(b[0] + "(?:" + _digits("0" * n, b[1:]) + ")")
        last -= 1
    if first <= last:
        parts.append(f"[{first}-{last}]" + tail)
    return "(?:" + "|".join(parts) + ")"


def _pattern(p: str) -> str:
    r"""The JSON-string contents matching a schema pattern (a search, Rust regex syntax, \d and \w in ASCII): the
    pattern re-written atom by atom over JSON-encoded characters. A safe subset: literals, \d \w, escaped
    metacharacters, ".", positive classes of printable ASCII, groups, alternation, quantifiers, ^ first and $ last."""
    out, i, depth, top_alt = [], 0, 0, False
    start = p.startswith("^")
    end = len(p) > int(start) and p.endswith("$") and not _escaped(p, len(p) - 1)
    body = p[int(start):len(p) - int(end)]
    while i < len(body):
        c = body[i]
        if c == "\\":
            e = body[i + 1:i + 2]
            _need(e in ("d", "w", "/") or e in _META)
            out.append({"d": "[0-9]", "w": "[0-9A-Za-z_]"}.get(e) or _char(e))
            i += 2
        elif c == "[":
            j = body.find("]", i + 1)
            _need(j > i + 1)
            out.append("[" + _class(body[i + 1:j]) + "]")
            i = j + 1
        elif c == "(":
            _need(body[i + 1:i + 2] != "?" or body[i + 1:i + 3] == "?:")
            out.append("(?:")
            i += 3 if body[i + 1:i + 2] == "?" else 1
            depth += 1
        elif c == ")":
            depth -= 1
            _need(depth >= 0)
            out.append(c)
            i += 1
        elif c == "{":
            m = re.match(r"\{[0-9]+(?:,[0-9]*)?\}", body[i:])
            _need(m is not None)
            out.append(m.group())
            i += m.end() + (body[i + m.end():i + m.end() + 1] == "?")  # a lazy quantifier matches the same strings
        elif c in "*+?":
            out.append(c)
            i += 1 + (body[i + 1:i + 2] == "?")
        else:
            _need(c not in "^$]}")
            top_alt |= c == "|" and depth == 0
            out.append(c if c == "|" else _DOT if c == "." else _char(c))
            i += 1
    _need(depth == 0 and not (top_alt and (start or end)))
    search = f"{_CHAR}*"
    return ("" if start else search) + "(?:" + "".join(out) + ")" + ("" if end else search)


def _escaped(p: str, i: int) -> bool:
    n = 0
    while i - n - 1 >= 0 and p[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _class(body: str) -> str:
    r"""A class's contents: printable ASCII other than " and \ (which JSON escapes), ranges, \d, \w."""
    out, i = [], 0
    while i < len(body):
        if body[i] == "\\":
            e = body[i + 1:i + 2]
            _need(len(e) == 1 and e in "dw-.^/")
            out.append({"d": "0-9", "w": "0-9A-Za-z_"}.get(e) or "\\" + e)
            i += 2
        elif body[i + 1:i + 2] == "-" and i + 2 < len(body):
            a, b = body[i], body[i + 2]
            _need(a in _CLASS_SAFE and b in _CLASS_SAFE and a <= b and not (a < '"' < b or a < "\\" < b))
            out.append(f"{a}-{b}")
            i += 3
        else:
            _need(body[i] in _CLASS_SAFE)
            out.append(body[i])
            i += 1
    return "".join(out)

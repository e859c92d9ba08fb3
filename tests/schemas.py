"""JSON schemas the constrained-decoding tests share (tests/test_constrained.py, tests/test_json_regex.py)."""

PERSON = {  # nested objects, bounded integer, string pattern
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "address"], "additionalProperties": False,
}
COLOURS = {  # an array of enums
    "type": "object",
    "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
                               "minItems": 1, "maxItems": 4}},
    "required": ["colours"], "additionalProperties": False,
}
WEATHER = {  # bounded numbers
    "type": "object",
    "properties": {"celsius": {"type": "integer", "minimum": -40, "maximum": 50},
                   "humidity": {"type": "number", "minimum": 0, "maximum": 1},
                   "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200}},
    "required": ["celsius", "humidity", "wind_kmh"], "additionalProperties": False,
}

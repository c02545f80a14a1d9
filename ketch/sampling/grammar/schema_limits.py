"""JSON Schema features the xgrammar backend would not enforce (or would fail on late), found
before a request starts.

xgrammar (0.2.9) builds a grammar from any schema, but it drops some keywords without a word:
`not` and `if` / `then` / `else` are ignored, an `allOf` of several schemas becomes "any JSON
value", `dependentRequired` and `dependentSchemas` are ignored, and a schema nothing can satisfy
(`type: []`, `anyOf: []`, `oneOf: []`) yields an empty output. A 200 whose output breaks the
schema it was asked for is worse than a 400: these are refused, naming where in the schema they
are (tests/test_structured_limits.py checks each against xgrammar, so a
version that learns one fails that test and the entry can go).
"""
from __future__ import annotations

import re
from typing import Any

# keyword -> why it is refused
UNSUPPORTED = {
    "not": "'not' is not enforced by the grammar backend",
    "if": "'if' / 'then' / 'else' are not enforced by the grammar backend",
    "then": "'if' / 'then' / 'else' are not enforced by the grammar backend",
    "else": "'if' / 'then' / 'else' are not enforced by the grammar backend",
    "dependentRequired": "'dependentRequired' is not enforced by the grammar backend",
    "dependentSchemas": "'dependentSchemas' is not enforced by the grammar backend",
    "contains": "'contains' (and minContains / maxContains) is not enforced by the grammar backend",
}
# A JSON Schema `pattern`'s repetition bound: xgrammar's schema converter takes time quadratic in
# it (2,000: 0.15 s, 10,000: 3.9 s, 30,000: 41 s of one core in the API process), where the
# `regex` field's converter does not; past this it is refused rather than built.
MAX_PATTERN_REPEAT = 1000
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_EMPTY_ACCEPTS_NOTHING = ("type", "anyOf", "oneOf")  # an empty list here: no value matches
# counts: a non-negative integer (xgrammar builds e.g. minLength -1 into a grammar that only
# fails later, in its EBNF parser, with a message about line and column)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
# where subschemas sit: one schema, a list of schemas, or a map of name -> schema
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_feature(schema: Any, where: str = "schema") -> str | None:
    """The first feature of `schema` the backend would not enforce, as "<where>: <why>"; None
    when there is none."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED:
            return f"{where}.{key}: {UNSUPPORTED[key]}"
    for key in _EMPTY_ACCEPTS_NOTHING:
        if schema.get(key) == []:
            return f"{where}.{key}: an empty list accepts no value"
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"{where}.{key}: must be a non-negative integer, got {value!r}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{where}.allOf: several schemas are not intersected by the grammar backend (one is)"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        bounds = [int(n) for m in _REPEAT.finditer(pattern) for n in m.groups() if n]
        if bounds and max(bounds) > MAX_PATTERN_REPEAT:
            return (f"{where}.pattern: a repetition bound of {max(bounds)} (at most {MAX_PATTERN_REPEAT} in a "
                    "schema's pattern; the regex field takes larger ones)")
    if schema.get("uniqueItems") is True:
        return f"{where}.uniqueItems: distinct items are not enforced by the grammar backend"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{where}.$ref: only references into this schema ('#/...') are followed, got {ref!r}"
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        defined = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in defined]
        if missing:
            return (f"{where}.required: {missing[0]!r} is not in properties; the grammar backend enforces "
                    "only required properties it defines")
    for sub, at in _subschemas(schema, where):
        found = unsupported_feature(sub, at)
        if found:
            return found
    return None


def _subschemas(schema: dict[str, Any], where: str):
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{where}.{key}"
    for key in _LIST:
        if isinstance(schema.get(key), list):
            yield from ((s, f"{where}.{key}[{i}]") for i, s in enumerate(schema[key]))
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            yield from ((s, f"{where}.{key}.{name}") for name, s in schema[key].items())

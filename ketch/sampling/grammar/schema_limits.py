"""JSON Schema features the xgrammar backend would not enforce (or would fail on late), found
before a request starts, and the rewrites that let it build valid schemas it would refuse.

xgrammar (0.2.9) builds a grammar from any schema, but it drops some keywords without a word:
`not` and `if` / `then` / `else` are ignored, an `allOf` of several schemas becomes "any JSON
value", `dependentRequired` and `dependentSchemas` are ignored, and a schema nothing can satisfy
(`type: []`, `anyOf: []`, `oneOf: []`) yields an empty output. It reads the first of `$ref`,
`const`, `enum`, `anyOf`, `oneOf`, `allOf` a schema has and ignores every other assertion beside
it; a schema with none of those and no `type` (nor properties / items to say object / array) is
"any value", its other keywords ignored; `multipleOf` is kept only for integers (a whole number
up to 1024); a `oneOf` whose branches it cannot prove disjoint becomes an `anyOf`; a `$ref` other
than a JSON pointer ('#', '#/...') is "any value". A 200 whose output breaks the schema it was
asked for is worse than a 400: these are refused, naming where in the schema they are
(tests/test_structured_limits.py checks each against xgrammar, so a version that learns one
fails that test and the entry can go). Only what the output can reach is checked: the root and
what its `$ref`s lead to, not `$defs` / `definitions` nothing refers to.
"""
from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

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
# where subschemas sit: one schema, a list of schemas, or a map of name -> schema. `additionalItems`
# counts only beside a list `items` (draft 7's tuples; then rewritten into `items`), `$defs` /
# `definitions` only through a `$ref`.
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "dependentSchemas")
# the keyword xgrammar follows alone, first found first; beside it, these assertions are ignored
_ALONE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_OBJECT = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
           "maxProperties", "unevaluatedProperties")
_ARRAY = ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "unevaluatedItems")
_SCALAR = ("minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
           "multipleOf")
_ASSERTIONS = ("type", *_ALONE, *_OBJECT, *_ARRAY, *_SCALAR)
_JSON_TYPES = {"string": (str,), "boolean": (bool,), "null": (type(None),), "array": (list,), "object": (dict,)}


def unsupported_feature(schema: Any, where: str = "schema") -> str | None:
    """The first feature of `schema` the backend would not enforce, as "<where>: <why>"; None
    when there is none. Walks what the output can reach: subschemas, and `$ref` targets (each once:
    recursive references end)."""
    seen: set[int] = set()
    todo = [(schema, where)]
    while todo:
        node, at = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        found = _own_feature(node, at)
        if found:
            return found
        ref = node.get("$ref")
        if isinstance(ref, str):
            todo.append(_resolve(schema, ref, where))  # not found: xgrammar refuses it (a 400 too)
        todo.extend(reversed(list(_subschemas(node, at))))
    return None


def _own_feature(schema: dict[str, Any], where: str) -> str | None:
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
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return (f"{where}.$ref: only JSON-pointer references into this schema ('#', '#/...') are followed, "
                f"got {ref!r}")
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        defined = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in defined]
        if missing:
            return (f"{where}.required: {missing[0]!r} is not in properties; the grammar backend enforces "
                    "only required properties it defines")
    return _ignored_beside(schema, where) or _untyped(schema, where) or _multiple_of(schema, where) or \
        _one_of(schema, where)


def _ignored_beside(schema: dict[str, Any], where: str) -> str | None:
    """An assertion beside the keyword xgrammar follows alone ($ref, const, enum, anyOf, ...).
    `type` beside const / enum is fine when every value has that type (pydantic writes it)."""
    first = next((k for k in _ALONE if k in schema), None)
    if first is None:
        return None
    for key in schema:
        if key == first or key not in _ASSERTIONS:
            continue
        if key == "type" and first in ("const", "enum"):
            values = [schema["const"]] if first == "const" else schema["enum"]
            if isinstance(values, list) and all(_has_type(v, schema["type"]) for v in values):
                continue
        return (f"{where}.{key}: ignored beside '{first}' by the grammar backend (it follows '{first}' alone); "
                f"move '{key}' into what '{first}' names")
    return None


def _has_type(value: Any, declared: Any) -> bool:
    types = declared if isinstance(declared, list) else [declared]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return any(t == "number" and number or t == "integer" and number and float(value).is_integer()
               or isinstance(value, _JSON_TYPES.get(t, ())) and not (t != "boolean" and isinstance(value, bool))
               for t in types)


def _untyped(schema: dict[str, Any], where: str) -> str | None:
    """No `type` (and nothing xgrammar reads as one): "any value", every type's keywords ignored."""
    if any(k in schema for k in ("type", *_ALONE, "properties", "additionalProperties", "unevaluatedProperties",
                                 "items", "prefixItems", "unevaluatedItems")):
        return None
    key = next((k for k in schema if k in _ASSERTIONS), None)
    return key and (f"{where}.{key}: ignored by the grammar backend in a schema without 'type' (it allows any "
                    "value there); give the schema a 'type'")


def _multiple_of(schema: dict[str, Any], where: str) -> str | None:
    """xgrammar keeps `multipleOf` only on integers, and only a whole number up to 1024."""
    if "multipleOf" not in schema or "type" not in schema:
        return None  # beside const / enum / ..., or untyped: refused above
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    step = schema["multipleOf"]
    whole = isinstance(step, (int, float)) and not isinstance(step, bool) and float(step).is_integer()
    if "number" in types or "integer" in types and not (whole and 0 < step <= 1024):
        return (f"{where}.multipleOf: enforced by the grammar backend only for type 'integer' and a whole "
                f"number from 1 to 1024, got {step!r} for type {schema['type']!r}")
    return None


def _one_of(schema: dict[str, Any], where: str) -> str | None:
    """A `oneOf` is exact only where its branches are provably disjoint (xgrammar's own proof, which
    it falls back from to an `anyOf`: a value matching two branches would pass)."""
    options = schema.get("oneOf")
    if "$ref" in schema or "const" in schema or "enum" in schema or "anyOf" in schema or not options:
        return None
    if _discriminated(options) or _types_or_values_disjoint(options):
        return None
    return (f"{where}.oneOf: exactly one matching branch is enforced by the grammar backend only for branches "
            "it can prove disjoint (distinct types, const / enum values, or a required const discriminator "
            "property); use 'anyOf'")


_ANNOTATIONS = ("title", "default", "description", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
                "$schema")
_COMBINED = ("$ref", "anyOf", "allOf", "oneOf")


def _values(schema: Any) -> list[Any] | None:
    """const / enum's values (a finite branch), else None."""
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) and enum else None


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _may_overlap(a: Any, b: Any) -> bool:
    if _numeric(a) or _numeric(b):
        return _numeric(a) and _numeric(b) and (a == b or isinstance(a, float) or isinstance(b, float))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_may_overlap, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_may_overlap(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _discriminated(options: list[Any]) -> bool:
    """Every branch an object requiring one property whose const / enum values no two share."""
    def values(option: Any, key: str) -> list[Any] | None:
        ok = (isinstance(option, dict) and not any(k in option for k in _COMBINED) and option.get("type") == "object"
              and isinstance(option.get("required"), list) and key in option["required"]
              and isinstance(option.get("properties"), dict) and isinstance(option["properties"].get(key), dict))
        return _values(option["properties"][key]) if ok else None

    first = options[0] if isinstance(options[0], dict) else {}
    for key in first.get("required", []) if isinstance(first.get("required"), list) else []:
        found = [values(o, key) for o in options]
        if all(v is not None for v in found) and not any(
                _may_overlap(x, y) for i, a in enumerate(found) for b in found[i + 1:] for x in a for y in b):
            return True
    return False


def _types_or_values_disjoint(options: list[Any]) -> bool:
    """Every branch a bare `type` (not object) or const / enum, no two sharing a value."""
    arms = []
    for option in options:
        if not isinstance(option, dict) or any(k in option for k in _COMBINED):
            return False
        values, declared = _values(option), option.get("type")
        types = declared if isinstance(declared, list) else [declared]
        if values is None and (not declared or "object" in types or any(t not in (*_JSON_TYPES, "integer", "number")
                                                                           for t in types)
                               or any(k != "type" and k not in _ANNOTATIONS for k in option)):
            return False
        arms.append((values, types))
    return not any(_arms_overlap(a, b) for i, a in enumerate(arms) for b in arms[i + 1:])


def _arms_overlap(a: tuple, b: tuple) -> bool:
    (va, ta), (vb, tb) = a, b
    if va is not None and vb is not None:
        return any(_may_overlap(x, y) for x in va for y in vb)
    if va is None and vb is None:
        numeric = {"integer", "number"}
        return bool(set(ta) & set(tb)) or bool(set(ta) & numeric and set(tb) & numeric)
    values, types = (va, tb) if va is not None else (vb, ta)
    return any(_numeric(v) and {"integer", "number"} & set(types) or _has_type(v, types) for v in values)


def _resolve(root: Any, ref: str, where: str) -> tuple[Any, str]:
    """The node a '#' / '#/...' reference names (a JSON pointer: ~1 is '/', ~0 is '~', %-escapes
    decoded, as xgrammar reads it) and its place; (None, where) when there is none."""
    node, at = root, where
    for part in ref[2:].split("/") if ref.startswith("#/") else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node, at = node[part], f"{at}.{part}"
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node, at = node[int(part)], f"{at}[{part}]"
        else:
            return None, where
    return node, at


def _subschemas(schema: dict[str, Any], where: str):
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{where}.{key}"
    if isinstance(schema.get("items"), list) and isinstance(schema.get("additionalItems"), dict):
        yield schema["additionalItems"], f"{where}.additionalItems"
    for key in _LIST:
        if isinstance(schema.get(key), list):
            yield from ((s, f"{where}.{key}[{i}]") for i, s in enumerate(schema[key]))
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            yield from ((s, f"{where}.{key}.{name}") for name, s in schema[key].items())


def buildable(schema: Any) -> Any:
    """`schema` as xgrammar (strict: no property or item a schema does not name) builds it, the
    same values allowed: draft 7's list `items` (tuples) and `additionalItems` become `prefixItems`
    and `items`; an object (array) whose minProperties (minItems) exceeds the properties (prefix
    items) it names, saying nothing of the others, allows any others, as JSON Schema does (strict,
    xgrammar refuses it as unsatisfiable). A copy where anything changes."""
    if not isinstance(schema, (dict, list)):
        return schema
    if isinstance(schema, list):
        return [buildable(s) for s in schema]
    out = dict(schema)
    for key in (*_ONE, "additionalItems"):
        if isinstance(out.get(key), dict):
            out[key] = buildable(out[key])
    for key in (*_LIST, *_MAP, "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: buildable(s) for name, s in out[key].items()}
        elif isinstance(out.get(key), list):
            out[key] = [buildable(s) for s in out[key]]
    if isinstance(out.get("items"), list) and "prefixItems" not in out:
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    out.pop("additionalItems", None)  # beside a schema `items` (or none) it means nothing
    declared = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    is_object = "object" in declared or declared == [None] and "properties" in out
    is_array = "array" in declared or declared == [None] and "prefixItems" in out and "properties" not in out
    if is_object and not any(k in out for k in ("additionalProperties", "unevaluatedProperties", "patternProperties",
                                                "propertyNames")):
        named = out.get("properties") if isinstance(out.get("properties"), dict) else {}
        if isinstance(out.get("minProperties"), int) and out["minProperties"] > len(named):
            out["additionalProperties"] = True
    if is_array and "items" not in out and "unevaluatedItems" not in out:
        prefix = out.get("prefixItems") if isinstance(out.get("prefixItems"), list) else []
        if isinstance(out.get("minItems"), int) and out["minItems"] > len(prefix):
            out["items"] = True
    return out

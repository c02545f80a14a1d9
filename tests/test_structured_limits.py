"""ketch/sampling/grammar/schema_limits.py: the JSON Schema features xgrammar would drop are refused
(naming where they are), and each refusal is still needed: xgrammar, given the feature, accepts
a value the schema forbids. A version of xgrammar that learns one fails here, and its entry goes."""
from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from ketch.parsers.tool_grammar import forced_calls, structural_tag
from ketch.sampling.grammar import GrammarSpec
from ketch.sampling.grammar.schema_limits import UNSUPPORTED, unsupported_feature
from ketch.sampling.grammar.xgrammar_backend import XGrammarBackend

# (a schema using the feature, a value it forbids that xgrammar's grammar accepts anyway)
DROPPED = {
    "not": ({"not": {"type": "string"}}, '"abc"'),
    "if": ({"type": "string", "if": {"minLength": 1}, "then": {"maxLength": 3}}, '"abcdef"'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "properties": {"a": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "allOf": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "null"),
    "type": ({"type": []}, "null"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "uniqueItems": ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, '["a", "a"]'),
    "required": ({"type": "object", "required": ["city"]}, "{}"),  # a required name properties lacks
    "$ref": ({"$ref": "http://example.com/s.json"}, '"anything"'),  # only '#/...' references are followed
}


@pytest.mark.parametrize("feature", DROPPED)
def test_each_refused_feature_is_one_xgrammar_drops(feature):
    schema, forbidden = DROPPED[feature]
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert accepts(grammar, forbidden)  # the grammar lets through what the schema forbids
    with pytest.raises(ValueError, match=re.escape(f"schema.{feature}")):
        XGrammarBackend.check(GrammarSpec.json_schema(schema))


def test_every_listed_keyword_is_shown_dropped():
    assert set(UNSUPPORTED) - {"then", "else"} <= set(DROPPED)


@pytest.mark.parametrize("schema, where", [
    ({"anyOf": []}, "schema.anyOf: an empty list"),
    ({"oneOf": []}, "schema.oneOf: an empty list"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}},
     "schema.properties.a.minLength: must be a non-negative integer, got -1"),
    ({"type": "array", "items": {"type": "string", "maxLength": 2.5}}, "schema.items.maxLength"),
    ({"$defs": {"p": {"if": {}}}, "$ref": "#/$defs/p"}, "schema.$defs.p.if"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"not": {}}]}, "schema.prefixItems[1].not"),
])
def test_nested_and_unsatisfiable_schemas_are_refused_naming_the_place(schema, where):
    assert unsupported_feature(schema).startswith(where)
    with pytest.raises(ValueError, match="json_schema: invalid: "):
        XGrammarBackend.check(GrammarSpec.json_schema(schema))


def test_a_huge_pattern_bound_is_refused_before_it_is_built():
    """xgrammar's schema converter is quadratic in a pattern's repetition bound (seconds of the API
    process at 10,000): refused past MAX_PATTERN_REPEAT, the bound named; the same bound within
    the limit, and escaped braces, build."""
    big = {"type": "string", "pattern": "^[a-z]{1,15000}$"}
    assert unsupported_feature(big).startswith("schema.pattern: a repetition bound of 15000")
    with pytest.raises(ValueError, match="repetition bound of 15000"):
        XGrammarBackend.check(GrammarSpec.json_schema(big))
    XGrammarBackend.check(GrammarSpec.json_schema({"type": "string", "pattern": "^[a-z]{1,1000}$"}))
    assert unsupported_feature({"type": "string", "pattern": r"^a\{1,15000\}$"}) is None


def test_json_object_is_an_object():
    """OpenAI's JSON mode: a top-level array or scalar is refused by the grammar (xgrammar's
    builtin JSON grammar takes any value)."""
    grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    assert accepts(grammar, '{"a": [1, 2]}') and not accepts(grammar, "[1, 2]") and not accepts(grammar, "3")
    assert not accepts(xgr.Grammar.from_ebnf(_json_object_ebnf()), "[1, 2]")


def _json_object_ebnf() -> str:
    from ketch.sampling.grammar.xgrammar_backend import _grammar

    return str(_grammar(GrammarSpec("json_object")))


def test_a_grammar_no_text_can_begin_is_refused_by_the_check():
    """The API process's check (no model tokenizer) finds it, so a stream gets a 400 too."""
    with pytest.raises(ValueError, match="matches no text"):
        XGrammarBackend.check(GrammarSpec("ebnf", "root ::= x\nx ::= x"))
    XGrammarBackend.check(GrammarSpec("ebnf", 'root ::= "a" | ""'))  # the empty text is a text


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 7},  # enforced (a modular automaton)
    {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer"}}},  # one schema: pydantic's wrapper
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 0, "maxLength": 3}}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},  # enforced
    {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
    True,
])
def test_what_xgrammar_enforces_passes(schema):
    XGrammarBackend.check(GrammarSpec.json_schema(schema))


def test_a_tool_whose_parameters_use_a_dropped_feature_is_refused():
    tag = structural_tag(forced_calls("hermes", [{"name": "f", "parameters": {"type": "object", "not": {}}}], False))
    with pytest.raises(ValueError, match=r"schema\.not"):
        XGrammarBackend.check(GrammarSpec("structural_tag", tag))


def _validator(schema):
    """draft 7 where `items` is a list (tuples), else 2020-12."""
    import jsonschema

    tuples = isinstance(schema, dict) and isinstance(schema.get("items"), list)
    return (jsonschema.Draft7Validator if tuples else jsonschema.Draft202012Validator)(schema)


# (a schema, a value it forbids that xgrammar's grammar accepts anyway, where the refusal points)
DROPPED_AT = [
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, '"abcd"',
     "schema.maxLength: ignored beside '$ref'"),
    ({"type": "string", "enum": ["a", 1]}, "1", "schema.type: ignored beside 'enum'"),
    ({"type": "integer", "const": "a"}, '"a"', "schema.type: ignored beside 'const'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "{}", "schema.type: ignored beside 'anyOf'"),
    ({"allOf": [{"type": "string"}], "maxLength": 2}, '"abc"', "schema.maxLength: ignored beside 'allOf'"),
    ({"maxLength": 2}, '"abc"', "schema.maxLength: ignored by the grammar backend in a schema without 'type'"),
    ({"minProperties": 1}, "{}", "schema.minProperties: ignored by the grammar backend in a schema without"),
    ({"type": "number", "multipleOf": 0.5}, "1.3", "schema.multipleOf: enforced by the grammar backend only"),
    ({"type": "integer", "multipleOf": 2.5}, "3", "schema.multipleOf"),
    ({"type": "integer", "multipleOf": 1025}, "3", "schema.multipleOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "schema.oneOf: exactly one matching branch"),
    ({"oneOf": [{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 2}]}, '"ab"', "schema.oneOf"),
    ({"$defs": {"s": {"$anchor": "foo", "type": "string"}}, "$ref": "#foo"}, "1", "schema.$ref: only JSON-pointer"),
    # reached through a chain of references, a recursive one, an escaped pointer
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"not": {"type": "string"}}}, "$ref": "#/$defs/a"}, '"x"',
     "schema.$defs.b.not"),
    ({"type": "object", "properties": {"n": {"$ref": "#/definitions/node"}}, "definitions": {"node": {
        "type": "object", "properties": {"next": {"$ref": "#/definitions/node"},
                                         "v": {"type": "number", "multipleOf": 0.5}}}}},
     '{"n": {"next": {"v": 1.3}}}', "schema.definitions.node.properties.v.multipleOf"),
    ({"$defs": {"a/b": {"not": {"type": "string"}}}, "$ref": "#/$defs/a~1b"}, '"x"', "schema.$defs.a/b.not"),
]


@pytest.mark.parametrize("schema, forbidden, where", DROPPED_AT, ids=[w for _, _, w in DROPPED_AT])
def test_what_xgrammar_ignores_beside_other_keywords_is_refused(schema, forbidden, where):
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert accepts(grammar, forbidden) and not _validator(schema).is_valid(json.loads(forbidden))
    with pytest.raises(ValueError, match=re.escape(where)):
        XGrammarBackend.check(GrammarSpec.json_schema(schema))


# valid schemas xgrammar enforces exactly (some once rewritten: schema_limits.buildable), with
# values the grammar must take and refuse as a JSON Schema validator does
ENFORCED = [
    ({"type": "object", "minProperties": 1}, [{"a": 1}, {"a": 1, "b": "x"}], [{}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2, "maxProperties": 2},
     [{"a": 1, "b": 2}], [{"a": 1}, {"a": 1, "b": 2, "c": 3}]),
    ({"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}, [["a", 1], ["a"]], [[1, "a"]]),
    ({"type": "array", "items": [{"type": "string"}], "additionalItems": {"type": "integer"}}, [["a", 1, 2]],
     [["a", "b"]]),
    ({"type": "array", "items": [{"type": "string"}], "additionalItems": False}, [["a"]], [["a", 1]]),
    ({"type": "array", "prefixItems": [{"type": "string"}], "minItems": 2}, [["a", 1], ["a", "b", None]], [["a"]]),
    ({"type": "string", "$defs": {"x": {"not": {}}}, "definitions": {"y": {"if": {}, "then": {"not": {}}}}},
     ["a"], [1]),
    ({"$ref": "#/$defs/t", "description": "d", "$defs": {"t": {"type": "string", "enum": ["a", "b"], "title": "T"},
                                                          "unused": {"not": {"type": "string"}}}},
     ["a"], ["c", 1]),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}, {"const": None}]}, ["a", 1, None], [1.5, True]),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k", "x"]},
                {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "string"}}, "required": ["k", "y"]}]},
     [{"k": "a", "x": 1}, {"k": "b", "y": "s"}], [{"k": "a", "y": "s"}, {"k": "c", "x": 1}]),
    ({"type": "integer", "multipleOf": 1024}, [2048], [3]),
    ({"type": ["string", "null"], "enum": ["ab", None]}, ["ab", None], ["c"]),
]


@pytest.mark.parametrize("schema, good, bad", ENFORCED, ids=[json.dumps(s)[:60] for s, _, _ in ENFORCED])
def test_valid_schemas_xgrammar_enforces_are_built_and_agree_with_a_validator(schema, good, bad):
    from ketch.sampling.grammar.xgrammar_backend import _grammar

    spec = GrammarSpec.json_schema(schema)
    XGrammarBackend.check(spec)
    grammar = _grammar(spec)
    validator = _validator(schema)
    for value in good:
        assert validator.is_valid(value) and accepts(grammar, json.dumps(value)), value
    for value in bad:
        assert not validator.is_valid(value) and not accepts(grammar, json.dumps(value)), value


def test_a_tool_whose_parameters_use_a_draft_7_tuple_is_built():
    params = {"type": "object", "properties": {"p": {"type": "array", "items": [{"type": "string"}]}}}
    tag = structural_tag(forced_calls("hermes", [{"name": "f", "parameters": params}], False))
    XGrammarBackend.check(GrammarSpec("structural_tag", tag))

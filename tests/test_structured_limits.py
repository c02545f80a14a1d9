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

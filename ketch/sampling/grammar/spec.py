"""What a request asks its output to match: one grammar of one kind, hashable (the compile cache key)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# json_object: any JSON object; json_schema: a JSON Schema (as JSON text); regex; ebnf (GBNF-style,
# the root rule named `root`); structural_tag: xgrammar's structural-tag JSON (tool calls).
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    source: str = ""  # unused for json_object

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar: kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"grammar: source must be a string, got {type(self.source).__name__}")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"{self.kind}: must not be empty")

    @classmethod
    def json_schema(cls, schema: Any) -> "GrammarSpec":
        """From a schema object (or its JSON text); key order is kept, it shapes the output."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema: not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema: expected a JSON Schema object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def coerce(cls, value: Any) -> "GrammarSpec | None":
        """Accept a GrammarSpec, a {'kind', 'source'} map (how it crosses the process boundary) or None."""
        if value is None or isinstance(value, GrammarSpec):
            return value
        if isinstance(value, dict) and set(value) <= {"kind", "source"} and "kind" in value:
            return cls(value["kind"], value.get("source", ""))
        raise ValueError(f"grammar: expected a GrammarSpec, got {type(value).__name__}")

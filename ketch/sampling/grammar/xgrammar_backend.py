"""GrammarBackend on xgrammar: token masks from a compiled grammar, ~tens of µs per row per step."""
from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch
import xgrammar as xgr

from ketch.sampling.grammar.base import GrammarBackend, GrammarMatcher
from ketch.sampling.grammar.schema_limits import buildable, unsupported_feature
from ketch.sampling.grammar.spec import GrammarSpec

_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:94: "


def _reason(e: Exception) -> str:
    return _CPP_PREFIX.sub("", str(e).strip()).strip()


def _schemas_in_tag(node: Any):
    """The JSON Schemas inside a structural tag (tool calls' arguments, a composed answer)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield node["json_schema"]
        for value in node.values():
            yield from _schemas_in_tag(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schemas_in_tag(value)


def _refuse_unenforced(spec: GrammarSpec) -> None:
    """ValueError for a schema feature the grammar would silently drop (schema_limits.py)."""
    if spec.kind == "json_schema":
        schemas = [json.loads(spec.source)]
    elif spec.kind == "structural_tag":
        schemas = list(_schemas_in_tag(json.loads(spec.source)))
    else:
        return
    for schema in schemas:
        if found := unsupported_feature(schema):
            raise ValueError(found)


def _tag_buildable(node: Any) -> Any:
    """A structural tag with its JSON Schemas made buildable (schema_limits.buildable)."""
    if isinstance(node, list):
        return [_tag_buildable(value) for value in node]
    if not isinstance(node, dict):
        return node
    out = {key: _tag_buildable(value) for key, value in node.items()}
    if node.get("type") == "json_schema" and "json_schema" in node:
        out["json_schema"] = buildable(node["json_schema"])
    return out


def _buildable_source(spec: GrammarSpec) -> str:
    """The source xgrammar is given: a schema (or a tag's schemas) rewritten where xgrammar would
    refuse a valid one (draft 7 tuples, minProperties / minItems past what is named); the
    request's own text where nothing changes."""
    if spec.kind not in ("json_schema", "structural_tag"):
        return spec.source
    source = json.loads(spec.source)
    rewritten = buildable(source) if spec.kind == "json_schema" else _tag_buildable(source)
    return spec.source if rewritten == source else json.dumps(rewritten)


def _grammar(spec: GrammarSpec) -> xgr.Grammar:
    _refuse_unenforced(spec)
    if spec.kind == "json_object":
        # an object, as OpenAI's JSON mode promises (the builtin JSON grammar takes any value: a
        # top-level array too), with json_schema's bounded whitespace
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(_buildable_source(spec), any_whitespace=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.source)
    if spec.kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec.source)
    return xgr.Grammar.from_structural_tag(_buildable_source(spec))


_BYTES = 256
_byte_compilers: list[xgr.GrammarCompiler] = []
_byte_lock = threading.Lock()  # the API process checks grammars on worker threads (server/structured.py)


def _byte_compiler() -> xgr.GrammarCompiler:
    """A compiler over a vocabulary of the 256 single bytes (and a stop token): the API
    process's checks have no model tokenizer, and any text begins with a byte."""
    if not _byte_compilers:
        info = xgr.TokenizerInfo([bytes([b]) for b in range(_BYTES)], xgr.VocabType.RAW, vocab_size=_BYTES + 1,
                                 stop_token_ids=[_BYTES])
        _byte_compilers.append(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False))
    return _byte_compilers[0]


def _refuse_empty(spec: GrammarSpec, compiled: xgr.CompiledGrammar, mask: torch.Tensor) -> None:
    """A grammar no text can begin (`root ::= root`) builds and compiles; sampled, its first mask
    allows nothing. ValueError (a 400)."""
    matcher = xgr.GrammarMatcher(compiled)
    matcher.fill_next_token_bitmask(mask, 0)
    if not matcher.is_terminated() and not bool(mask.any()):
        raise ValueError(f"{spec.kind}: invalid: the grammar matches no text (no token can begin one)")


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, backend: "XGrammarBackend", compiled: xgr.CompiledGrammar) -> None:
        self.backend = backend
        self._m = xgr.GrammarMatcher(compiled)

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(mask, row)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)


_BIT = torch.arange(32, dtype=torch.int32)


def _apply_mask_cpu(logits: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> None:
    """-inf where the packed mask's bit is 0 (token w*32 + k is bit k of word w). Three vectorised
    passes; ~4x faster here than xgrammar's CPU kernel at 32 rows × 49,152 (2.5 vs 11 ms)."""
    bits = (mask.unsqueeze(-1) >> _BIT) & 1
    allowed = bits.view(mask.shape[0], -1)[:, :vocab_size].bool()
    logits[:, :vocab_size].masked_fill_(~allowed, float("-inf"))


class XGrammarBackend(GrammarBackend):
    """`hf_tokenizer`: the transformers tokenizer; `vocab_size`: the model's (logits' width, which
    may exceed the tokenizer's); `stop_token_ids`: the tokens that end a sample (eos, end of turn);
    `device`: where the logits live (picks the mask kernel once)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 device: torch.device | str = "cpu") -> None:
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._on_cpu = torch.device(device).type == "cpu"

    @classmethod
    def check(cls, spec: GrammarSpec) -> None:
        """What compile would refuse, without the model's tokenizer: the grammar is built, its
        EBNF parsed again (a schema like minLength -1 builds, and its EBNF fails only there), and
        compiled against a vocabulary of the 256 bytes to see that some text can begin (the
        engine's compile finds a grammar like `root ::= root` only when a stream has started)."""
        try:
            grammar = _grammar(spec)
            xgr.Grammar.from_ebnf(str(grammar))
            with _byte_lock:
                compiled = _byte_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{spec.kind}: invalid: {_reason(e)}") from None
        _refuse_empty(spec, compiled, xgr.allocate_token_bitmask(1, _BYTES + 1))

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            compiled = self._compiler.compile_grammar(_grammar(spec))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{spec.kind}: invalid: {_reason(e)}") from None
        _refuse_empty(spec, compiled, self.allocate_mask(1))  # once per grammar: compiles are cached
        return compiled

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(self, compiled)

    def allocate_mask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)  # all bits set: all allowed

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        if self._on_cpu:
            _apply_mask_cpu(logits, mask, self.vocab_size)
        else:
            xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab_size)

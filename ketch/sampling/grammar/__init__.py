"""Grammar-constrained decoding: specs, the backend interface, the xgrammar backend, the compile cache."""
from ketch.sampling.grammar.base import GrammarBackend, GrammarMatcher
from ketch.sampling.grammar.spec import GRAMMAR_KINDS, GrammarSpec

__all__ = ["GRAMMAR_KINDS", "GrammarBackend", "GrammarMatcher", "GrammarSpec"]

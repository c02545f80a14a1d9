"""The grammar backend contract: check a spec, compile it, match tokens, mask logits.

    API process / add_request:   backend-free syntax check (cheap)  → ValueError naming the kind
    compile thread:              compile(spec) once per spec (cached) → opaque compiled grammar
    engine, per sample:          matcher = new_matcher(compiled)
    sampler, per step:           mask = allocate_mask(B); matcher.fill_mask(mask, row); apply_mask(logits, mask)
    engine, per sampled token:   matcher.accept(token); finished when matcher.is_terminated()
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from ketch.sampling.grammar.spec import GrammarSpec

if TYPE_CHECKING:  # annotations only: the API process imports this contract without torch (config.py)
    import torch


class GrammarMatcher(ABC):
    backend: "GrammarBackend"

    @abstractmethod
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a mask from `backend.allocate_mask`."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (state unchanged)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sample is done."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepts (speculative drafts are walked, then taken back)."""


class GrammarBackend(ABC):
    @classmethod
    @abstractmethod
    def check(cls, spec: GrammarSpec) -> None:
        """Syntax check without a tokenizer (fast; the API process runs it before a stream starts).
        ValueError whose message starts with the spec's kind."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """Compile against the tokenizer (slow: call it off the step loop). ValueError if invalid."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher: ...

    @abstractmethod
    def allocate_mask(self, rows: int) -> torch.Tensor:
        """A host mask for `rows` rows that allows every token until a matcher fills its row."""

    @abstractmethod
    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place, on the logits' device."""

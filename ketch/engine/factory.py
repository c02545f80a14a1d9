"""The engine a config asks for: one `Engine`, or under DP attention one per rank behind
`DPAttentionEngine` (dp_attention.py), which offers the same API to `LLM` and the engine process."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ketch.config import EngineConfig
from ketch.engine.engine import Engine

if TYPE_CHECKING:
    from ketch.engine.dp_attention import DPAttentionEngine


def make_engine(config: EngineConfig, eos_token_ids: tuple[int, ...] = ()) -> "Engine | DPAttentionEngine":
    if config.enable_dp_attention:
        from ketch.engine.dp_attention import DPAttentionEngine

        return DPAttentionEngine(config, eos_token_ids)
    return Engine(config, eos_token_ids=eos_token_ids)

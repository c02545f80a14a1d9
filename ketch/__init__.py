"""ketch: a fast LLM serving engine."""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Both pull in torch (the model code; the grammar masks): `import ketch` stays light, so the
    # CLI's --help and `ketch gateway` (a proxy: no torch at all) start in a fraction of a second.
    if name == "LLM":
        from ketch.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ketch.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

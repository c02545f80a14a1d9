"""ketch: a fast LLM serving engine."""
from ketch.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import ketch` light for the CLI's --help.
    if name == "LLM":
        from ketch.llm import LLM

        return LLM
    raise AttributeError(name)

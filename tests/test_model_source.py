"""ModelSource: the model's path, weight format and tokenizer, resolved once per engine."""
from __future__ import annotations

import pytest
from conftest import make_tiny_engine

import ketch.weights.source as source_module
from ketch.weights.source import ModelSource


def test_resolve_names_the_field_and_reports_what_loads(tiny_config_path: str, smollm_path: str, tmp_path) -> None:
    gguf = ModelSource.resolve(smollm_path)
    assert (gguf.path, gguf.format, gguf.tokenizer, gguf.is_gguf) == (smollm_path, "gguf", smollm_path, True)
    dummy = ModelSource.resolve(smollm_path, "dummy")
    assert dummy.format == "dummy" and dummy.tokenizer is None and not dummy.is_gguf
    assert ModelSource.resolve(tiny_config_path, "dummy", tokenizer=smollm_path).tokenizer == smollm_path
    with pytest.raises(ValueError, match="^model:"):
        ModelSource.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="^load_format"):
        ModelSource.resolve(smollm_path, "safetensors")
    with pytest.raises(ValueError, match="^tokenizer:"):
        ModelSource.resolve(smollm_path, tokenizer=str(tmp_path / "nope"))


def test_an_engine_resolves_its_model_once(tiny_config_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Config, weights, the 4-bit check and the grammar gate's tokenizer all read the engine's
    one ModelSource: the path/format check runs once, not once per reader."""
    calls: list[str] = []
    real = source_module.detect_format

    def counted(path: str, load_format: str = "auto") -> str:
        calls.append(path)
        return real(path, load_format)

    monkeypatch.setattr(source_module, "detect_format", counted)
    engine = make_tiny_engine(tiny_config_path)
    assert calls == [tiny_config_path]
    assert engine.source.format == "dummy" and engine.runner.source is engine.source

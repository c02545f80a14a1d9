"""HF architecture name -> model family; a model's config from its files, through its family.

    family_for(architecture)                -> ModelFamily      (ValueError naming the choices)
    register_family(family)                 -> undo()           a family defined outside ketch
                                                                (a plugin, a test) serves its
                                                                architectures in this process
    config_from_hf(d)                       -> the family's config (config.json's dict)
    load_model_config(path, load_format)    -> the family's config of a GGUF file / HF directory
                                               / config.json (ketch.weights reads the dict)
    weight_shapes(config)                   -> the checkpoint's HF names and full shapes
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ketch.models.family import ModelFamily
from ketch.models.deepseek_family import DEEPSEEK
from ketch.models.llama_family import LLAMA
from ketch.models.moe_family import MOE
from ketch.weights import ModelSource, read_config

FAMILIES: tuple[ModelFamily[Any], ...] = (LLAMA, MOE, DEEPSEEK)  # built in; register_family adds others
_BY_ARCHITECTURE: dict[str, ModelFamily[Any]] = {arch: family for family in FAMILIES for arch in family.architectures}
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"  # config.json files without `architectures`


def register_family(family: ModelFamily[Any]) -> Callable[[], None]:
    """Serve `family`'s architectures from now on, in this process; returns the call that takes
    them out again (idempotent). An architecture some family already serves is a ValueError:
    nothing is replaced silently. Spawned tensor-parallel workers are fresh processes: a family
    registered at run time must be registered there too (at the import of its module)."""
    if not family.architectures:
        raise ValueError(f"family {family.name!r}: architectures must name at least one HF architecture")
    taken = sorted(a for a in family.architectures if a in _BY_ARCHITECTURE)
    if taken:
        raise ValueError(f"family {family.name!r}: {taken} already served by "
                         f"{sorted({_BY_ARCHITECTURE[a].name for a in taken})}")
    _BY_ARCHITECTURE.update(dict.fromkeys(family.architectures, family))

    def unregister() -> None:
        for arch in family.architectures:
            if _BY_ARCHITECTURE.get(arch) is family:
                del _BY_ARCHITECTURE[arch]

    return unregister


def family_for(architecture: str) -> ModelFamily[Any]:
    try:
        return _BY_ARCHITECTURE[architecture]
    except KeyError:
        raise ValueError(f"model: unsupported architecture {architecture!r}; "
                         f"supported: {sorted(_BY_ARCHITECTURE)}") from None


def config_from_hf(d: dict[str, Any]) -> Any:
    architecture = (d.get("architectures") or [DEFAULT_ARCHITECTURE])[0]
    return family_for(architecture).config_from_hf(d)


def load_model_config(path: "str | ModelSource | None", load_format: str = "auto") -> Any:
    """Config from a GGUF file's metadata, an HF directory's config.json, or a config.json file."""
    source, d = read_config(path, load_format)
    try:
        return config_from_hf(d)
    except KeyError as e:
        raise ValueError(f"model: {source!r} lacks {e.args[0]!r}") from None


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor a complete checkpoint for `config` provides."""
    return family_for(config.architecture).weight_shapes(config)


def expected_weight_names(config: Any) -> set[str]:
    return set(weight_shapes(config))

"""Hugging Face model directories: config.json (+ generation_config.json) and *.safetensors."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors import safe_open

from ketch.weights.fp8_blocks import SCALE_SUFFIX, dequantize_fp8_blocks, fp8_block_size


_INDEX = "model.safetensors.index.json"


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model: cannot read {path!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model: {path!r} does not hold a JSON object")
    return data


def read_hf_config(config_path: str) -> tuple[str, dict[str, Any]]:
    """(the config.json path, its dict); `config_path` is a directory holding config.json, or the
    file itself. Chat models often list their end-of-turn token only in generation_config.json
    (Llama 3): its eos ids are merged into `eos_token_id` (a list)."""
    if os.path.isdir(config_path):
        config_path = os.path.join(config_path, "config.json")
    d = _read_json(config_path)
    gen_path = os.path.join(os.path.dirname(config_path), "generation_config.json")
    if os.path.isfile(gen_path):
        eos = [*_as_list(d.get("eos_token_id")), *_as_list(_read_json(gen_path).get("eos_token_id"))]
        d["eos_token_id"] = list(dict.fromkeys(int(e) for e in eos))
    return config_path, d


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [] if value is None else [value]


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, _INDEX)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"model: {index!r} has no weight_map")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {directory!r}")
    paths = [os.path.join(directory, f) for f in files]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"model: shard(s) listed in {_INDEX} are missing: {missing}")
    return paths


def _skip(name: str, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    # Old checkpoints store the rotary inv_freq buffer; tied ones sometimes store lm_head anyway.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and name not in shapes)


class SafetensorsWeights:
    """Iterates (name, tensor) over every shard, one tensor in memory at a time."""

    def __init__(self, directory: str, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                 fp32: tuple[str, ...] = ()) -> None:
        """shapes: the tensors the model expects (its family's `weight_shapes`); names ending in
        one of `fp32` are read in float32, not `dtype`. Block-scaled fp8 weights (fp8_blocks.py)
        come out dequantized; their scale tensors are not yielded."""
        self.dtype, self.fp32 = dtype, fp32
        self.fp8_block = fp8_block_size(read_hf_config(directory)[1])
        self.entries: list[tuple[str, str]] = []  # (file, tensor name), in file order
        self.scales: dict[str, str] = {}  # fp8 checkpoints: weight name -> the file of its scale
        self._scale_files: dict[str, Any] = {}  # path -> open safetensors handle
        for path in safetensors_files(directory):
            try:
                with safe_open(path, framework="pt") as f:
                    names = list(f.keys())
            except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
                raise ValueError(f"model: {path!r} is not a readable safetensors file: {e}") from None
            if self.fp8_block is not None:
                self.scales.update({n.removesuffix(SCALE_SUFFIX): path for n in names if n.endswith(SCALE_SUFFIX)})
                names = [n for n in names if not n.endswith(SCALE_SUFFIX)]
            self.entries += [(path, n) for n in names if not _skip(n, shapes)]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from self._tensors()
        finally:
            self._scale_files.clear()  # the scale shards' handles (and their mappings) go with the pass

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        handle, handle_path = None, None
        for path, name in self.entries:
            if path != handle_path:
                handle, handle_path = safe_open(path, framework="pt"), path
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"model: cannot read tensor {name!r} from {path!r}: {e}") from None
            if name in self.scales:
                tensor = self._dequantized(name, tensor)
            elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # its scales would be ignored
                raise ValueError(f"model: {name!r} is fp8 without a block scale (config.json's quantization_config "
                                 "must say quant_method fp8 with weight_block_size, and each fp8 weight carry "
                                 f"its {SCALE_SUFFIX})")
            yield name, tensor.to(torch.float32 if name.endswith(self.fp32) else self.dtype)

    def _dequantized(self, name: str, q: torch.Tensor) -> torch.Tensor:
        path = self.scales[name]
        if path not in self._scale_files:  # a shard's header is parsed once
            self._scale_files[path] = safe_open(path, framework="pt")
        scale = self._scale_files[path].get_tensor(name + SCALE_SUFFIX)
        assert self.fp8_block is not None  # scales are only collected for an fp8 checkpoint
        return dequantize_fp8_blocks(q, scale, self.fp8_block, name)

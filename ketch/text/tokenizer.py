"""Tokenizer: a thin, typed face over a transformers fast tokenizer, from a GGUF file or HF dir."""
from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from ketch.text.token_bound import max_bytes_per_token
from ketch.text.token_bytes import token_bytes
from ketch.text.tokenizer_cache import load_gguf_tokenizer
from ketch.weights.source import is_gguf_file, resolve_model_path

# End-of-turn markers of common chat templates. A chat model stops on these as well as on eos,
# but only when its template actually uses them (a base model's eos alone is right for it).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerUnavailable(ValueError):
    """The model has no tokenizer (e.g. dummy weights from a bare config): send token ids."""


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer
        template = getattr(hf_tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the unnamed one is "default"
            template = template.get("default")
        self.chat_template: str | None = template or None
        self.bos_token: str | None = hf_tokenizer.bos_token
        self.eos_token: str | None = hf_tokenizer.eos_token
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: tuple[int, ...] = tuple(hf_tokenizer.all_special_ids)
        self.eos_token_ids: tuple[int, ...] = self._find_eos_ids()
        # decode runs twice per streamed token (incremental detokenization): call the Rust
        # tokenizer itself where transformers' wrapper adds nothing (no space clean-up); its
        # Python layers cost ~3x the decode
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        fast = backend is not None and not getattr(hf_tokenizer, "clean_up_tokenization_spaces", True)
        self._fast_decode = backend.decode if fast else None
        self._bytes: dict[int, bytes] = {}  # token_bytes, per id (logprobs ask for the same ids often)

    @classmethod
    def load(cls, path: str | None = None, field: str = "model") -> "Tokenizer":
        """From a GGUF file (its embedded vocabulary) or an HF directory; None: the bundled model.
        field: the setting `path` came from, named in the errors (`ketch bench serve --tokenizer`)."""
        path = resolve_model_path(path)
        if not os.path.exists(path):
            raise ValueError(f"{field}: path {path!r} does not exist")
        if os.path.isfile(path) and is_gguf_file(path):
            # Not AutoTokenizer: it also parses the whole file with gguf.GGUFReader just to pick
            # a class (~6 s for the 135M model). Converted once per file (tokenizer_cache.py).
            try:
                hf = load_gguf_tokenizer(path)
            except Exception as e:  # a corrupt file surfaces as struct/Unicode/Key errors from the reader
                raise ValueError(f"{field}: cannot build a tokenizer from {path!r}: {type(e).__name__}: {e}") from None
            return cls(hf)
        if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            return cls(AutoTokenizer.from_pretrained(path))
        raise TokenizerUnavailable(
            f"tokenizer: {path!r} has no tokenizer (dummy weights from a bare config?); prompts must be token ids"
        )

    @property
    def hf(self) -> Any:
        """The wrapped transformers tokenizer, for what this class does not cover."""
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """The most bytes of text one token covers, where proven (token_bound.py), else None:
        a text of c characters then encodes to at least ceil(c / this) tokens."""
        return max_bytes_per_token(self._hf)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        decode = self._fast_decode or self._hf.decode
        return decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._hf.convert_ids_to_tokens(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, also when it holds only part of a character (token_bytes.py)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = token_bytes(self, token_id)
        return raw

    def token_to_id(self, token: str) -> int | None:
        tid = self._hf.convert_tokens_to_ids(token)
        return tid if isinstance(tid, int) and tid != self._hf.unk_token_id else None

    def _find_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        if self._hf.eos_token_id is not None:
            ids.append(self._hf.eos_token_id)
        for marker in _END_OF_TURN:
            if self.chat_template and marker in self.chat_template:
                tid = self.token_to_id(marker)
                if tid is not None:
                    ids.append(tid)
        return tuple(dict.fromkeys(ids))

"""Prompts become token ids on encoding threads, not on the event loop; one too long to fit is
refused before it is tokenized.

Tokenizing (and rendering a chat template) is CPU work in proportion to the text, about a second a
megabyte on a 2-core machine, and the body limit lets a request carry 32 MB. On the API process's
event loop that stalled every other request, stream and /health probe of the process for as long
(a 30 MB prompt: over a minute, for a 400 at the end). The Rust tokenizer releases the GIL while
it encodes, so on a thread the loop keeps serving. Two threads, as for grammar checks: a flood of
large prompts costs two cores' worth, not the loop. And where the tokenizer proves a bound on the
bytes one token covers (ketch/text/token_bound.py), a text whose length alone shows it has at
least max_model_len tokens is a 400 (`context_length_exceeded`) at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ketch.server.errors import APIError
from ketch.text.tokenizer import Tokenizer

_encoders = ThreadPoolExecutor(2, thread_name_prefix="ketch-encode")
T = TypeVar("T")


async def on_encoder_thread(encode: Callable[[], T]) -> T:
    """encode() on an encoding thread; the event loop serves other requests meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_encoders, encode)


def refuse_unfitting(tok: Tokenizer, text: str, max_model_len: int | None, param: str) -> None:
    """A 400 for a text of more characters than max_model_len - 1 tokens can cover (no tokenizing)."""
    per_token = tok.max_bytes_per_token
    if per_token is None or max_model_len is None:
        return
    least = -(-len(text) // per_token)  # characters <= bytes <= tokens x per_token
    if least >= max_model_len:
        raise APIError(400, f"{param}: the prompt has at least {least} tokens ({len(text)} characters, at most "
                       f"{per_token} bytes a token); the context length is {max_model_len}, so it may have at most "
                       f"{max_model_len - 1}", param=param, code="context_length_exceeded")

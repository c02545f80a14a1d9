"""`ketch serve`: load the tokenizer, start the engine process, wait for it, then serve HTTP.

The exit code is 0 after a normal shutdown (Ctrl-C / SIGTERM) and 1 when the engine process died
(or never became ready): a supervisor should restart a server whose engine is gone.
"""
from __future__ import annotations

import asyncio
import os
import sys

import uvicorn

from ketch.config import EngineConfig
from ketch.server.app import build_app
from ketch.server.client import EngineClient, EngineStartError
from ketch.server.state import ServerState
from ketch.text.chat_template import ChatTemplate
from ketch.text.tokenizer import Tokenizer, TokenizerUnavailable
from ketch.weights.source import default_model_path, detect_format


def _load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    path = config.model or default_model_path()
    if detect_format(path, config.load_format) == "dummy":
        return None
    try:
        return Tokenizer.load(path)
    except TokenizerUnavailable:
        return None


async def serve(config: EngineConfig, host: str, port: int, served_model_name: str | None = None,
                chat_template: str | None = None, api_key: str | None = None) -> int:
    tokenizer = _load_tokenizer(config)
    template_src = chat_template or (tokenizer.chat_template if tokenizer else None)
    template = ChatTemplate(template_src) if template_src else None
    client = EngineClient(config, tokenizer.eos_token_ids if tokenizer else ())
    try:
        ready = await client.start()
    except EngineStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    name = served_model_name or os.path.basename((config.model or default_model_path()).rstrip("/"))
    state = ServerState(client, tokenizer, template, name, api_key)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=10))
    client.on_death = lambda: setattr(server, "should_exit", True)
    print(f"ketch: serving {name} (context {ready.max_model_len}) on http://{host}:{port}", flush=True)
    try:
        await server.serve()
    finally:
        died = not client.alive and client.exitcode not in (None, 0)
        client.close()
    if died:
        print(f"error: the engine process exited (code {client.exitcode})", file=sys.stderr)
        return 1
    return 0


def run(config: EngineConfig, host: str, port: int, served_model_name: str | None = None,
        chat_template_file: str | None = None, api_key: str | None = None) -> int:
    template = None
    if chat_template_file:
        try:
            with open(chat_template_file) as f:
                template = f.read()
        except OSError as e:
            raise ValueError(f"chat_template: cannot read {chat_template_file!r} ({e.strerror})") from None
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(config, host, port, served_model_name, template, api_key))
    return uvloop.run(serve(config, host, port, served_model_name, template, api_key))

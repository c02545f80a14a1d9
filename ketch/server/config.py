"""`ketch serve`'s own settings (the engine's are in ketch.config.EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None  # default: the model file's or directory's name
    chat_template: str | None = None  # template text that replaces the model's
    api_key: str | None = None
    # sequences (prompts × n) the engine may hold beyond the running ones; None = no limit
    max_queued_requests: int | None = None
    max_request_bytes: int = 32 * 1024 * 1024  # larger bodies get a 413
    shutdown_timeout: float = 30.0  # SIGTERM: seconds in-flight requests get to finish
    tool_call_parser: str | None = None  # hermes | llama3 | mistral | deepseek-v3
    reasoning_parser: str | None = None  # deepseek-r1 | qwen3
    max_n: int = 128  # samples per prompt a request may ask for
    max_request_samples: int = 4096  # prompts x n one request may carry (checked before any is built)
    request_timeout: float | None = None  # default deadline of a request (its `timeout` field wins)
    watchdog_timeout: float = 300.0  # an engine silent (or stuck in a step) this long is declared hung
    max_connections: int | None = None  # open HTTP connections; more are answered 503 and closed
    header_timeout: float = 30.0  # seconds a connection may take to send a request's headers
    max_header_bytes: int = 64 * 1024  # a request's line and headers; more get a 431 (counted as they come)
    body_timeout: float = 60.0  # seconds a request may take to send its body
    # HTTP API processes on one port (SO_REUSEPORT), one engine; the queue and connection limits
    # are split evenly between them (each holds its share, rounded up)
    api_server_count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:  # (the kernel would take 83736 as 18200)
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {self.max_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if self.max_header_bytes < 1:
            raise ValueError(f"max_header_bytes: must be >= 1, got {self.max_header_bytes}")
        from ketch.parsers.registry import reasoning_parser_class, tool_parser_class

        if self.tool_call_parser is not None:
            tool_parser_class(self.tool_call_parser)  # ValueError naming the option if unknown
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)
        if not 0 <= self.shutdown_timeout < float("inf"):  # (nan passes a `< 0` test)
            raise ValueError(f"shutdown_timeout: must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.max_n < 1:
            raise ValueError(f"max_n: must be >= 1, got {self.max_n}")
        if self.max_request_samples < 1:
            raise ValueError(f"max_request_samples: must be >= 1, got {self.max_request_samples}")
        for name in ("request_timeout", "header_timeout", "body_timeout"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value}")
        if not 2.0 <= self.watchdog_timeout < float("inf"):  # several heartbeats must fit in it
            raise ValueError(f"watchdog_timeout: must be >= 2 seconds, got {self.watchdog_timeout}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count: must be >= 1, got {self.api_server_count}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {self.max_connections}")

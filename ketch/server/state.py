"""What every route needs: the engine client, the tokenizer, the chat template, the model's name,
the metrics and the admission count."""
from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ketch.server.client import EngineClient
from ketch.server.errors import APIError
from ketch.server.metrics import ServerMetrics
from ketch.text.chat_template import ChatTemplate
from ketch.text.tokenizer import Tokenizer

# A full queue's 429 says when to come back (RFC 9110 Retry-After, whole seconds): a slot frees
# when any sequence ends, which at decode speed is well within a second of a busy server; OpenAI's
# clients honour the header (the openai package waits it out before its own retry).
RETRY_AFTER_S = "1"


@dataclass
class Admission:
    """Sequences (prompts × n) in the engine, running or queued, as the API process counts them.

    The count moves when a request is sent and when each of its samples ends, so a full queue is
    known without asking the engine; beyond `limit` a request gets a 429 at once.
    """

    limit: int | None
    in_flight: int = 0
    # told every new count (the admitted-sequences gauge: with several API processes each one's
    # count must be current in its metric file, not only when a scrape reaches that process)
    watch: Callable[[int], None] | None = None

    def acquire(self, n: int, param: str = "n") -> None:
        """n sequences; `param`: the field to name when they could never fit ("prompt" when a
        batch of prompts with n = 1 is what makes them many)."""
        if self.limit is None:
            self._add(n)
            return
        if n > self.limit:
            raise APIError(400, f"{param}: this request needs {n} sequences (prompts × n); the server holds at most "
                                f"{self.limit} at a time", param=param)
        if self.in_flight + n > self.limit:
            raise APIError(429, f"the server is at capacity ({self.in_flight} of {self.limit} sequences running "
                                "or queued); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER_S})
        self._add(n)

    def release(self, n: int = 1) -> None:
        self._add(-n)
        assert self.in_flight >= 0, "admission released more than it acquired"

    def _add(self, n: int) -> None:
        self.in_flight += n
        if self.watch is not None:
            self.watch(self.in_flight)


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    model_name: str
    api_key: str | None = None
    admission: Admission = field(default_factory=lambda: Admission(None))
    tool_call_parser: str | None = None  # --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    max_n: int = 128  # --max-n
    max_request_samples: int = 4096  # --max-request-samples: prompts x n per request
    request_timeout: float | None = None  # --request-timeout: a request's deadline unless it sets one
    shutting_down: bool = False  # SIGTERM received: new generation requests get a 503

    def __post_init__(self) -> None:
        self.admission.watch = self.metrics.admitted.set

    def check_api_key(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        # bytes, not str: compare_digest refuses non-ASCII str (a header may carry any latin-1 byte)
        given = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.api_key.encode("utf-8")):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model: {name!r} is not served here (try {self.model_name!r})",
                           param="model", code="model_not_found")

    def require_tokenizer(self, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer; send token ids", param=param)
        return self.tokenizer

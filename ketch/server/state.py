"""What every route needs: the engine client, the tokenizer, the chat template, the model's name."""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from ketch.server.client import EngineClient
from ketch.server.errors import APIError
from ketch.text.chat_template import ChatTemplate
from ketch.text.tokenizer import Tokenizer


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    model_name: str
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def check_api_key(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.api_key):
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

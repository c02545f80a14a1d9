"""Text: tokenizer, chat templates, incremental detokenization and stop strings."""
from ketch.text.chat_template import ChatTemplate, render_chat, validate_messages
from ketch.text.detokenizer import IncrementalDetokenizer
from ketch.text.stop import StopChecker
from ketch.text.tokenizer import Tokenizer, TokenizerUnavailable

__all__ = [
    "ChatTemplate",
    "IncrementalDetokenizer",
    "StopChecker",
    "Tokenizer",
    "TokenizerUnavailable",
    "render_chat",
    "validate_messages",
]

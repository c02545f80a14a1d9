"""Save the bundled SmolLM2 GGUF's tokenizer as a Hugging Face tokenizer directory (3.5 MB), so a
device machine that cannot receive the 98 MB GGUF in one call can still serve dummy weights with
real text (`--tokenizer DIR`).

    python scripts/save_tokenizer.py carry/smollm2-tokenizer
"""
from __future__ import annotations

import sys

from ketch.text.tokenizer import Tokenizer

if __name__ == "__main__":
    Tokenizer.load().hf.save_pretrained(sys.argv[1] if len(sys.argv) > 1 else "carry/smollm2-tokenizer")

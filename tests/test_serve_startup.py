"""`ketch serve`'s start-up order: the API process launches the engine process before it imports
anything heavy, and hands it the tokenizer's EOS ids before it imports the web stack, so that the
engine's imports and build run beside those instead of after them (serve.py). Each check runs in a
fresh interpreter, since the test process has imported everything already."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "fastapi", "starlette", "transformers")


def modules_after(code: str) -> dict[str, list[str]]:
    """Run `code` in a fresh interpreter; it calls `mark(label)` to note which HEAVY modules are loaded."""
    prelude = ("import json, sys\nseen = {}\n"
               f"def mark(label): seen[label] = [m for m in {HEAVY!r} if m in sys.modules]\n")
    out = subprocess.run([sys.executable, "-c", prelude + code + "\nprint(json.dumps(seen))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_engine_launches_before_torch_or_the_web_stack_is_imported():
    """Everything `_serve` runs before `client.launch`: parse, build and check both configs, import
    serve.py. With the default device ("auto") too, whose CUDA check is the engine's."""
    seen = modules_after(
        "from ketch.cli import build_parser\n"
        "from ketch.cli_args import engine_kwargs\n"
        "from ketch.config import EngineConfig\n"
        "from ketch.server.config import ServerConfig\n"
        "import ketch.server.serve as serve\n"
        "for argv in (['serve'], ['serve', '--device', 'cpu', '--dtype', 'float32']):\n"
        "    a = build_parser().parse_args(argv)\n"
        "    config = EngineConfig(**engine_kwargs(a))\n"
        "    serve.check_bootstrap_port(config, ServerConfig(host=a.host, port=a.port))\n"
        "    serve.EngineClient(config, ()).close()\n"
        "mark('launch')\n")
    assert seen == {"launch": []}


LOAD_TOKENIZER = ("from ketch.config import EngineConfig\n"
                  "import ketch.server.serve as serve\n"
                  "tokenizer = serve.load_tokenizer(EngineConfig())\n"
                  "assert tokenizer is not None and tokenizer.eos_token_ids, tokenizer\n"
                  "mark('eos')\n")


@pytest.fixture(scope="module")
def tokenizer_cached() -> None:
    """The tokenizer as every start but a machine's first loads it: from the tokenizer cache
    (tokenizer_cache.py; conftest's, shared through the environment). The first start converts the
    GGUF's, which needs torch: this interpreter does that, filling the cache."""
    modules_after(LOAD_TOKENIZER)


def test_the_tokenizer_loads_without_torch_or_the_web_stack(tokenizer_cached):
    """What runs between the launch and `hand_eos` (transformers reads the tokenizer: expected)."""
    assert modules_after(LOAD_TOKENIZER) == {"eos": ["transformers"]}


def test_serve_hands_the_engine_its_eos_ids_before_it_imports_the_web_stack(tokenizer_cached):
    """The order inside `serve()`: a probe in place of `hand_eos` notes the modules loaded by then
    and stops the start there (the engine process, launched, ends at the closed pipe)."""
    seen = modules_after(
        "from ketch.config import EngineConfig\n"
        "from ketch.server.client import EngineClient, EngineStartError\n"
        "from ketch.server.config import ServerConfig\n"
        "import ketch.server.serve as serve\n"
        "def probe(client, eos_token_ids):\n"
        "    mark('hand_eos')\n"
        "    raise EngineStartError('the probe stops the start here')\n"
        "EngineClient.hand_eos = probe\n"
        "assert serve.run(EngineConfig(device='cpu', dtype='float32'), ServerConfig(port=0)) == 1\n")
    assert seen == {"hand_eos": ["transformers"]}

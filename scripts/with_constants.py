"""Run a ketch CLI command with module constants overridden: GPU sweeps of launch parameters
(a grid cap, a tile size) without a code change or an environment switch per parameter.

    python3 scripts/with_constants.py ketch.kernels.norm_gemv.PROGRAMS_PER_SM=3 -- bench one-batch --model ...

Each override is `package.module.NAME=VALUE`, VALUE a Python literal (ast.literal_eval). The
module is imported, NAME must exist already (a typo is an error, not a silent no-op) and keeps
its type; the command then runs in this process (ketch.cli.main), so code that reads the
constant at call time sees the new value. It does not reach a value copied at import time (a
default argument, another module's `from x import NAME`): check that the constant is read where
it is used before trusting a sweep of it. scripts/h200_ab.sh passes a variant's `ketch.*=`
assignments here.
"""
from __future__ import annotations

import ast
import importlib
import sys
from typing import Any


def parse_override(text: str) -> tuple[str, str, Any]:
    """'pkg.mod.NAME=VALUE' -> (module, name, value); ValueError naming what is wrong."""
    target, sep, raw = text.partition("=")
    module, dot, name = target.rpartition(".")
    if not sep or not dot or not module or not name:
        raise ValueError(f"override {text!r}: expected package.module.NAME=VALUE")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"override {text!r}: VALUE must be a Python literal ({e})") from None
    return module, name, value


def apply_override(text: str) -> tuple[Any, Any]:
    """Set the constant; (old value, new value)."""
    module_name, name, value = parse_override(text)
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"override {text!r}: {module_name} has no {name}")
    old = getattr(module, name)
    if type(old) is not type(value):
        raise ValueError(f"override {text!r}: {module_name}.{name} is a {type(old).__name__}, "
                         f"got a {type(value).__name__}")
    setattr(module, name, value)
    return old, value


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: with_constants.py pkg.mod.NAME=VALUE ... -- <ketch command>")
    split = argv.index("--")
    for text in argv[:split]:
        old, new = apply_override(text)
        print(f"constant {text.partition('=')[0]} = {new!r} (was {old!r})", flush=True)
    from ketch.cli import main as ketch_main
    return ketch_main(argv[split + 1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

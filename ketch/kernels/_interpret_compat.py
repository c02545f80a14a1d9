"""Triton 3.6's CPU interpreter vs numpy >= 2.4: the interpreter keeps scalars as 1-element
arrays and turns them into loop bounds with int(array), which numpy 2.4 refuses. Newer Triton
squeezes first; this does the same for the interpreter only (compiled kernels never see it)."""
from __future__ import annotations

import numpy as np


def patch_interpreter_scalar_index() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_ketch_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._ketch_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched

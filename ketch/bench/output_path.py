"""The argparse type of every bench flag that names a file to write (results, a trace)."""
from __future__ import annotations

import argparse
import os


def writable_path(text: str) -> str:
    """argparse type: a file path that can be written: not a folder, in a writable folder that
    exists, not an existing file we may not write. Checked when the flags are parsed, before a
    run whose results would otherwise be lost at its end."""
    path = os.path.abspath(text)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: name a file in it")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{folder!r} is not a writable directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text

"""The one check of an output path that the command lines take (``--json``), made before any work so that
minutes of results are never lost to a path that cannot be written at the end."""

from __future__ import annotations

import os


def check_writable_file(flag: str, path: str | os.PathLike) -> None:
    """``ValueError`` unless ``path`` names a file that can be written: not empty, not a directory, in an
    existing writable directory."""
    text = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(text))
    if not text or os.path.isdir(text) or not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ValueError(f"{flag} {text!r}: not a writable file path (its directory must exist and be writable)")

"""The one check of an output path that the command lines take (``--json``), made before any work so that
minutes of results are never lost to a path that cannot be written at the end."""

from __future__ import annotations

import os


def check_writable_file(flag: str, path: str | os.PathLike) -> None:
    """``ValueError`` unless ``path`` names a file that can be written now: it is opened for appending (which
    changes no byte of an existing file) and, if this made it, removed again. Asking the file system rather
    than inferring from its directory also refuses a name that is too long, a path that ends in a separator,
    and a file that exists but cannot be written."""
    text = os.fspath(path)
    existed = os.path.lexists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ValueError(f"{flag} {text!r}: not a writable file path ({reason})") from None
    if not existed:
        os.remove(text)

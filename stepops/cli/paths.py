"""The one check of an output path that the command lines take (``--json``), made before any work so that
minutes of results are never lost to a path that cannot be written at the end."""

from __future__ import annotations

import os


def check_writable_file(flag: str, path: str | os.PathLike) -> None:
    """``ValueError`` unless ``path`` names a file that can be written now: it is opened for appending (which
    changes no byte of an existing file) or created and removed again. Asking the file system rather
    than inferring from its directory also refuses a name that is too long, a path that ends in a separator,
    and a file that exists but cannot be written."""
    text = os.fspath(path)
    # Non-blocking: a FIFO without a reader is an error, not a wait. O_EXCL first, so that only a file this
    # check made is removed (not one another process made meanwhile, nor a symlink's target).
    flags = os.O_WRONLY | os.O_NONBLOCK
    try:
        try:
            os.close(os.open(text, flags | os.O_CREAT | os.O_EXCL))
            os.remove(text)
        except FileExistsError:
            os.close(os.open(text, flags | os.O_APPEND))
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ValueError(f"{flag} {text!r}: not a writable file path ({reason})") from None

"""The ``--device`` and ``--threads`` options every benchmark entry point takes, and its ``--json`` path,
checked before any work.

No torch import at module level: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="N",
                        help="CPU threads (default 1: on a shared machine more threads stall in OpenMP barriers)")


def check_device_argument(parser: argparse.ArgumentParser, device: str | None) -> None:
    """An argparse error for ``--device cuda`` where torch sees no CUDA device (it failed deep in torch)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch build sees no CUDA device; use --device cpu")


def check_json_argument(parser: argparse.ArgumentParser, path) -> None:
    """An argparse error, before any work, for a ``--json`` path that cannot be written (it failed with a
    traceback after the whole run)."""
    from stepops.cli.paths import check_writable_file

    if path is not None:
        try:
            check_writable_file("--json", path)
        except ValueError as error:
            parser.error(str(error))


def check_results_dir_argument(parser: argparse.ArgumentParser, directory) -> None:
    """An argparse error, before any work, for a ``--results-dir`` that cannot be made or written: it is
    created (with its parents) and a file in it created and removed again."""
    from stepops.cli.paths import check_writable_file

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--results-dir {str(directory)!r}: not a directory that can be made "
                     f"({error.strerror or type(error).__name__})")
    try:
        check_writable_file("--results-dir", directory / ".stepops-write-check")
    except ValueError as error:
        parser.error(str(error))


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

"""The ``python -m stepops`` command line: one module per subcommand (``layout`` and ``plan`` here, ``demo`` in
:mod:`stepops.demo`, the one demo module).

Each subcommand module has ``register(subparsers)``, which adds its parser and sets ``run`` (a function
of the parsed arguments returning the exit status) as the parser default. Adding a subcommand is a module
with ``register`` and one entry in ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from stepops import demo
from stepops.cli import layout, plan

_COMMANDS = (layout, plan, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stepops",
        description="stepops: cache ops for Step5 and Inkling hybrid-attention decoders.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

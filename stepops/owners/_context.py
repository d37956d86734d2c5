"""The forward context: the name -> layer mapping every owner registers itself in.

An engine keeps one such mapping per model (vLLM's ``static_forward_context``); stepops takes it as an
explicit argument so the owners need no engine. The allocator walks it to find every layer with a cache.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any


def register_layer(prefix: str, layer: object, static_forward_context: MutableMapping[str, Any]) -> None:
    """Record ``layer`` under ``prefix``; a second layer with the same name is a ``ValueError``."""
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"prefix must be a non-empty str, got {prefix!r}")
    if not isinstance(static_forward_context, MutableMapping):
        raise TypeError(
            f"static_forward_context must be a mutable mapping, got {type(static_forward_context).__name__}"
        )
    if prefix in static_forward_context:
        raise ValueError(f"Duplicate layer name: {prefix}")
    static_forward_context[prefix] = layer

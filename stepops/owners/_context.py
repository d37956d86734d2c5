"""What every owner shares: the forward context it registers in, the cache geometry of its backend, and its
layer name in front of the layouts' bind errors.

The forward context is the name -> layer mapping every owner registers itself in.

An engine keeps one such mapping per model (vLLM's ``static_forward_context``); stepops takes it as an
explicit argument so the owners need no engine. The allocator walks it to find every layer with a cache.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
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


@contextmanager
def naming_layer(name: str) -> Iterator[None]:
    """Re-raise a ``TypeError`` or ``ValueError`` of the block with ``name: `` in front: the layouts an owner
    binds through know no layer, and in a deep model "sconv SWA cache block size 2 ..." left the caller to
    find which one."""
    try:
        yield
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None


class BlockStridedBackend:
    """Cache geometry shared by the stepops backends: blocks outermost, one page per block.

    Blocks are read through ``stride(0)`` of a torch view, so a page padded by the unifier is strided past
    and its padding is never touched; the physical layout is the logical one. Subclasses name themselves
    and may reorder the other dims (:class:`stepops.owners.InklingSconvBackend` is head-major).
    """

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return True

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """NHD: ``(num_blocks, block_size, num_kv_heads, head_size)``."""
        return (num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Identity: physical layout == logical layout."""
        return (0, 1, 2, 3, 4) if include_num_layers_dimension else (0, 1, 2, 3)

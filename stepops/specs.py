"""KV-cache specs: what one layer asks of the paged KV cache, independent of any engine.

Modelled on the specs inference engines use to plan their paged caches (vLLM's ``kv_cache_interface``):
a spec says how many tokens one block holds (``block_size``), how wide each token is (``num_kv_heads``
heads of ``head_size`` key elements plus ``head_size_v`` value elements) and in which ``dtype``. One block
of a layer's cache is one *page* of ``page_size_bytes``. The page unifier (:mod:`stepops.allocator`)
makes every layer's page the same size; the owners (:mod:`stepops.owners`) emit these specs and bind the
caches the allocator makes.

``head_size_v`` defaults to ``head_size`` (a layer that stores K and V of the same width), as in vLLM.
Pass ``head_size_v=0`` for a layer that packs everything into ``head_size`` (the CSA tail ring, the
Inkling conv state, MLA-style latents).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def is_int(value: object) -> bool:
    """A Python or symbolic int, and not a bool or an enum member: those are int subclasses, and a flag or
    an enum member (``InklingStream.V`` is 1) passed as a size or an offset is a caller bug, not its value."""
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, (bool, enum.Enum))


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """An integer tensor dtype: not floating point, complex or bool (True would read as id or size 1)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_block_pages(what: str, kv_cache: torch.Tensor, page_elements: int) -> None:
    """``ValueError`` unless each block of ``kv_cache [num_blocks, ...]`` is one contiguous page and the
    blocks do not overlap (``stride(0) >= page_elements``). With one block the stride reaches nothing (and
    size-1 views leave it arbitrary), so it is not checked. The rule every cache bind shares."""
    if not kv_cache[0].is_contiguous():
        raise ValueError(
            f"{what} must be contiguous within a block, got shape {tuple(kv_cache.shape)} with strides "
            f"{kv_cache.stride()}"
        )
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) < page_elements:
        raise ValueError(
            f"{what} blocks overlap: block stride {kv_cache.stride(0)} elements is less than one "
            f"{page_elements}-element page"
        )


def check_fits_int64(name: str, value: object) -> None:
    """``ValueError`` for a Python int outside int64, which torch would refuse with an ``OverflowError``
    deeper down (a ``SymInt`` is one already)."""
    if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} = {value} does not fit in int64")


def check_int(name: str, value: object, minimum: int) -> None:
    """The package's one size check (also used by the layouts, the owners, the allocator, the models'
    configs and the demo): ``TypeError`` unless :func:`is_int`, ``ValueError`` below ``minimum`` or past
    int64 (:func:`check_fits_int64`)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    check_fits_int64(name, value)


def check_token_ids(name: str, ids: object, end: int) -> None:
    """A config's tuple of ids the model emits (its end-of-sequence ids): ``TypeError`` unless a tuple of
    ints, ``ValueError`` for an id outside ``[0, end)``."""
    if not isinstance(ids, tuple):
        raise TypeError(f"{name} must be a tuple of token ids, got {type(ids).__name__}")
    for token in ids:
        check_int(f"each of {name}", token, 0)
    check_ids_in_range(name, ids, end, "the ids the model emits")


def check_ids_in_range(what: str, ids: Sequence[int], end: int, which: str) -> None:
    """``ValueError`` naming the first of ``ids`` outside ``[0, end)`` (``which`` says what the range is)."""
    outside = [int(t) for t in ids if not 0 <= t < end]
    if outside:
        raise ValueError(f"{what}: token ids must be in [0, {end}) ({which}), got {outside[0]}")


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Paged KV cache of one attention-like layer: ``block_size`` tokens of ``num_kv_heads`` heads per page.

    Each token holds ``head_size`` key elements and ``head_size_v`` value elements per head
    (``head_size_v=None`` means ``head_size``; ``0`` means everything is packed into ``head_size``).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1)
        check_int("num_kv_heads", self.num_kv_heads, 1)
        check_int("head_size", self.head_size, 1)
        if self.head_size_v is None:
            # Frozen dataclass: the default is resolved once, here.
            object.__setattr__(self, "head_size_v", self.head_size)
        check_int("head_size_v", self.head_size_v, 0)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        # A page past int64 cannot be allocated, and sizes derived from it (per token, block strides) would
        # be nonsense: refuse it here, naming the fields it came from.
        check_fits_int64(
            f"page_size_bytes (block_size {self.block_size} x num_kv_heads {self.num_kv_heads} x (head_size "
            f"{self.head_size} + head_size_v {self.head_size_v}) x {self.dtype.itemsize} B)",
            self.page_size_bytes,
        )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block: ``block_size * num_kv_heads * (head_size + head_size_v) * itemsize``."""
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype.itemsize

    def with_block_size(self, block_size: int) -> AttentionSpec:
        """The same spec with another ``block_size`` (same type, every other field kept)."""
        return dataclasses.replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that keeps every token's K and V (full causal attention)."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer that only ever reads the last ``sliding_window`` tokens of each request.

    ``block_size`` may exceed ``sliding_window`` (the page unifier enlarges small pages that way).
    """

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sliding_window", self.sliding_window, 1)


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A layer that keeps a fixed-size ring of rows in each request's block (the Step5 CSA tail ring).

    Rows are addressed across blocks, so when the unifier pads this layer's page its block stride must
    be a whole number of ``block_stride_alignment`` bytes.
    """

    block_stride_alignment: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("block_stride_alignment", self.block_stride_alignment, 1)

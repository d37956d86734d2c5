"""The two cache layout contracts: where each model's cache state lives inside a KV page.

Plain Python over page sizes and tensor strides, independent of any engine. Ops, owners, the allocator
and the CLI all take their numbers from here, so the arithmetic (and its error messages) exists once.

- :class:`CSATailRingLayout` / :class:`BoundCSATailRing`: Step5's CSA tail ring. Each request owns one
  block of the ring's KV cache group; the block's page holds ``capacity`` rows of ``ROW_BYTES`` bytes
  (one bf16 ``[index_k | index_z]`` row per token), and position ``p`` lives at row ``p % capacity``.
- :class:`InklingConvStateLayout` / :class:`BoundInklingConvState`: Inkling's short-conv state. One HND
  sliding-window cache ``[num_blocks, H, N, D]`` per layer; ``D`` packs four conv streams per KV head.

See ``docs/layouts.md`` for pictures of both pages.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from stepops.specs import check_block_pages, check_fits_int64, check_int, is_int, is_integer_dtype

# One [index_k | index_z] bf16 row: (proxy_dim 256 + pooling logits 256) * 2 bytes.
ROW_BYTES = 1024

# A CSA region is 8 consecutive positions; the token that closes it replays the 7 before it, so a step may
# still read up to REPLAY_ROWS rows of the open region from before the step (the ring needs 7 + k rows).
REGION_SIZE = 8
REPLAY_ROWS = REGION_SIZE - 1

_BF16_BYTES = torch.bfloat16.itemsize

# Block sizes smallest_block_size tries: multiples of 16 up to 4096. Paged-attention backends want the
# main layer's block size to be a multiple of 16 (FlashAttention-style kernels tile tokens by 16), and a
# page beyond 4096 tokens is no longer a sensible --block-size.
BLOCK_SIZE_CANDIDATES: tuple[int, ...] = tuple(range(16, 4096 + 1, 16))


# --------------------------------------------------------------------------------------------------------
# Step5: the CSA tail ring
# --------------------------------------------------------------------------------------------------------


def check_ring_cache_blocks(kv_cache: torch.Tensor, name: str = "Step5 CSA tail ring cache") -> None:
    """``TypeError`` / ``ValueError`` naming ``name`` unless ``kv_cache`` is a bf16 tensor
    ``[num_blocks, ...]`` with ``num_blocks >= 1``: what a ring cache must be before its first page can be
    read."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {kv_cache.dtype}")
    if kv_cache.dim() < 2 or kv_cache.shape[0] == 0:
        raise ValueError(f"{name} must be [num_blocks, ...] with num_blocks >= 1, got shape {tuple(kv_cache.shape)}")


@dataclass(frozen=True)
class CSATailRingLayout:
    """The Step5 CSA tail ring inside one main-layer KV page.

    The ring shares the page size of the main attention layer (``page_bytes``, for that layer's
    ``block_size``) so the engine can unify page sizes across KV cache groups. The page is cut into
    ``capacity = page_bytes // row_bytes`` rows; position ``p`` of a request lives at row ``p % capacity``
    of the request's block. A verify step stores up to ``k + 1`` rows while the next step may still
    replay up to 7 earlier rows of the same region, so the ring needs ``required_rows = 7 + k`` rows.

    As a KV cache spec the ring declares the main layer's ``block_size``, one KV head and
    ``head_size = page_bytes // (block_size * 2)`` bf16 elements per token, which reproduces the page size.

    Raises ``ValueError``: the seed's message when the page holds fewer than ``7 + k`` whole rows; its own
    when the page has enough rows but is not a whole number of them, or is not a whole number of bf16
    elements per token.
    """

    page_bytes: int
    block_size: int
    num_speculative_tokens: int
    row_bytes: int = ROW_BYTES

    def __post_init__(self) -> None:
        check_int("page_bytes", self.page_bytes, 1)
        check_int("block_size", self.block_size, 1)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_int("row_bytes", self.row_bytes, 1)
        if self.row_bytes % _BF16_BYTES:
            raise ValueError(f"row_bytes must be a whole number of bf16 elements, got {self.row_bytes}")
        if self.page_bytes // self.row_bytes < self.required_rows:
            raise ValueError(
                f"Step5 CSA tail ring needs {self.required_rows} rows of "
                f"{self.row_bytes} bytes in one {self.page_bytes}-byte KV page; "
                "increase --block-size."
            )
        if self.page_bytes % self.row_bytes:
            # Enough rows, but a partial one: "increase" would be wrong advice (a smaller block may fit).
            raise ValueError(
                f"Step5 CSA tail ring: a {self.page_bytes}-byte KV page is not a whole number of "
                f"{self.row_bytes}-byte rows ({self.page_bytes / self.row_bytes:g}); the page must be a multiple of "
                f"{self.row_bytes} bytes (choose the block size accordingly)"
            )
        if self.page_bytes % (self.block_size * _BF16_BYTES):
            # The ring's spec would describe a smaller page than the main layer's and break page unification.
            raise ValueError(
                f"Step5 CSA tail ring: a {self.page_bytes}-byte KV page is not a whole number of bf16 "
                f"elements per token for block size {self.block_size}"
            )

    @property
    def required_rows(self) -> int:
        """Rows the ring must hold: 7 replayed rows of the open region + k speculative tokens."""
        return REPLAY_ROWS + self.num_speculative_tokens

    @property
    def capacity(self) -> int:
        """Rows in one page (>= ``required_rows``)."""
        return self.page_bytes // self.row_bytes

    @property
    def head_size(self) -> int:
        """bf16 elements per token in the ring's KV cache spec (one KV head, ``block_size`` tokens)."""
        return self.page_bytes // (self.block_size * _BF16_BYTES)

    @property
    def row_elements(self) -> int:
        """bf16 elements in one row."""
        return self.row_bytes // _BF16_BYTES

    def bind(self, kv_cache: torch.Tensor) -> BoundCSATailRing:
        """Bind the ring's cache tensor, allocated by the engine for this layout.

        ``kv_cache`` is bf16 with blocks along dim 0 (any shape inside a block, e.g.
        ``[num_blocks, block_size, 1, head_size]``); each block is contiguous and holds exactly one page
        (``capacity * row_elements`` elements). Blocks may be strided wider than the page
        (``stride(0) = rows_per_block * row_elements`` with ``rows_per_block >= capacity``); the rows
        between one block's ring and the next block belong to someone else.
        """
        check_ring_cache_blocks(kv_cache)
        row_elements = self.row_elements
        page_elements = self.capacity * row_elements
        if kv_cache[0].numel() != page_elements:
            raise ValueError(
                f"Step5 CSA tail ring cache block holds {kv_cache[0].numel()} elements, but the layout's "
                f"{self.page_bytes}-byte page is {page_elements} bf16 elements"
            )
        check_block_pages("Step5 CSA tail ring cache", kv_cache, page_elements)
        num_blocks = kv_cache.shape[0]
        # One block: no second ring to reach, so its stride (which size-1 views leave arbitrary) is unused.
        block_stride = kv_cache.stride(0) if num_blocks > 1 else page_elements
        if block_stride % row_elements:
            raise ValueError(
                f"Step5 CSA tail ring cache block stride {block_stride} is not a whole number of "
                f"{row_elements}-element rows"
            )
        rows_per_block = block_stride // row_elements
        # Block b's ring is rows [b * rows_per_block, + capacity); the view ends at the last ring's end,
        # so it never reaches past the tensor the engine handed over.
        rows = kv_cache.as_strided(
            ((num_blocks - 1) * rows_per_block + self.capacity, row_elements),
            (row_elements, 1),
        )
        return BoundCSATailRing(
            kv_cache=kv_cache,
            rows=rows,
            capacity=self.capacity,
            rows_per_block=rows_per_block,
            num_blocks=num_blocks,
        )


@dataclass(frozen=True)
class BoundCSATailRing:
    """A CSA tail ring bound to its cache tensor.

    ``rows`` is the 2-D bf16 view ``[(num_blocks - 1) * rows_per_block + capacity, row_elements]`` of the
    cache, as the seed builds it; block ``b``'s ring is rows ``[b * rows_per_block, + capacity)``. When
    blocks are strided wider than the page, ``rows`` also spans the gap rows between rings: address rows
    only through :meth:`row_index` and :meth:`block_rows`, which never reach them.
    """

    kv_cache: torch.Tensor
    rows: torch.Tensor
    capacity: int
    rows_per_block: int
    num_blocks: int

    @property
    def row_elements(self) -> int:
        """bf16 elements in one row."""
        return self.rows.shape[1]

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} out of range for a ring cache of {self.num_blocks} blocks")

    def row_index(self, block: int | torch.Tensor, position: int | torch.Tensor) -> int | torch.Tensor:
        """Row of ``rows`` that holds ``position`` of the request owning ``block``.

        ``block * rows_per_block + position % capacity``. Python ints are range-checked (``ValueError``
        for a negative position or a block outside ``[0, num_blocks)``); integer tensors (e.g. ``[T]``
        int32 on the device) are not, so the index stays free of host syncs: callers mask padding
        (block or position ``-1``) themselves.
        """
        for name, value in (("block", block), ("position", position)):
            if isinstance(value, torch.Tensor):
                if not is_integer_dtype(value.dtype):
                    raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
            else:
                check_int(name, value, 0)
        if not isinstance(block, torch.Tensor):
            self._check_block(block)
        offset = position.remainder(self.capacity) if isinstance(position, torch.Tensor) else position % self.capacity
        return block * self.rows_per_block + offset

    def block_rows(self, block: int) -> torch.Tensor:
        """``[capacity, row_elements]`` view of ``block``'s ring (row ``p % capacity`` holds position p)."""
        check_int("block", block, 0)
        self._check_block(block)
        start = block * self.rows_per_block
        return self.rows[start : start + self.capacity]


def smallest_block_size(
    *,
    bytes_per_token: int,
    num_speculative_tokens: int,
    row_bytes: int = ROW_BYTES,
    candidates: Iterable[int] = BLOCK_SIZE_CANDIDATES,
) -> int:
    """Smallest main-layer block size whose page (``block_size * bytes_per_token``) holds the ring.

    Tries ``candidates`` in increasing order (default :data:`BLOCK_SIZE_CANDIDATES`: multiples of 16 up
    to 4096) and returns the first for which :class:`CSATailRingLayout` accepts the page. Raises
    ``ValueError`` when none does (e.g. a per-token size that never fills whole rows).
    """
    check_int("bytes_per_token", bytes_per_token, 1)
    check_int("num_speculative_tokens", num_speculative_tokens, 0)
    for block_size in sorted(candidates):
        try:
            CSATailRingLayout(
                page_bytes=block_size * bytes_per_token,
                block_size=block_size,
                num_speculative_tokens=num_speculative_tokens,
                row_bytes=row_bytes,
            )
        except ValueError:
            continue
        return block_size
    raise ValueError(
        f"no candidate block size gives a page of whole {row_bytes}-byte rows holding "
        f"{REPLAY_ROWS + num_speculative_tokens} rows at {bytes_per_token} bytes per token"
    )


# --------------------------------------------------------------------------------------------------------
# Inkling: the short-conv state
# --------------------------------------------------------------------------------------------------------


class InklingStream(enum.IntEnum):
    """The four conv streams packed into each KV head's ``D``, in packing order."""

    K = 0  # k_proj output, per KV head: width head_dim
    V = 1  # v_proj output, per KV head: width head_dim
    ATTN_OUT = 2  # attention output, this head's hidden chunk: width hidden_per_head
    MLP_OUT = 3  # MLP output, this head's hidden chunk: width hidden_per_head


@dataclass(frozen=True)
class InklingConvStateLayout:
    """The Inkling short-conv state: one paged HND cache ``[num_blocks, H, N, D]`` per decoder layer.

    ``H = num_kv_heads // tp_size`` KV heads on this rank (whole heads only: ``tp_size <= num_kv_heads``);
    ``N`` tokens per block (``kernel_size`` by default; an engine may enlarge it, so bound caches read it
    from the tensor). Each head's ``D`` packs four streams: K ``[0, hd)``, V ``[hd, 2hd)``, attention
    output ``[2hd, 2hd + hph)``, MLP output ``[2hd + hph, 2hd + 2hph)`` with ``hd = head_dim`` and
    ``hph = ceil(hidden_size / num_kv_heads)``; ``D`` is the next power of two of ``2 hd + 2 hph`` so every
    layer's page has one size. ``D`` does not depend on ``tp_size``: heads and the hidden-sharded
    attention/MLP streams both scale by ``1 / tp_size``. bf16 only.

    A ``hidden_size`` that KV heads do not divide (transformers allows it) leaves the last head's chunks
    ``num_kv_heads * hph - hidden_size`` channels short: the layer pads the streams with zero channels
    (zero input, zero weight, so zero output and cache). Sharded (``tp_size > 1``) the hidden chunks must
    be equal: the collectives split the hidden stream evenly over the ranks.
    """

    num_kv_heads: int
    head_dim: int
    hidden_size: int
    kernel_size: int
    tp_size: int = 1
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "hidden_size", "kernel_size", "tp_size"):
            check_int(name, getattr(self, name), 1)
        if self.tp_size > self.num_kv_heads:
            raise ValueError(
                f"sconv SWA cache supports tp_size <= num_kv_heads ({self.num_kv_heads}), got {self.tp_size}"
            )
        if self.num_kv_heads % self.tp_size:
            raise ValueError(
                f"sconv SWA cache needs num_kv_heads ({self.num_kv_heads}) divisible by tp_size "
                f"({self.tp_size}): each rank holds whole KV heads"
            )
        if self.tp_size > 1 and self.hidden_size % self.num_kv_heads:
            raise ValueError(
                f"sconv SWA cache at tp_size {self.tp_size} needs hidden_size ({self.hidden_size}) divisible by "
                f"num_kv_heads ({self.num_kv_heads}): the ranks' hidden shards are whole, equal head chunks"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        if self.dtype != torch.bfloat16:
            raise ValueError(f"sconv SWA cache supports bfloat16 only, got {self.dtype}")
        check_fits_int64("sconv SWA cache head size D", self.head_size)

    @property
    def local_num_kv_heads(self) -> int:
        """``H``: KV heads on this rank."""
        return self.num_kv_heads // self.tp_size

    @property
    def hidden_per_head(self) -> int:
        """Width of each head's attention-output and MLP-output chunk: ``ceil(hidden_size / num_kv_heads)``."""
        return -(-self.hidden_size // self.num_kv_heads)

    @property
    def local_hidden_size(self) -> int:
        """Channels of the attention/MLP-output streams on this rank (``H * hidden_per_head``): the rank's
        hidden shard, or at ``tp_size`` 1 the hidden size padded to whole head chunks."""
        return self.local_num_kv_heads * self.hidden_per_head

    @property
    def hidden_padding(self) -> int:
        """Zero channels that fill the last head's chunks: ``num_kv_heads * hidden_per_head - hidden_size``
        (0 unless the KV heads do not divide ``hidden_size``, which only ``tp_size`` 1 allows)."""
        return self.num_kv_heads * self.hidden_per_head - self.hidden_size

    @property
    def packed_width(self) -> int:
        """Used part of ``D``: ``2 * head_dim + 2 * hidden_per_head``."""
        return 2 * self.head_dim + 2 * self.hidden_per_head

    @property
    def head_size(self) -> int:
        """``D``: ``packed_width`` rounded up to a power of two."""
        return 1 << (self.packed_width - 1).bit_length()

    @property
    def stream_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(offset, width)`` inside ``D`` of each stream, in :class:`InklingStream` order."""
        hd, hph = self.head_dim, self.hidden_per_head
        return ((0, hd), (hd, hd), (2 * hd, hph), (2 * hd + hph, hph))

    def stream_range(self, streams: InklingStream | tuple[InklingStream, ...]) -> tuple[int, int]:
        """``(offset, width)`` inside ``D`` of one stream, or of streams adjacent in packing order taken as
        one (``(K, V)``: offset 0, width ``2 * head_dim``, which one sconv call serves); ``ValueError`` for
        an unknown or non-adjacent stream.

        Indexes by ``int(stream)``: Dynamo (torch 2.13) recurses without end on ``InklingStream(x)`` and on
        indexing a tuple with an IntEnum, and this is called inside compiled layers.
        """
        as_tuple = streams if isinstance(streams, tuple) else (streams,)
        # An InklingStream, or an int by the package's one predicate: int() alone would take "1", 1.7, True or
        # another enum's member as V, and fail on "K" with a message naming no argument.
        if not all(isinstance(stream, InklingStream) or is_int(stream) for stream in as_tuple):
            raise TypeError(f"stream must be an InklingStream (or its int value), got {streams!r}")
        indices = [int(stream) for stream in as_tuple]
        if not indices or not all(0 <= index < len(InklingStream) for index in indices):
            raise ValueError(f"stream must be one of {[s.name for s in InklingStream]}, got {streams!r}")
        if any(b != a + 1 for a, b in zip(indices, indices[1:])):
            names = [InklingStream(index).name for index in indices]
            raise ValueError(f"streams {names} are not adjacent in packing order")
        return self.stream_ranges[indices[0]][0], sum(self.stream_ranges[index][1] for index in indices)

    def _block_size(self, block_size: int | None) -> int:
        if block_size is None:
            return self.kernel_size
        check_int("block_size", block_size, 1)
        if block_size < self.kernel_size:
            raise ValueError(
                f"sconv SWA cache block size {block_size} is smaller than the kernel size {self.kernel_size}"
            )
        return block_size

    def cache_shape(self, num_blocks: int, block_size: int | None = None) -> tuple[int, int, int, int]:
        """HND cache shape ``[num_blocks, H, N, D]``; ``N`` defaults to ``kernel_size``."""
        check_int("num_blocks", num_blocks, 1)
        return (num_blocks, self.local_num_kv_heads, self._block_size(block_size), self.head_size)

    def page_bytes(self, block_size: int | None = None) -> int:
        """Bytes of one block: ``H * N * D * 2``."""
        page_bytes = self.local_num_kv_heads * self._block_size(block_size) * self.head_size * self.dtype.itemsize
        check_fits_int64("sconv SWA cache page bytes (H * N * D * 2)", page_bytes)
        return page_bytes

    def bind(self, kv_cache: torch.Tensor) -> BoundInklingConvState:
        """Bind a layer's cache ``[num_blocks, H, N, D]`` bf16; ``N`` (>= ``kernel_size``) is read from it.

        Each block must be contiguous ``[H, N, D]``; blocks may be strided wider than one block (a
        page-strided view of a larger page).
        """
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        if kv_cache.dtype != self.dtype:
            raise TypeError(f"sconv SWA cache supports bfloat16 only, got {kv_cache.dtype}")
        if kv_cache.dim() != 4:
            raise ValueError(f"sconv SWA cache must be [num_blocks, H, N, D], got shape {tuple(kv_cache.shape)}")
        num_blocks, heads, block_size, head_size = kv_cache.shape
        if num_blocks < 1:
            raise ValueError("sconv SWA cache needs at least one block")
        if heads != self.local_num_kv_heads or head_size != self.head_size:
            raise ValueError(
                f"sconv SWA cache must have H = {self.local_num_kv_heads} and D = {self.head_size}, got shape "
                f"{tuple(kv_cache.shape)}"
            )
        self._block_size(block_size)  # its check: N >= kernel_size, as for cache_shape and page_bytes
        check_block_pages("sconv SWA cache", kv_cache, heads * block_size * head_size)
        return BoundInklingConvState(kv_cache=kv_cache, block_size=block_size, num_blocks=num_blocks)


@dataclass(frozen=True)
class BoundInklingConvState:
    """An Inkling conv-state cache bound to its tensor; token slot ``block * block_size + offset``."""

    kv_cache: torch.Tensor
    block_size: int
    num_blocks: int


# Illustrative production numbers, not a published configuration: a Llama-8B-shaped Inkling layer (8 KV
# heads of 128, hidden 4096, W = 4, so D = 2048). The layout CLI's defaults, and the shapes the GPU-build
# check compiles the sconv kernel for.
INKLING_EXAMPLE_LAYOUT = InklingConvStateLayout(num_kv_heads=8, head_dim=128, hidden_size=4096, kernel_size=4)

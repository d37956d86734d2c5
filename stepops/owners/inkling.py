"""Inkling's short-conv state owner and its dummy backend, engine-neutral.

One :class:`InklingConvState` per decoder layer emits one sliding-window KV cache spec whose page packs
the four conv streams per KV head (:class:`stepops.layouts.InklingConvStateLayout`), gets its HND cache
``[num_blocks, H, N, D]`` bound by the allocator, and runs ``stepops::sconv`` on it for one stream, or for
streams adjacent in ``D`` in one call (the layers' K+V). Tensor parallelism, the dtype and the forward
context are explicit arguments instead of engine globals.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

from stepops.layouts import BoundInklingConvState, InklingConvStateLayout, InklingStream
from stepops.ops.sconv import SconvMetadata, build_sconv_metadata, sconv
from stepops.owners._context import BlockStridedBackend, naming_layer, register_layer
from stepops.specs import SlidingWindowSpec


class InklingSconvMetadataBuilder:
    """Builds :class:`SconvMetadata` for one step of a bound conv-state cache (a thin
    :func:`build_sconv_metadata`). ``block_size`` is the bound cache's ``N``, which may exceed the
    kernel size."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        num_tokens: int,
    ) -> SconvMetadata:
        """``query_start_loc`` ``[R + 1]``, ``seq_lens`` ``[R]``, ``block_table`` ``[R, max_blocks]`` int;
        outputs are ``[num_tokens]`` int32 on the device."""
        return build_sconv_metadata(query_start_loc, seq_lens, block_table, self.block_size, num_tokens)


class InklingSconvBackend(BlockStridedBackend):
    """Custom dummy backend for the sconv sliding-window cache management."""

    @staticmethod
    def get_name() -> str:
        return "INKLING_SCONV_SWA"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """HND, num-blocks-first, head-major: ``(num_blocks, H, N, D)``."""
        return (num_blocks, num_kv_heads, block_size, head_size)

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("InklingSconvBackend has no attention impl; the conv runs out-of-band.")

    @staticmethod
    def get_builder_cls() -> type[InklingSconvMetadataBuilder]:
        return InklingSconvMetadataBuilder


class InklingConvState(nn.Module):
    """Per-decoder-layer owner emitting one sliding-window conv-state spec.

    The constructor's ``num_kv_heads`` counts every rank's heads; the attribute ``num_kv_heads`` is this
    rank's ``H`` (``tp_size <= num_kv_heads`` keeps whole heads per rank); ``head_size`` is the packed
    per-head width ``D`` (K + V + attention-output chunk + MLP-output chunk, rounded up to a power of two);
    ``stream_ranges`` the ``(offset, width)`` of each stream in :class:`InklingStream` order;
    ``sliding_window = block_size = kernel_size`` as declared (the bound cache's ``N`` may be larger: read it
    from ``kv_cache.shape[2]``). bf16 only. ``kv_cache`` is an empty placeholder until :meth:`bind_kv_cache`.
    """

    def __init__(
        self,
        *,
        num_kv_heads: int,
        head_dim: int,
        hidden_size: int,
        kernel_size: int,
        prefix: str,
        static_forward_context: MutableMapping[str, Any],
        tp_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        # The layout raises the seed's guardrail errors (tp_size <= num_kv_heads, bf16 only) before the
        # layer is registered, so a rejected layer never enters the context.
        self.layout = InklingConvStateLayout(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=hidden_size,
            kernel_size=kernel_size,
            tp_size=tp_size,
            dtype=dtype,
        )
        register_layer(prefix, self, static_forward_context)
        self.prefix = prefix
        self.kv_cache = torch.tensor([])
        self.num_kv_heads = self.layout.local_num_kv_heads
        self.head_size = self.layout.head_size
        self.sliding_window = kernel_size
        self.block_size = kernel_size
        self.stream_ranges: tuple[tuple[int, int], ...] = self.layout.stream_ranges
        self.dtype = dtype

    def forward(self) -> None:
        """Nothing: the owner only holds the cache; the conv runs through :meth:`conv`."""

    def get_attn_backend(self) -> type[InklingSconvBackend]:
        return InklingSconvBackend

    def get_kv_cache_spec(self) -> SlidingWindowSpec:
        return SlidingWindowSpec(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=0,  # all 4 streams packed into head_size
            dtype=self.dtype,
            sliding_window=self.sliding_window,
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Bind ``[num_blocks, H, N, D]`` bf16 (``N >= kernel_size``, blocks contiguous, stride(0) free)."""
        self.kv_cache = self._bound(kv_cache).kv_cache

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise what :meth:`bind_kv_cache` raises for ``kv_cache``, binding nothing."""
        self._bound(kv_cache)

    def _bound(self, kv_cache: torch.Tensor) -> BoundInklingConvState:
        """The layout's bind, its errors naming this layer."""
        with naming_layer(f"Inkling conv state {self.prefix}"):
            return self.layout.bind(kv_cache)

    def metadata_builder(self) -> InklingSconvMetadataBuilder:
        """A builder for this bound cache's metadata (it carries the bound ``N``)."""
        if self.kv_cache.dim() != 4:
            raise ValueError(f"Inkling conv state {self.prefix} has no cache bound yet")
        return InklingSconvMetadataBuilder(self.kv_cache.shape[2])

    def conv(
        self,
        streams: InklingStream | tuple[InklingStream, ...],
        x: torch.Tensor,
        weight: torch.Tensor,
        block_table: torch.Tensor,
        metadata: SconvMetadata,
        *,
        residual: bool = True,
        silu: bool = False,
        errors: torch.Tensor | None = None,
        validate: bool = False,
    ) -> torch.Tensor:
        """Run the short conv of one stream, or of streams adjacent in ``D`` in one launch, on ``x``
        ``[T, H * width]`` bf16 with ``weight`` ``[H * width, W]`` (``width``: the streams' widths summed;
        head ``h`` owns ``x`` columns ``[h * width, (h + 1) * width)``, each stream's part in packing
        order): store each token's input in the bound cache and return ``y`` ``[T, H * width]`` bf16 (see
        :func:`stepops.sconv`; ``errors`` is its optional device-side count of tokens with out-of-range
        ids). ``(InklingStream.K, InklingStream.V)`` is the layers' K+V call: ``[k_h | v_h]`` per head."""
        if self.kv_cache.dim() != 4:
            raise ValueError(f"Inkling conv state {self.prefix} has no cache bound yet")
        as_tuple = streams if isinstance(streams, tuple) else (streams,)
        # isinstance, not InklingStream(stream): Dynamo (torch 2.13) recurses without end on the latter.
        if not as_tuple or not all(isinstance(stream, InklingStream) for stream in as_tuple):
            raise TypeError(f"streams must be an InklingStream or a tuple of them, got {streams!r}")
        offset, width = self.layout.stream_range(as_tuple)
        if x.dim() != 2 or x.shape[1] != self.num_kv_heads * width:
            names = "+".join(stream.name for stream in as_tuple)
            raise ValueError(
                f"{names} stream input must be [T, {self.num_kv_heads * width}] (H * width), got {tuple(x.shape)}"
            )
        return sconv(
            x, weight, self.kv_cache, block_table, metadata, offset, residual=residual, silu=silu, errors=errors,
            validate=validate,
        )  # fmt: skip

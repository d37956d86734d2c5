"""A plain paged attention layer's cache owner: emits its spec, gets its cache bound.

The Step5 CSA tail ring derives its page from its main attention layer's spec, and the decoder layers
need a cache for their attention: :class:`PagedAttentionLayer` is that layer's engine-neutral owner. It
holds no attention math; it is the object the allocator asks for a spec and hands a cache to.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

from stepops.owners._context import BlockStridedBackend, register_layer
from stepops.specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec, check_block_pages


class PagedAttentionBackend(BlockStridedBackend):
    """Cache geometry of :class:`PagedAttentionLayer`: NHD ``[num_blocks, N, H, D_k + D_v]``.

    K and V of a token sit side by side in the last dimension (``[..., :head_size]`` is K,
    ``[..., head_size:]`` is V), so one block is one contiguous page and the page can be strided.
    """

    @staticmethod
    def get_name() -> str:
        return "STEPOPS_PAGED_ATTENTION"


class PagedAttentionLayer(nn.Module):
    """Owner of one paged attention layer's KV cache ``[num_blocks, N, H, head_size + head_size_v]``.

    Registers itself in ``static_forward_context`` under ``prefix``. Its spec is a
    :class:`FullAttentionSpec`, or a :class:`SlidingWindowSpec` when ``sliding_window`` is given.
    ``kv_cache`` is an empty placeholder until :meth:`bind_kv_cache`; the bound cache's ``N`` may be a
    multiple of ``block_size`` (the page unifier scales block sizes).
    """

    def __init__(
        self,
        *,
        prefix: str,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        static_forward_context: MutableMapping[str, Any],
        dtype: torch.dtype = torch.bfloat16,
        head_size_v: int | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        common = dict(
            block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size_v, dtype=dtype
        )
        # Built (and validated) before registering, so a bad layer never enters the context.
        self._spec: AttentionSpec = (
            FullAttentionSpec(**common)
            if sliding_window is None
            else SlidingWindowSpec(**common, sliding_window=sliding_window)
        )
        register_layer(prefix, self, static_forward_context)
        self.layer_name = prefix
        self.kv_cache = torch.tensor([])

    def get_kv_cache_spec(self) -> AttentionSpec:
        return self._spec

    def get_attn_backend(self) -> type[PagedAttentionBackend]:
        return PagedAttentionBackend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Bind ``[num_blocks, N, H, head_size + head_size_v]`` of the spec's dtype; blocks may be strided."""
        self.check_kv_cache(kv_cache)
        self.kv_cache = kv_cache

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise what :meth:`bind_kv_cache` raises for ``kv_cache``, binding nothing."""
        spec = self._spec
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        if kv_cache.dtype != spec.dtype:
            raise TypeError(f"{self.layer_name}: kv_cache must be {spec.dtype}, got {kv_cache.dtype}")
        width = spec.head_size + spec.head_size_v
        if (
            kv_cache.dim() != 4
            or kv_cache.shape[0] == 0
            or kv_cache.shape[1] == 0
            or kv_cache.shape[2] != spec.num_kv_heads
            or kv_cache.shape[3] != width
            or kv_cache.shape[1] % spec.block_size
        ):
            raise ValueError(
                f"{self.layer_name}: kv_cache must be [num_blocks, N, {spec.num_kv_heads}, {width}] with "
                f"num_blocks >= 1 and N a positive multiple of {spec.block_size}, got shape {tuple(kv_cache.shape)}"
            )
        check_block_pages(f"{self.layer_name}: kv_cache", kv_cache, kv_cache[0].numel())

    @property
    def key_cache(self) -> torch.Tensor:
        """``[num_blocks, N, H, head_size]`` view of the keys (e.g. for :func:`stepops.paged_kv_write`)."""
        return self.kv_cache[..., : self._spec.head_size]

    @property
    def value_cache(self) -> torch.Tensor:
        """``[num_blocks, N, H, head_size_v]`` view of the values."""
        return self.kv_cache[..., self._spec.head_size :]

"""Step5's CSA tail ring as a layer-side cache owner, engine-neutral.

The ring keeps the raw ``[index_k | index_z]`` rows of each request's open CSA region in one main KV page
(:class:`stepops.layouts.CSATailRingLayout`): the owner emits the ring's KV cache spec from its main
layer's spec, gets its cache bound by the allocator and calls ``stepops::csa_ring_update`` on it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from stepops.layouts import REPLAY_ROWS, ROW_BYTES, BoundCSATailRing, CSATailRingLayout, check_ring_cache_blocks
from stepops.ops.csa_ring_update import CSARingMetadata, build_csa_ring_metadata, csa_ring_update
from stepops.owners._context import BlockStridedBackend, naming_layer, register_layer
from stepops.specs import AttentionSpec, CircularBufferSpec, check_int


class Step5CSATailRingMetadataBuilder:
    """Builds :class:`CSARingMetadata` for one step of a bound ring (a thin :func:`build_csa_ring_metadata`).

    ``rows_per_block`` is the bound ring's block stride in rows; ``summary_block_size`` the block size of
    the summary cache's block table.
    """

    def __init__(self, rows_per_block: int, summary_block_size: int) -> None:
        self.rows_per_block = rows_per_block
        self.summary_block_size = summary_block_size

    def build(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        ring_blocks: torch.Tensor,
        summary_block_table: torch.Tensor,
        num_tokens: int,
    ) -> CSARingMetadata:
        """``query_start_loc`` ``[R + 1]``, ``seq_lens`` ``[R]``, ``ring_blocks`` ``[R]``,
        ``summary_block_table`` ``[R, max_blocks]`` int; outputs are ``[num_tokens]`` int32 on the device."""
        return build_csa_ring_metadata(
            query_start_loc,
            seq_lens,
            ring_blocks,
            self.rows_per_block,
            summary_block_table,
            self.summary_block_size,
            num_tokens,
        )


class Step5CSATailRingBackend(BlockStridedBackend):
    """Cache geometry of the ring: NHD ``[num_blocks, block_size, 1, head_size]`` bf16, rows across it."""

    @staticmethod
    def get_name() -> str:
        return "STEP5_CSA_TAIL_RING"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(
            "Step5CSATailRingBackend has no attention impl; the ring is written by csa_ring_update."
        )

    @staticmethod
    def get_builder_cls() -> type[Step5CSATailRingMetadataBuilder]:
        return Step5CSATailRingMetadataBuilder


class Step5CSATailRing(nn.Module):
    """Raw ``[index_k | index_z]`` rows of each request's open CSA region.

    A region summary is a fixed-order online softmax over its eight rows, so the rows are the whole
    state: the row that closes a region replays the other seven from here, and a rejected draft is undone
    by the next step overwriting its row. One verify step stores up to ``k + 1`` rows while the next step
    may still replay up to seven earlier rows of the same region, so the ring needs ``7 + k`` rows. It is
    sized to one page of the main layer (``main_layer_name`` in ``static_forward_context``) so that it
    shares the page size of the other KV cache groups.

    After :meth:`bind_kv_cache`: ``capacity`` rows per ring, ``rows_per_block`` rows between the starts of
    consecutive blocks (``> capacity`` when the page is padded, but for one block) and ``rows``, the 2-D
    ``[(num_blocks - 1) * rows_per_block + capacity, 512]`` bf16 view; block ``b``'s ring is rows
    ``[b * rows_per_block, + capacity)``.
    """

    def __init__(
        self,
        *,
        prefix: str,
        main_layer_name: str,
        num_speculative_tokens: int,
        static_forward_context: MutableMapping[str, Any],
    ) -> None:
        super().__init__()
        # Checked before registering, by the check CSATailRingLayout runs later (one implementation, same text).
        check_int("num_speculative_tokens", num_speculative_tokens, 0)
        if not isinstance(main_layer_name, str):  # a list failed at allocation as "unhashable type"
            raise TypeError(f"main_layer_name must be a layer name (str), got {type(main_layer_name).__name__}")
        register_layer(prefix, self, static_forward_context)
        self._static_forward_context = static_forward_context
        self.layer_name = prefix
        self.main_layer_name = main_layer_name
        self.num_speculative_tokens = num_speculative_tokens
        self.required_rows = REPLAY_ROWS + num_speculative_tokens
        self.kv_cache = torch.tensor([])
        self.rows = self.kv_cache
        self.capacity = 0
        self.rows_per_block = 0

    def _main_spec(self) -> AttentionSpec:
        main = self._static_forward_context.get(self.main_layer_name)
        if main is None:
            raise ValueError(
                f"Step5 CSA tail ring {self.layer_name}: main layer {self.main_layer_name!r} is not in the "
                "forward context"
            )
        if isinstance(main, Step5CSATailRing):
            raise ValueError(
                f"Step5 CSA tail ring {self.layer_name}: main layer {self.main_layer_name!r} is a CSA tail ring; "
                "name the attention layer whose KV page the ring shares"
            )
        if not callable(getattr(main, "get_kv_cache_spec", None)):
            raise TypeError(
                f"Step5 CSA tail ring {self.layer_name}: main layer {self.main_layer_name!r} has no "
                "get_kv_cache_spec()"
            )
        return main.get_kv_cache_spec()

    def get_kv_cache_spec(self) -> CircularBufferSpec:
        """One main page of ``capacity`` 1 KB rows, declared with the main layer's block size.

        Declaring the main block size keeps the ring from coarsening the hybrid prefix-cache alignment.
        Raises ``ValueError``: the seed's text when the page holds fewer than ``7 + k`` whole rows, the
        layout's own when it is not whole rows.
        """
        main_spec = self._main_spec()
        layout = CSATailRingLayout(
            page_bytes=main_spec.page_size_bytes,
            block_size=main_spec.block_size,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        # The spec only sizes the page: capacity and rows_per_block are the bound cache's (bind_kv_cache), and
        # a spec asked for again after binding must not change what update() passes to the op.
        return CircularBufferSpec(
            block_size=main_spec.block_size,
            num_kv_heads=1,
            head_size=layout.head_size,
            head_size_v=0,
            dtype=torch.bfloat16,
            # Rows are addressed across blocks, which may be strided.
            block_stride_alignment=ROW_BYTES,
        )

    def get_attn_backend(self) -> type[Step5CSATailRingBackend]:
        return Step5CSATailRingBackend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Bind the ring's bf16 cache ``[num_blocks, ...]`` (one contiguous page per block, any stride(0)).

        ``capacity`` comes from the page (``kv_cache[0]``), ``rows_per_block`` from ``stride(0)``; a stride
        that is not whole rows or overlaps pages, or a page that is not ``7 + k`` or more whole rows, is a
        ``ValueError`` naming the bound tensor (not the seed's block-size advice, which is for the spec).
        """
        bound = self._bound_ring(kv_cache)
        self.kv_cache = bound.kv_cache
        self.capacity = bound.capacity
        self.rows_per_block = bound.rows_per_block
        self.rows = bound.rows

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise what :meth:`bind_kv_cache` raises for ``kv_cache``, binding nothing."""
        self._bound_ring(kv_cache)

    def _bound_ring(self, kv_cache: torch.Tensor) -> BoundCSATailRing:
        """The ring laid over ``kv_cache`` after the checks :meth:`bind_kv_cache` documents."""
        check_ring_cache_blocks(kv_cache, f"Step5 CSA tail ring {self.layer_name}: kv_cache")
        # The page was sized by get_kv_cache_spec (whose error suggests a larger --block-size); a bound block
        # that is not whole rows, or too few of them, means the tensor handed over is wrong, so say that.
        page_bytes = kv_cache[0].numel() * kv_cache.element_size()
        if page_bytes % ROW_BYTES or page_bytes // ROW_BYTES < self.required_rows:
            raise ValueError(
                f"Step5 CSA tail ring {self.layer_name}: a bound cache block of {page_bytes} bytes "
                f"(shape {tuple(kv_cache.shape[1:])}, {kv_cache.dtype}) is not {self.required_rows} or more whole "
                f"{ROW_BYTES}-byte rows; bind the cache allocated for this ring's get_kv_cache_spec()"
            )
        # block_size=1: the bound page only has to be whole rows; the per-token split was checked by the spec.
        layout = CSATailRingLayout(
            page_bytes=page_bytes, block_size=1, num_speculative_tokens=self.num_speculative_tokens
        )
        with naming_layer(f"Step5 CSA tail ring {self.layer_name}"):
            return layout.bind(kv_cache)

    def metadata_builder(self, summary_block_size: int) -> Step5CSATailRingMetadataBuilder:
        """A builder for this bound ring's metadata (it carries ``rows_per_block``)."""
        if self.rows_per_block == 0:
            raise ValueError(f"Step5 CSA tail ring {self.layer_name} has no cache bound yet")
        return Step5CSATailRingMetadataBuilder(self.rows_per_block, summary_block_size)

    def metadata(self, attn_metadata: Mapping[str, Any]) -> CSARingMetadata:
        """This layer's entry of a step's per-layer metadata mapping (an engine's ``attn_metadata``)."""
        if not isinstance(attn_metadata, Mapping):
            raise TypeError(
                f"attn_metadata must be a mapping of layer name to metadata, got {type(attn_metadata).__name__}"
            )
        if self.layer_name not in attn_metadata:
            raise ValueError(f"attn_metadata has no entry for layer {self.layer_name}")
        metadata = attn_metadata[self.layer_name]
        if not isinstance(metadata, CSARingMetadata):
            raise TypeError(f"metadata of {self.layer_name} must be CSARingMetadata, got {type(metadata).__name__}")
        return metadata

    def update(
        self,
        index_k: torch.Tensor,
        index_z: torch.Tensor,
        summary_cache: torch.Tensor,
        metadata: CSARingMetadata,
        *,
        errors: torch.Tensor | None = None,
        validate: bool = False,
    ) -> None:
        """Store the step's rows ``index_k``, ``index_z`` ``[T, 256]`` bf16 in the bound ring and write the
        summary of every region a token closes into ``summary_cache`` (see :func:`stepops.csa_ring_update`;
        ``errors`` is its optional device-side count of tokens with out-of-range ids)."""
        if self.rows_per_block == 0:
            raise ValueError(f"Step5 CSA tail ring {self.layer_name} has no cache bound yet")
        csa_ring_update(
            index_k, index_z, self.rows, summary_cache, metadata, self.capacity,
            errors=errors, validate=validate, rows_per_block=self.rows_per_block,
        )  # fmt: skip

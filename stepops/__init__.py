"""stepops: cache ops for Step5 and Inkling hybrid-attention decoders.

Importing the package declares every ``torch.ops.stepops`` op. The public API, bottom layer first:
layout contracts and KV-cache specs, the ops' wrappers and metadata builders, the seeds' cache owners and
the page allocator. Decoder layers live in :mod:`stepops.models`, test support in :mod:`stepops.testing`.
"""

from stepops.layouts import (
    ROW_BYTES,
    BoundCSATailRing,
    BoundInklingConvState,
    CSATailRingLayout,
    InklingConvStateLayout,
    InklingStream,
    smallest_block_size,
)
from stepops.specs import AttentionSpec, CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec
from stepops.ops.bounds import error_counter
from stepops.ops.csa_ring_update import CSARingMetadata, build_csa_ring_metadata, csa_ring_update
from stepops.ops.paged_kv_write import paged_kv_write
from stepops.ops.sconv import SconvMetadata, build_sconv_metadata, sconv
from stepops.owners import (
    InklingConvState,
    InklingSconvBackend,
    InklingSconvMetadataBuilder,
    PagedAttentionBackend,
    PagedAttentionLayer,
    Step5CSATailRing,
    Step5CSATailRingBackend,
    Step5CSATailRingMetadataBuilder,
)
from stepops.allocator import KVCaches, LayerKVCache, UnifiedPages, allocate_kv_caches, unify_page_sizes

__all__ = [
    # layouts and specs
    "ROW_BYTES",
    "BoundCSATailRing",
    "BoundInklingConvState",
    "CSATailRingLayout",
    "InklingConvStateLayout",
    "InklingStream",
    "smallest_block_size",
    "AttentionSpec",
    "CircularBufferSpec",
    "FullAttentionSpec",
    "SlidingWindowSpec",
    # ops
    "error_counter",
    "CSARingMetadata",
    "build_csa_ring_metadata",
    "csa_ring_update",
    "paged_kv_write",
    "SconvMetadata",
    "build_sconv_metadata",
    "sconv",
    # owners and allocation
    "InklingConvState",
    "InklingSconvBackend",
    "InklingSconvMetadataBuilder",
    "PagedAttentionBackend",
    "PagedAttentionLayer",
    "Step5CSATailRing",
    "Step5CSATailRingBackend",
    "Step5CSATailRingMetadataBuilder",
    "KVCaches",
    "LayerKVCache",
    "UnifiedPages",
    "allocate_kv_caches",
    "unify_page_sizes",
]

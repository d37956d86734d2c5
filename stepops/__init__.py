"""stepops: cache ops for Step5 and Inkling hybrid-attention decoders.

Importing the package declares every ``torch.ops.stepops`` op.
"""

from stepops import ops  # noqa: F401  (declares the ops)
from stepops.ops.sconv import SconvMetadata, build_sconv_metadata, sconv  # noqa: F401
from stepops.ops.csa_ring_update import CSARingMetadata, build_csa_ring_metadata, csa_ring_update  # noqa: F401
from stepops.layouts import (  # noqa: F401  (public API)
    ROW_BYTES,
    BoundCSATailRing,
    BoundInklingConvState,
    CSATailRingLayout,
    InklingConvStateLayout,
    InklingStream,
    smallest_block_size,
)
from stepops.specs import AttentionSpec, CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec  # noqa: F401
from stepops.owners import (  # noqa: F401  (the seeds' cache owners, engine-neutral)
    InklingConvState,
    InklingSconvBackend,
    InklingSconvMetadataBuilder,
    PagedAttentionBackend,
    PagedAttentionLayer,
    Step5CSATailRing,
    Step5CSATailRingBackend,
    Step5CSATailRingMetadataBuilder,
)
from stepops.allocator import KVCaches, LayerKVCache, UnifiedPages, allocate_kv_caches, unify_page_sizes  # noqa: F401

"""Layer-side cache owners: the seeds' classes, engine-neutral.

Each owner registers itself in a forward context (a plain ``dict`` of layer name -> layer), emits a KV
cache spec (:mod:`stepops.specs`), names a backend that gives its cache's shape, receives its cache from
:func:`stepops.allocator.allocate_kv_caches` through ``bind_kv_cache`` (after ``check_kv_cache`` has
accepted every layer's view) and calls its op on it.
"""

from stepops.owners._context import register_layer
from stepops.owners.attention import PagedAttentionBackend, PagedAttentionLayer
from stepops.owners.inkling import InklingConvState, InklingSconvBackend, InklingSconvMetadataBuilder
from stepops.owners.step5 import Step5CSATailRing, Step5CSATailRingBackend, Step5CSATailRingMetadataBuilder

__all__ = [
    "InklingConvState",
    "InklingSconvBackend",
    "InklingSconvMetadataBuilder",
    "PagedAttentionBackend",
    "PagedAttentionLayer",
    "Step5CSATailRing",
    "Step5CSATailRingBackend",
    "Step5CSATailRingMetadataBuilder",
    "register_layer",
]

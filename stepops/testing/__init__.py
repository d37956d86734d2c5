"""Test support shared by tests/ and benchmarks/: the sample registry, the opcheck policy, tolerances.

Its modules also hold the models' no-cache recomputes, the dense attention oracle, the GPU-build check and
the indexing that lets fake CUDA tensors run the models' CUDA path on a CPU-only wheel.
Builds on ``stepops.ops`` and ``stepops.models``; no other module of the package imports it.
"""

from stepops.testing.storage import StorageSnapshot, copy_as_views, storage_bytes
from stepops.testing.registry import (
    OPCHECK_UTILS,
    OpErrorInput,
    OpSample,
    op_error_inputs,
    op_samples,
    run_opcheck,
)
from stepops.testing.tolerances import INDUCTOR_KEEPS_BF16_ROUNDINGS, TOLERANCES, Tolerance

__all__ = [
    "INDUCTOR_KEEPS_BF16_ROUNDINGS",
    "OPCHECK_UTILS",
    "OpErrorInput",
    "OpSample",
    "StorageSnapshot",
    "TOLERANCES",
    "Tolerance",
    "copy_as_views",
    "op_error_inputs",
    "op_samples",
    "run_opcheck",
    "storage_bytes",
]

"""Test support shared by tests/ and benchmarks/: the sample registry, the opcheck policy, tolerances.

Builds on ``stepops.ops`` (the samples call the ops); no op module imports this package.
"""

from stepops.testing.storage import StorageSnapshot
from stepops.testing.registry import OPCHECK_UTILS, OpErrorInput, OpSample, op_error_inputs, op_samples
from stepops.testing.tolerances import TOLERANCES, Tolerance

__all__ = [
    "OPCHECK_UTILS",
    "OpErrorInput",
    "OpSample",
    "StorageSnapshot",
    "TOLERANCES",
    "Tolerance",
    "op_error_inputs",
    "op_samples",
]

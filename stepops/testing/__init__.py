"""Test support shared by tests/ and benchmarks/: the sample registry, the opcheck policy, tolerances.

Builds on ``stepops.ops`` (the samples call the ops); no op module imports this package.
"""

from stepops.testing.registry import OPCHECK_UTILS, OpSample, op_samples
from stepops.testing.tolerances import TOLERANCES, Tolerance

__all__ = ["OPCHECK_UTILS", "OpSample", "TOLERANCES", "Tolerance", "op_samples"]

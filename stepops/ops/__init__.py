"""The stepops custom ops, one package per op (schema, wrapper, kernels, samples).

Importing this package declares every ``torch.ops.stepops`` op.
"""

from stepops.ops import csa_ring_update, paged_kv_write, sconv  # noqa: F401

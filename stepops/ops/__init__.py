"""The stepops custom ops, one package per op (schema, wrapper, kernels, samples)."""
from stepops.ops import csa_ring_update  # noqa: E402, F401
from stepops.ops import paged_kv_write  # noqa: E402, F401
from stepops.ops import sconv  # noqa: E402, F401

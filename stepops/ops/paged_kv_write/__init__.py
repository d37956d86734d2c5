"""``stepops::paged_kv_write``: store each token's key and value rows at its slot of a paged KV cache.

The attention layers of both models write their new keys and values through this op before reading the
cache; see :func:`stepops.ops.paged_kv_write.torch_kernel.paged_kv_write_torch` for the semantics.

Files: ``op.py`` declares the op and holds the public wrapper, ``validate.py`` the host validator,
``torch_kernel.py`` the CPU kernel (the specification), ``triton_kernel.py`` the CUDA kernel,
``samples.py`` the sample and error inputs, ``reference.py`` the naive reference (test support; nothing
here imports it).
"""

from stepops.ops.paged_kv_write.op import paged_kv_write
from stepops.ops.paged_kv_write.validate import validate_paged_kv_write_inputs

__all__ = ["paged_kv_write", "validate_paged_kv_write_inputs"]

"""``stepops::sconv``: Inkling's fused store-and-convolve over the paged HND conv-state cache.

One call handles one conv stream (K, V, attention output or MLP output) of one decoder layer for a whole
ragged step (prefill chunks, decode and speculative verify tokens mixed): it stores each token's input at
its position's slot inside the stream's D-range and returns the depthwise causal convolution of width W
plus the residual. The formula and invariants are in :func:`sconv_torch`'s docstring (the op's
documentation) and ``docs/ops.md``.

Files: ``op.py`` declares the op and holds the public wrapper, ``validate.py`` the host validator,
``torch_kernel.py`` the CPU kernel (the specification), ``triton_kernel.py`` the CUDA kernel,
``metadata.py`` the per-step metadata builder, ``samples.py`` the sample and error inputs,
``reference.py`` the naive reference (test support; nothing here imports it).
"""

from stepops.ops.sconv.metadata import SconvMetadata, build_sconv_metadata
from stepops.ops.sconv.op import sconv
from stepops.ops.sconv.validate import validate_sconv_inputs

__all__ = ["SconvMetadata", "build_sconv_metadata", "sconv", "validate_sconv_inputs"]

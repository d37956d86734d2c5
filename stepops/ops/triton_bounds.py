"""Triton side of :mod:`stepops.ops.bounds`: address masks and the device-side error counter."""

import triton
import triton.language as tl


@triton.jit
def in_extent(index, extent):
    """True where ``index`` addresses one of ``extent`` rows: the mask every data-derived address gets."""
    return (index >= 0) & (index < extent)


@triton.jit
def bad_id(index, extent):
    """True where ``index`` is neither the padding id -1 nor inside ``extent``: an error to count."""
    return (index != -1) & ((index < 0) | (index >= extent))


@triton.jit
def count_error(errors_ptr, bad, HAS_ERRORS: tl.constexpr):
    """Add 1 to the ``errors`` counter for a token with a bad id (one scalar ``bad`` per token)."""
    if HAS_ERRORS:
        if bad:
            tl.atomic_add(errors_ptr, 1)

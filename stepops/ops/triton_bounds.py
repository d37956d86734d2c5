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


@triton.jit
def block_and(mask, cond):
    """``mask & cond`` for a block ``mask`` and a scalar ``cond`` (one per program, e.g. from a token's
    metadata), as a block mask. Written out because triton 3.9's interpreter gives ``mask & cond`` an int32
    payload that ``tl.load`` rejects as a mask; on a GPU the scalar stays uniform, no per-lane work."""
    return mask & (cond.to(tl.int32) + tl.zeros_like(mask.to(tl.int32)) != 0)

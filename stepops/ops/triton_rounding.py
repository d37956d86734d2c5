"""Round-to-nearest-even conversions for Triton kernels, done with integer operations on the bits.

The Triton interpreter's fp32 -> bf16 cast truncates and its bf16 -> float8_e4m3fn cast differs from
PyTorch's on a few percent of values; on a GPU both casts round to nearest even. These helpers give
PyTorch's bits on a GPU and under the interpreter alike, so kernels can be compared bit for bit on a CPU
machine; in memory-bound kernels the few integer ops cost nothing measurable.
"""

import torch
import triton
import triton.language as tl

# The largest finite float8_e4m3fn value (448); codes saturate to it.
FP8_E4M3_MAX = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)
# e4m3fn's only NaN encoding (exponent and mantissa all ones) without its sign bit.
_FP8_E4M3_NAN_CODE = tl.constexpr(0x7F)
# Smallest normal float8_e4m3fn, 2**-6; below it the code counts subnormal steps of 2**-9.
_FP8_E4M3_MIN_NORMAL = tl.constexpr(0.015625)


@triton.jit
def round_fp32_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32 (its low 16 bits are zero).

    Adding ``0x7FFF + lsb`` before dropping the low 16 bits is PyTorch's rounding. A NaN is not rounded (the
    carry could turn it into Inf or flip its sign): it keeps its sign and high bits with the quiet bit set,
    so its low 16 bits are zero too and any later cast to bf16, truncating or not, is a NaN (``0x7F800001``
    truncated is Inf). fp32 subnormals: the interpreter (numpy) flushes them.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    quiet_nan = (bits | 0x00400000) & 0xFFFF0000
    return tl.where(x != x, quiet_nan, rounded).to(tl.float32, bitcast=True)


@triton.jit
def fp8_e4m3_code(x):
    """Code (uint8) of the float8_e4m3fn nearest to ``x`` (fp32), ties to even, saturating at +-448 (Inf
    included) where PyTorch's cast of an out-of-range value is platform-defined. NaN gives e4m3fn's NaN
    code with ``x``'s sign, ``0x7F`` or ``0xFF``, as PyTorch's cast does (a GPU's ``tl.minimum`` drops NaN,
    so NaN is selected explicitly rather than left to the clamp)."""
    sign = (x.to(tl.uint32, bitcast=True) >> 31) << 7
    is_nan = x != x
    # NaN lanes compute on 0 and are replaced at the end: no NaN arithmetic, no NaN -> int cast.
    ax = tl.where(is_nan, 0.0, tl.minimum(tl.abs(x), FP8_E4M3_MAX))
    bits = ax.to(tl.uint32, bitcast=True)
    # Normal: round the fp32 mantissa to 3 bits; (bits >> 20) is then (fp32 exponent << 3) | mantissa, and
    # rebasing the exponent from bias 127 to bias 7 subtracts 120 << 3.
    rounded = (bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal: the code is |x| / 2**-9 rounded to an integer (ties to even, via the 2**23 magic add; the
    # product is exact). A result of 8 is the code of 2**-6, the smallest normal, as it should be.
    subnormal = ((ax * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(ax < _FP8_E4M3_MIN_NORMAL, subnormal, normal)
    code = tl.where(is_nan, _FP8_E4M3_NAN_CODE, code)
    return (code | sign).to(tl.uint8)

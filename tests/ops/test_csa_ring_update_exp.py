"""The ``exp`` of ``csa_ring_update``'s fold, alone: both kernels' ``exp_fp32`` bit for bit against an
independent numpy implementation, in fp32 before any rounding to bf16; its accuracy; and the one-exp fold
step against the two-exp formula the op documents.

The reference is the op's naive reference, ``stepops.ops.csa_ring_update.reference.numpy_exp``, written from
the documented algorithm with its own constants (see that module). A wrong constant, a changed operation
order or a fused multiply-add in either kernel changes bits on this sample.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import triton_device
from csa_ring_update_helpers import assert_same_bits_or_both_nan, fp32_bits, special_logits
from stepops.ops.csa_ring_update import torch_kernel
from stepops.ops.csa_ring_update.reference import BELOW_IS_ZERO, fold, numpy_exp
from stepops.ops.csa_ring_update.triton_kernel import exp_fp32 as triton_exp_fp32

_F = np.float32


def _halfway_inputs() -> np.ndarray:
    """Every fp32 x in [-87.5, 0] whose fp32 product ``x * log2(e)`` is exactly ``-(k + 1/2)``: where the
    reduction's ``n = floor(x log2e + 1/2)`` and round-half-to-even pick different ``n`` (1 in 8000 of the
    sampled patterns would only reach them by chance)."""
    log2e = _F(1 / np.log(2))
    centers = (-(np.arange(126) + 0.5) * np.log(2)).astype(_F).view(np.uint32).astype(np.int64)
    candidates = (centers[:, None] + np.arange(-16, 17)).astype(np.uint32).view(_F).ravel()
    halfway = candidates[np.modf(candidates * log2e)[0] == _F(-0.5)]
    assert halfway.size >= 100, halfway.size  # most k have one; a mistaken search would find none
    return halfway


def _inputs() -> np.ndarray:
    """Every 1021st fp32 bit pattern from -0 down to -87.5 (about a million values, every binade and
    every reduction interval), the halfway points of the reduction, special values and the ends of the range."""
    low, high = np.array([-0.0, -87.5], dtype=_F).view(np.uint32)
    sampled = np.arange(low, high + 1, 1021, dtype=np.uint64).astype(np.uint32).view(_F)
    special = np.array(
        [0.0, -0.0, -1e-45, -1e-38, -1e-30, -0.5 * np.log(2), -np.log(2), -1.0, -86.99, -87.0, -87.00001,
         -87.3, -88.0, -100.0, -3e38, -np.inf, np.nan], dtype=_F,
    )  # fmt: skip
    return np.concatenate([sampled, _halfway_inputs(), special, -np.arange(0, 88, dtype=_F) * _F(np.log(2))])


def test_numpy_reference_is_accurate():
    """The reference itself (so that the kernels matching it means something): within 1 fp32 ulp of the
    correctly rounded exp wherever it does not return 0, and exactly 1 at 0."""
    x = _inputs()
    got = numpy_exp(x)
    with np.errstate(over="ignore"):
        exact = np.exp(x.astype(np.float64)).astype(_F)
    kept = x >= BELOW_IS_ZERO
    ulps = np.abs(fp32_bits(got[kept]).astype(np.int64) - fp32_bits(exact[kept]).astype(np.int64))
    assert ulps.max() <= 1, x[kept][ulps.argmax()]
    assert np.all(got[~kept] == 0)
    assert numpy_exp(np.array([0.0, -0.0], dtype=_F)).tolist() == [1.0, 1.0]


def test_torch_kernel_exp_matches_the_reference_bitwise():
    x = _inputs()
    got = torch_kernel.exp_fp32(torch.from_numpy(x)).numpy()
    mismatch = np.flatnonzero(fp32_bits(got) != fp32_bits(numpy_exp(x)))
    assert mismatch.size == 0, f"{mismatch.size} values differ, e.g. exp({x[mismatch[0]]!r})"


@triton.jit
def _exp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, triton_exp_fp32(tl.load(x_ptr + offsets, mask=mask, other=0.0)), mask=mask)


def test_triton_kernel_exp_matches_the_reference_bitwise():
    """Under the interpreter on CPU (numpy fp32 operations), on the GPU when there is one."""
    x = _inputs()
    device = triton_device()
    x_device = torch.from_numpy(x).to(device)
    y = torch.empty_like(x_device)
    block = 1 << 16
    _exp_kernel[(triton.cdiv(x.size, block),)](x_device, y, x.size, BLOCK=block, enable_fp_fusion=False)
    got = y.cpu().numpy()
    mismatch = np.flatnonzero(fp32_bits(got) != fp32_bits(numpy_exp(x)))
    assert mismatch.size == 0, f"{mismatch.size} values differ, e.g. exp({x[mismatch[0]]!r})"


def test_one_exp_per_step_gives_the_two_exp_fold_with_nan_and_inf_logits():
    """Where the documented fold meets NaN or an infinity, its two factors are exp(NaN) = 0 (0 / 0: a NaN
    summary); the one-exp step puts ``exp(m' - m')`` for the other factor, so the same. With exactly 1
    there, a NaN or +inf row and every row after it were left out of a finite summary."""
    k, z = special_logits()
    with np.errstate(invalid="ignore"):  # inf - inf and 0 / 0, the NaN this test is about
        want = fold(k.numpy(), z.numpy())
    assert np.isnan(want).any() and not np.isnan(want).all()
    assert_same_bits_or_both_nan(torch_kernel.fold_region(k, z).numpy(), want)


@pytest.mark.parametrize("z_scale", [1.0, 30.0])
def test_one_exp_per_step_gives_the_two_exp_fold_bitwise(z_scale):
    """fold_region computes exp(min - max) once per step and multiplies by exp(m' - m') (exactly 1 for these
    finite rows) where the documented fold has exp(0): same fp32 bits, before any rounding. bf16 rows with ties (equal z) and z far apart
    (rows that underflow below exp's range)."""
    z = (torch.randn(8, 4096) * z_scale).bfloat16().float()
    z[3] = z[2]  # ties: exp(0) on both sides
    k = torch.randn(8, 4096).bfloat16().float()
    got = torch_kernel.fold_region(k, z).numpy()
    want = fold(k.numpy(), z.numpy())
    assert np.array_equal(fp32_bits(got), fp32_bits(want))

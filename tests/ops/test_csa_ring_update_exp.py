"""The ``exp`` of ``csa_ring_update``'s fold, alone: both kernels' ``exp_fp32`` bit for bit against an
independent numpy implementation, in fp32 before any rounding to bf16; its accuracy; and the one-exp fold
step against the two-exp formula the op documents.

The reference below is written from the documented algorithm (Cody-Waite reduction, the Cephes expf
polynomial) with its own constants, typed from Cephes' decimal literals and rounded to fp32 by numpy, and
it scales by ``2**n`` with ``np.ldexp`` rather than by building exponent bits. A wrong constant, a changed
operation order or a fused multiply-add in either kernel changes bits on this sample.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import triton_device
from stepops.ops.csa_ring_update import torch_kernel
from stepops.ops.csa_ring_update.triton_kernel import exp_fp32 as triton_exp_fp32

_F = np.float32
# Cephes expf (S. L. Moshier): C1 + C2 = ln 2, C1 with 9 significant bits; P(r) highest degree first.
_LOG2E = _F(1.44269504088896341)
_C1, _C2 = _F(0.693359375), _F(-2.12194440e-4)
_P = [_F(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)]
_BELOW_IS_ZERO = _F(-87.0)


def numpy_exp(x: np.ndarray) -> np.ndarray:
    """exp of fp32 ``x <= 0``: ``2**n (P(r) r^2 + r + 1)``, ``n = floor(x log2e + 1/2)``, ``r = x - n ln2``
    in two parts; 0 below -87 (and for NaN). Every numpy operation here rounds once in fp32."""
    x = np.asarray(x, dtype=_F)
    xc = np.where(x >= _BELOW_IS_ZERO, x, _BELOW_IS_ZERO)
    n = np.floor(xc * _LOG2E + _F(0.5))
    r = (xc - n * _C1) - n * _C2
    p = _P[0]
    for c in _P[1:]:
        p = p * r + c
    y = (p * (r * r) + r) + _F(1.0)
    return np.where(x >= _BELOW_IS_ZERO, np.ldexp(y, n.astype(np.int32)), _F(0.0)).astype(_F)


def _inputs() -> np.ndarray:
    """Every 1021st fp32 bit pattern from -0 down to -87.5 (about a million values, every binade and
    every reduction interval), special values and the ends of the range."""
    low, high = np.array([-0.0, -87.5], dtype=_F).view(np.uint32)
    sampled = np.arange(low, high + 1, 1021, dtype=np.uint64).astype(np.uint32).view(_F)
    special = np.array(
        [0.0, -0.0, -1e-45, -1e-38, -1e-30, -0.5 * np.log(2), -np.log(2), -1.0, -86.99, -87.0, -87.00001,
         -87.3, -88.0, -100.0, -3e38, -np.inf, np.nan], dtype=_F,
    )  # fmt: skip
    return np.concatenate([sampled, special, -np.arange(0, 88, dtype=_F) * _F(np.log(2))])


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=_F).view(np.uint32)


def test_numpy_reference_is_accurate():
    """The reference itself (so that the kernels matching it means something): within 1 fp32 ulp of the
    correctly rounded exp wherever it does not return 0, and exactly 1 at 0."""
    x = _inputs()
    got = numpy_exp(x)
    with np.errstate(over="ignore"):
        exact = np.exp(x.astype(np.float64)).astype(_F)
    kept = x >= _BELOW_IS_ZERO
    ulps = np.abs(_bits(got[kept]).astype(np.int64) - _bits(exact[kept]).astype(np.int64))
    assert ulps.max() <= 1, x[kept][ulps.argmax()]
    assert np.all(got[~kept] == 0)
    assert numpy_exp(np.array([0.0, -0.0], dtype=_F)).tolist() == [1.0, 1.0]


def test_torch_kernel_exp_matches_the_reference_bitwise():
    x = _inputs()
    got = torch_kernel.exp_fp32(torch.from_numpy(x)).numpy()
    mismatch = np.flatnonzero(_bits(got) != _bits(numpy_exp(x)))
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
    mismatch = np.flatnonzero(_bits(got) != _bits(numpy_exp(x)))
    assert mismatch.size == 0, f"{mismatch.size} values differ, e.g. exp({x[mismatch[0]]!r})"


def _two_exp_fold(k: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The op's documented fold, in numpy: two exps per step, ``alpha = exp(m - m')``, ``beta = exp(z - m')``."""
    m, s, a = z[0].copy(), np.ones_like(z[0]), k[0].copy()
    for j in range(1, 8):
        m_new = np.maximum(m, z[j])
        alpha, beta = numpy_exp(m - m_new), numpy_exp(z[j] - m_new)
        s = s * alpha + beta
        a = a * alpha + beta * k[j]
        m = m_new
    return a / s


@pytest.mark.parametrize("z_scale", [1.0, 30.0])
def test_one_exp_per_step_gives_the_two_exp_fold_bitwise(z_scale):
    """fold_region computes exp(min - max) once per step and multiplies by exactly 1 where the documented
    fold has exp(0): same fp32 bits, before any rounding. bf16 rows with ties (equal z) and z far apart
    (rows that underflow below exp's range)."""
    z = (torch.randn(8, 4096) * z_scale).bfloat16().float()
    z[3] = z[2]  # ties: exp(0) on both sides
    k = torch.randn(8, 4096).bfloat16().float()
    got = torch_kernel.fold_region(k, z).numpy()
    want = _two_exp_fold(k.numpy(), z.numpy())
    assert np.array_equal(_bits(got), _bits(want))

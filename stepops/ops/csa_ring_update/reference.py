"""The naive reference of ``stepops::csa_ring_update``: token by token, each region folded in numpy.

Independent of both kernels: the fold is the documented two-``exp`` formula in numpy fp32 (rows 0..7 in
order, ``a / s``), and its ``exp`` is written from the documented algorithm (Cody-Waite reduction, the
Cephes expf polynomial) with its own constants, typed from Cephes' decimal literals and rounded to fp32 by
numpy, scaling by ``2**n`` with ``np.ldexp`` rather than by building exponent bits. A wrong constant, a
changed operation order or a fused multiply-add in either kernel changes bits against it. The op tests and
the benchmark's naive provider use it. Needs numpy (a test dependency); no op module imports it.
"""

from __future__ import annotations

import numpy as np
import torch

from stepops.layouts import REGION_SIZE

_F = np.float32
# Cephes expf (S. L. Moshier): C1 + C2 = ln 2, C1 with 9 significant bits; P(r) highest degree first.
_LOG2E = _F(1.44269504088896341)
_C1, _C2 = _F(0.693359375), _F(-2.12194440e-4)
_P = [_F(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)]
# numpy_exp returns 0 below this; the kernels' cut-off, typed here again so the reference stays their check.
BELOW_IS_ZERO = _F(-87.0)


def numpy_exp(x: np.ndarray) -> np.ndarray:
    """exp of fp32 ``x <= 0``: ``2**n (P(r) r^2 + r + 1)``, ``n = floor(x log2e + 1/2)``, ``r = x - n ln2``
    in two parts; 0 below -87 (and for NaN). Every numpy operation here rounds once in fp32."""
    x = np.asarray(x, dtype=_F)
    xc = np.where(x >= BELOW_IS_ZERO, x, BELOW_IS_ZERO)
    n = np.floor(xc * _LOG2E + _F(0.5))
    r = (xc - n * _C1) - n * _C2
    p = _P[0]
    for c in _P[1:]:
        p = p * r + c
    y = (p * (r * r) + r) + _F(1.0)
    return np.where(x >= BELOW_IS_ZERO, np.ldexp(y, n.astype(np.int32)), _F(0.0)).astype(_F)


def fold(k: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The op's documented fold of ``[8, P]`` fp32 rows, in numpy: two exps per step, ``alpha = exp(m - m')``,
    ``beta = exp(z - m')``; returns ``a / s`` ``[P]`` fp32, before any rounding."""
    m, s, a = z[0].copy(), np.ones_like(z[0]), k[0].copy()
    for j in range(1, REGION_SIZE):
        m_new = np.maximum(m, z[j])
        alpha, beta = numpy_exp(m - m_new), numpy_exp(z[j] - m_new)
        s = s * alpha + beta
        a = a * alpha + beta * k[j]
        m = m_new
    return a / s


def region_summary(k_rows: torch.Tensor, z_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One region's summary from its 8 ``[P]`` bf16 rows ``[8, P]``: :func:`fold`, rounded to bf16, then for
    ``float8_e4m3fn`` clamped to +-448 and cast. A CPU ``[P]`` tensor of ``dtype``."""
    summary = torch.from_numpy(fold(k_rows.float().cpu().numpy(), z_rows.float().cpu().numpy())).to(torch.bfloat16)
    if dtype == torch.bfloat16:
        return summary
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    return summary.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


def csa_ring_update_reference(
    index_k: torch.Tensor,
    index_z: torch.Tensor,
    ring: torch.Tensor,
    summary_cache: torch.Tensor,
    token_position: torch.Tensor,
    token_chunk_start: torch.Tensor,
    token_chunk_len: torch.Tensor,
    token_ring_base: torch.Tensor,
    token_summary_slot: torch.Tensor,
    capacity: int,
) -> None:
    """``torch.ops.stepops.csa_ring_update``'s arguments and effect, one token at a time.

    A closing token (``p % 8 == 7`` with a summary slot) gathers its region's rows for positions
    ``p-7 .. p``, from this step's inputs when the position is in the step, else from its ring row, and
    writes :func:`region_summary` to its slot (``summary_cache`` bf16, float8_e4m3fn, or uint8 holding
    float8_e4m3fn codes); then each request's last ``capacity`` tokens store ``[index_k | index_z]`` on
    ring row ``base + p % capacity``. Summaries first, so every replay reads the ring as before the step.
    """
    proxy_dim = index_k.shape[1]
    rows = torch.cat([index_k, index_z], dim=1)
    codes = summary_cache if summary_cache.dtype == torch.bfloat16 else summary_cache.view(torch.uint8)
    dtype = torch.bfloat16 if summary_cache.dtype == torch.bfloat16 else torch.float8_e4m3fn
    position, start = token_position.tolist(), token_chunk_start.tolist()
    length, base, slot = token_chunk_len.tolist(), token_ring_base.tolist(), token_summary_slot.tolist()
    for t, p in enumerate(position):
        if p < 0 or p % REGION_SIZE != REGION_SIZE - 1 or slot[t] < 0:
            continue
        first = p - (t - start[t])
        region = torch.stack([
            rows[t - (p - q)] if q >= first else ring[base[t] + q % capacity]
            for q in range(p - (REGION_SIZE - 1), p + 1)
        ])  # fmt: skip
        summary = region_summary(region[:, :proxy_dim], region[:, proxy_dim:], dtype)
        codes[slot[t]] = summary.view(codes.dtype).to(codes.device)
    for t, p in enumerate(position):
        if p >= 0 and t - start[t] >= length[t] - capacity:
            ring[base[t] + p % capacity] = rows[t]

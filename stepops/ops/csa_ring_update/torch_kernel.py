"""PyTorch kernel of ``stepops::csa_ring_update``: the readable specification (and the CPU kernel).

The Triton kernel must give the same bits. Both fold a region's rows with the same IEEE fp32 operations in
the same order; only ``exp`` has no bitwise-portable fp32 implementation (SLEEF, glibc, numpy and CUDA each
round differently, and ATen even switches between SLEEF and the scalar libm for the tail of a tensor, so a
row's bits would depend on how many tokens share the call). ``exp`` is therefore evaluated in fp64 and
rounded to fp32: every libm's fp64 ``exp`` is within 1 fp64 ulp, which rounds to the same fp32 value except
when the exact result lies within 2**-29 relative of an fp32 rounding boundary.
"""

from __future__ import annotations

import torch

from stepops._meta.csa_ring_update import FP8_E4M3_MAX, REGION_SIZE, check_csa_ring_update_args


def exp_fp32(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of an fp32 tensor, computed in fp64 and rounded once to fp32 (see the module docstring)."""
    return torch.exp(x.to(torch.float64)).to(torch.float32)


def fold_region(k_rows: torch.Tensor, z_rows: torch.Tensor) -> torch.Tensor:
    """Fixed-order online softmax of ``[..., 8, P]`` fp32 rows, per dimension; returns ``[..., P]`` fp32.

    Row 0 starts the state (``m = z0, s = 1, a = k0``); rows 1..7 are folded in order:
    ``m' = max(m, z); s = s * exp(m - m') + exp(z - m'); a = a * exp(m - m') + exp(z - m') * k``.
    The summary is ``a / s`` = ``sum_t softmax(z)_t k_t``.
    """
    m = z_rows[..., 0, :]
    s = torch.ones_like(m)
    a = k_rows[..., 0, :]
    for j in range(1, REGION_SIZE):
        z, k = z_rows[..., j, :], k_rows[..., j, :]
        m_new = torch.maximum(m, z)
        alpha = exp_fp32(m - m_new)
        beta = exp_fp32(z - m_new)
        s = s * alpha + beta
        a = a * alpha + beta * k
        m = m_new
    return a / s


def to_summary_dtype(summary: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> bf16 (round to nearest even); for float8_e4m3fn, then clamp to +-448 and cast (RNE).

    The clamp makes overflow saturate instead of producing NaN (e4m3fn has no infinity). A NaN stays NaN:
    the e4m3fn NaN code with the bf16 NaN's sign, ``0x7F`` or ``0xFF``, as the Triton kernel's
    ``fp8_e4m3_code`` gives it. Which NaN the fp32 -> bf16 step yields is platform-defined in both
    kernels (torch's vectorised CPU cast gives ``0xFFFF`` for any NaN), so NaN summaries agree as NaN,
    not bit for bit.
    """
    rounded = summary.to(torch.bfloat16)
    if dtype == torch.bfloat16:
        return rounded
    return rounded.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def store_summaries(summary_cache: torch.Tensor, slot: torch.Tensor, summary: torch.Tensor) -> None:
    """Write fp32 ``summary`` ``[C, P]`` to rows ``slot`` of the cache (bf16, or fp8 codes as uint8 bytes)."""
    if summary_cache.dtype == torch.bfloat16:
        summary_cache[slot] = to_summary_dtype(summary, torch.bfloat16)
    else:
        # Byte copies: aten has no CPU float8 comparison, which opcheck's schema check would need.
        summary_cache.view(torch.uint8)[slot] = to_summary_dtype(summary, torch.float8_e4m3fn).view(torch.uint8)


def csa_ring_update(
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
    """Store one ragged step's CSA rows in the requests' tail rings and write the summaries of closed regions.

    Shapes and dtypes: ``index_k``, ``index_z`` ``[T, P]`` bf16; ``ring`` ``[num_rows, 2P]`` bf16, a row is
    ``[index_k | index_z]``; ``summary_cache`` ``[num_slots, P]`` bf16, float8_e4m3fn, or uint8 holding
    float8_e4m3fn codes; the five
    ``token_*`` tensors ``[T]`` int32, ``-1`` for padding tokens; ``capacity >= 7`` rows per ring.

    Per token ``t`` of a request (position ``p``, flat index of the request's first token ``c``, ``n`` tokens
    in this step, ring rows ``[b, b + capacity)``):
    - store: if ``t - c >= n - capacity``, ring row ``b + p % capacity`` = ``[index_k[t] | index_z[t]]``
      (only the last ``capacity`` tokens of a request store, so no two stores of a step collide);
    - summary: if ``p % 8 == 7`` and ``token_summary_slot[t] >= 0``, replay the region's rows for positions
      ``p-7 .. p`` in that order (flat index ``t-7+j`` from the step's inputs when ``>= c``, else ring row
      ``b + (p-7+j) % capacity``) with :func:`fold_region`, round to the cache's dtype with
      :func:`to_summary_dtype` and write row ``token_summary_slot[t]`` of ``summary_cache``.
    Every replay reads the ring before any store of the step lands. Padding tokens read and write nothing.
    Invariants the caller keeps: a request's tokens are contiguous with consecutive positions; rings of
    different requests do not overlap; ``b + capacity <= num_rows``; slots are in range and distinct;
    the ring holds positions ``p-7 .. c-1`` from earlier steps (the layout's ``capacity >= 7 + k``).
    """
    check_csa_ring_update_args(
        index_k,
        index_z,
        ring,
        summary_cache,
        token_position,
        token_chunk_start,
        token_chunk_len,
        token_ring_base,
        token_summary_slot,
        capacity,
    )
    proxy_dim = index_k.shape[1]
    token = torch.arange(index_k.shape[0], device=index_k.device)
    position = token_position.long()
    chunk_start = token_chunk_start.long()
    chunk_len = token_chunk_len.long()
    ring_base = token_ring_base.long()
    slot = token_summary_slot.long()
    real = position >= 0

    # 1. Replays, all reading the ring before step 2 stores anything.
    closes = real & (position % REGION_SIZE == REGION_SIZE - 1) & (slot >= 0)
    t, p, c, b = token[closes], position[closes], chunk_start[closes], ring_base[closes]
    j = torch.arange(REGION_SIZE, device=index_k.device)
    flat = t[:, None] - (REGION_SIZE - 1) + j  # [C, 8] flat index of row j if it is in this step
    in_step = flat >= c[:, None]
    ring_row = b[:, None] + (p[:, None] - (REGION_SIZE - 1) + j) % capacity
    step_rows = torch.cat([index_k, index_z], dim=1)[flat.clamp(min=0)]  # [C, 8, 2P]
    rows = torch.where(in_step[..., None], step_rows, ring[ring_row]).to(torch.float32)
    summary = fold_region(rows[..., :proxy_dim], rows[..., proxy_dim:])
    store_summaries(summary_cache, slot[closes], summary)

    # 2. Stores: only the last `capacity` tokens of each request, so every stored ring row is distinct.
    stores = real & (token - chunk_start >= chunk_len - capacity)
    ring[ring_base[stores] + position[stores] % capacity] = torch.cat([index_k[stores], index_z[stores]], dim=1)

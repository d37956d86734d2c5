"""PyTorch kernel of ``stepops::csa_ring_update``: the readable specification (and the CPU kernel).

The Triton kernel must give the same bits. Both fold a region's rows with the same IEEE fp32 operations in
the same order. ``exp`` is no exception: library ``exp``s have no bitwise-portable fp32 result (SLEEF,
glibc, numpy and CUDA each round differently, and ATen even switches between SLEEF and the scalar libm for
the tail of a tensor, so a row's bits would depend on how many tokens share the call). :func:`exp_fp32` is
therefore written out with fp32 ``+``, ``*``, ``floor`` and exponent bits only, each of which rounds the
same way on every IEEE machine, and the Triton kernel spells the same operations in the same order.
"""

from __future__ import annotations

import torch

from stepops._meta.csa_ring_update import check_csa_ring_update_args
from stepops.layouts import REGION_SIZE
from stepops.ops.bounds import IdCheck, any_bad_ids, bad_ids_error
from stepops.ops.put_rows import put_rows_

# exp_fp32's constants, each exactly an fp32 value (written in hex), so that every implementation uses the
# same number whatever precision it converts a Python float in. Cody-Waite reduction and the Cephes expf
# polynomial (S. L. Moshier, Cephes Math Library): x = n ln2 + r, |r| <= ln2 / 2, exp(r) ~ 1 + r + r^2 P(r).
EXP_LOG2E = float.fromhex("0x1.715476p+0")  # log2(e)
# ln2 in two parts: LN2_HI has 9 significant bits, so n * LN2_HI (|n| <= 126) and x - n * LN2_HI are exact.
EXP_LN2_HI = float.fromhex("0x1.63p-1")  # 0.693359375
EXP_LN2_LO = float.fromhex("-0x1.bd0106p-13")  # ln2 - LN2_HI
EXP_POLY = tuple(
    float.fromhex(c)  # P(r), highest degree first; within ~1 fp32 ulp of exp on [-ln2/2, ln2/2]
    for c in ("0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.111210p-7", "0x1.555382p-5", "0x1.555554p-3", "0x1p-1")
)
# Below this exp_fp32 returns 0: exp(-87) = 1.6e-38 is still a normal fp32 number (>= 2**-126), so no
# operation ever sees a denormal, whose flushing differs between devices. A row that far below the
# region's maximum weighs less than 2**-125 of it.
EXP_MIN = -87.0
# 2**n is built from its exponent bits: (n + 127) << 23.
FP32_EXPONENT_BIAS = 127
FP32_MANTISSA_BITS = 23


def exp_fp32(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of an fp32 tensor ``x <= 0`` (the fold's only case), within 1 fp32 ulp, 0 below ``EXP_MIN``.

    ``n = floor(x log2e + 1/2)``, ``r = (x - n LN2_HI) - n LN2_LO``, ``exp(x) = 2**n (P(r) r^2 + r + 1)``,
    every step one fp32 rounding (no fused multiply-add). NaN gives 0. The Triton kernel's ``exp_fp32``
    is the same sequence of operations.
    """
    xc = x.clamp(min=EXP_MIN)  # keeps n in the exponent's range; those x are masked to 0 below
    n = torch.floor(xc * EXP_LOG2E + 0.5)
    r = (xc - n * EXP_LN2_HI) - n * EXP_LN2_LO
    p = r * EXP_POLY[0] + EXP_POLY[1]
    for c in EXP_POLY[2:]:
        p = p * r + c
    y = (p * (r * r) + r) + 1.0
    scale = ((n.to(torch.int32) + FP32_EXPONENT_BIAS) << FP32_MANTISSA_BITS).view(torch.float32)
    return torch.where(x >= EXP_MIN, y * scale, 0.0)


def fold_region(k_rows: torch.Tensor, z_rows: torch.Tensor) -> torch.Tensor:
    """Fixed-order online softmax of ``[..., 8, P]`` fp32 rows, per dimension; returns ``[..., P]`` fp32.

    Row 0 starts the state (``m = z0, s = 1, a = k0``); rows 1..7 are folded in order:
    ``m' = max(m, z); s = s * exp(m - m') + exp(z - m'); a = a * exp(m - m') + exp(z - m') * k``.
    One of the two factors is ``exp(m' - m')`` (``m'`` is ``m`` or ``z``), so each step computes one
    ``e = exp(min(m, z) - m')`` and puts ``exp(m' - m')`` where the other would be: 1 for a finite ``m'``,
    and 0 for an infinite or NaN one, as :func:`exp_fp32` of NaN. The same bits as two ``exp`` calls for
    every input: a NaN or ``+inf`` logit, or a region of ``-inf`` logits, gives ``0 / 0`` = NaN, as the
    two-exp formula does, never a finite summary that silently leaves rows out. The summary is ``a / s`` =
    ``sum_t softmax(z)_t k_t``.
    """
    m = z_rows[..., 0, :]
    s = torch.ones_like(m)
    a = k_rows[..., 0, :]
    for j in range(1, REGION_SIZE):
        z, k = z_rows[..., j, :], k_rows[..., j, :]
        m_new = torch.maximum(m, z)
        e = exp_fp32(torch.minimum(m, z) - m_new)
        unit = torch.where(m_new - m_new == 0.0, 1.0, 0.0)  # exp(m' - m')
        grew = z > m  # the running max moves to z: the state is rescaled by e, the new row weighs exp(0)
        alpha = torch.where(grew, e, unit)
        beta = torch.where(grew, unit, e)
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
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    return rounded.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


def store_summaries(summary_cache: torch.Tensor, slot: torch.Tensor, summary: torch.Tensor) -> None:
    """Write fp32 ``summary`` ``[C, P]`` to rows ``slot`` of the cache (bf16, or fp8 codes as uint8 bytes)."""
    if summary_cache.dtype == torch.bfloat16:
        summary_cache[slot] = to_summary_dtype(summary, torch.bfloat16)
    else:
        # Byte copies: aten has no CPU float8 comparison, which opcheck's schema check would need.
        summary_cache.view(torch.uint8)[slot] = to_summary_dtype(summary, torch.float8_e4m3fn).view(torch.uint8)


def csa_ring_update_torch(
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
    errors: torch.Tensor | None = None,
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

    Memory safety (``stepops.ops.bounds``): a real token's chunk lies inside the step (``0 <= c <= t``,
    ``c + n <= T``, its first position ``p - (t - c) >= 0``), its ring inside ``ring``
    (``0 <= b <= num_rows - capacity``), and every summary slot is ``-1`` or a row of ``summary_cache``.
    This kernel raises ``ValueError`` before writing anything otherwise; the Triton kernel has such a token
    read and write nothing (a slot out of range is never written) and counts it in ``errors`` (int32
    ``[1]``, optional; never written here).
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
        errors,
    )
    proxy_dim, num_tokens, num_rows = index_k.shape[1], index_k.shape[0], ring.shape[0]
    token = torch.arange(num_tokens, device=index_k.device)
    position = token_position.long()
    chunk_start = token_chunk_start.long()
    chunk_len = token_chunk_len.long()
    ring_base = token_ring_base.long()
    slot = token_summary_slot.long()
    real = position >= 0
    # Every id that becomes an address is checked before anything is written.
    checks = (
        IdCheck("token_chunk_start", chunk_start, token + 1, where=real, padding=False,
                expected="in [0, t] for a real token t (the row of its request's first token in this step)"),
        IdCheck("token_chunk_len", chunk_len, num_tokens - chunk_start + 1, where=real, padding=False,
                expected=f"in [0, {num_tokens} - chunk_start] for a real token (its chunk inside the step)"),
        IdCheck("token_position", position - (token - chunk_start), 2**62, where=real, padding=False,
                expected="at least t - chunk_start for a real token t (its request's first position >= 0)"),
        IdCheck("token_ring_base", ring_base, num_rows - capacity + 1, where=real, padding=False,
                expected=f"in [0, {num_rows - capacity}] for a real token (its ring's rows inside ring)"),
        IdCheck("token_summary_slot", slot, summary_cache.shape[0]),
    )  # fmt: skip
    if bool(any_bad_ids(checks)):  # the one host read (stepops.ops.bounds)
        raise bad_ids_error("csa_ring_update", checks)

    # 1. Replays, all reading the ring before step 2 stores anything. Only the closing tokens replay: their
    #    number depends on the data (compiled, a second graph break), but replaying every token would fold up
    #    to 8 times the rows.
    closes = real & (position % REGION_SIZE == REGION_SIZE - 1) & (slot >= 0)
    t = closes.nonzero().squeeze(1)
    p, c, b = position[t], chunk_start[t], ring_base[t]
    j = torch.arange(REGION_SIZE, device=index_k.device)
    flat = t[:, None] - (REGION_SIZE - 1) + j  # [C, 8] flat index of row j if it is in this step
    in_step = flat >= c[:, None]
    ring_row = b[:, None] + (p[:, None] - (REGION_SIZE - 1) + j) % capacity
    step_rows = torch.cat([index_k, index_z], dim=1)  # [T, 2P]
    rows = torch.where(in_step[..., None], step_rows[flat.clamp(min=0)], ring[ring_row]).to(torch.float32)
    summary = fold_region(rows[..., :proxy_dim], rows[..., proxy_dim:])
    store_summaries(summary_cache, slot[t], summary)

    # 2. Stores: only the last `capacity` tokens of each request, so every stored ring row is distinct.
    stores = real & (token - chunk_start >= chunk_len - capacity)
    put_rows_(ring, (ring_base + position % capacity,), step_rows, stores)

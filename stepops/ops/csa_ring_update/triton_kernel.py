"""Triton kernel of ``stepops::csa_ring_update``: one launch per step, one program per token.

Design. The only hazard is a replay that reads ring rows while the same step stores rows. Only one replay
per request reads the ring: the request's first closing token, when it is among the step's first 7 tokens
(its region starts before the step). Every other replay reads the step's inputs only. So:
- each program stores its own token's ring row (if it is among the request's last ``capacity`` tokens),
  unless that row is one the request's ring replay reads ("deferred");
- the request's leader program (token == chunk start) runs the ring replay, then ``tl.debug_barrier()``
  (its threads' reads complete before any of its threads store), then stores the at most 7 deferred rows;
- every other closing token replays from ``index_k``/``index_z`` alone and never reads the ring.
No program reads a row another program writes, so there is no cross-program ordering to enforce, the grid
is ``(T,)`` and stores stay parallel (a long prefill chunk does not serialize on its leader).

Bits. The fold is the PyTorch kernel's, op for op: ``exp`` in fp64 rounded to fp32, IEEE fp32 ``max``,
``*``, ``+`` with FMA contraction disabled at launch (``enable_fp_fusion=False``), and ``div_rn``. The
fp32 -> bf16 and bf16 -> float8_e4m3fn roundings are done with integer operations on the bits, which give
round-to-nearest-even identically on a GPU and under the interpreter (whose own casts truncate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepops._meta import csa_ring_update as _meta
from stepops.ops.triton_rounding import fp8_e4m3_code, round_fp32_to_bf16

# Positions per CSA region (the closing token replays the REGION_SIZE - 1 before it).
REGION_SIZE = tl.constexpr(_meta.REGION_SIZE)


@triton.jit
def _exp_fp32(x):
    """exp in fp64 rounded to fp32: the same bits as the PyTorch kernel (see torch_kernel.py)."""
    return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _lanes(d, P, flag):
    """Mask of the first ``P`` lanes of ``d`` where the scalar ``flag`` holds, else none.

    Built by comparison rather than ``d < P & flag``: the interpreter broadcasts a scalar int1 to int32
    lanes, and an int32 mask is rejected by its loads.
    """
    return d < tl.where(flag, P, 0)


@triton.jit
def _load_row(ptr, row, stride0, stride1, d, mask):
    return tl.load(ptr + row.to(tl.int64) * stride0 + d * stride1, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_region_row(
    index_k_ptr,
    index_z_ptr,
    ring_ptr,
    stride_k0,
    stride_k1,
    stride_z0,
    stride_z1,
    stride_ring0,
    stride_ring1,
    capacity,
    P,
    target,
    target_position,
    chunk_start,
    ring_base,
    j,
    d,
    replay,
):
    """Row ``j`` (0..7) of the region closed by token ``target``, as fp32 ``(z, k)``.

    From the step's inputs if that token is in this step, else from the request's ring.
    """
    flat = target - (REGION_SIZE - 1) + j
    from_ring = flat < chunk_start
    in_step = flat >= chunk_start
    ring_row = ring_base + (target_position - (REGION_SIZE - 1) + j) % capacity
    step_mask = _lanes(d, P, replay & in_step)
    ring_mask = _lanes(d, P, replay & from_ring)
    k = tl.where(
        from_ring,
        _load_row(ring_ptr, ring_row, stride_ring0, stride_ring1, d, ring_mask),
        _load_row(index_k_ptr, flat, stride_k0, stride_k1, d, step_mask),
    )
    z = tl.where(
        from_ring,
        _load_row(ring_ptr, ring_row, stride_ring0, stride_ring1, d + P, ring_mask),
        _load_row(index_z_ptr, flat, stride_z0, stride_z1, d, step_mask),
    )
    return z, k


@triton.jit
def _csa_ring_update_kernel(
    index_k_ptr,
    index_z_ptr,
    ring_ptr,
    summary_ptr,
    position_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    ring_base_ptr,
    summary_slot_ptr,
    stride_k0,
    stride_k1,
    stride_z0,
    stride_z1,
    stride_ring0,
    stride_ring1,
    stride_summary0,
    stride_summary1,
    capacity,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    FP8_SUMMARY: tl.constexpr,
    # Test-only: programs take tokens in reverse. The interpreter runs programs one at a time in grid
    # order, so running both orders is how a CPU test shows that no program depends on another having run
    # first (a store landing before a replay's read would change the result). Serving launches it False.
    REVERSE_GRID: tl.constexpr,
):
    t = tl.program_id(0)
    if REVERSE_GRID:
        t = tl.num_programs(0) - 1 - t
    position = tl.load(position_ptr + t)
    chunk_start = tl.load(chunk_start_ptr + t)
    chunk_len = tl.load(chunk_len_ptr + t)
    ring_base = tl.load(ring_base_ptr + t)
    real = position >= 0
    offset = t - chunk_start
    start_position = position - offset  # the request's first position in this step
    is_leader = real & (offset == 0)

    # The request's first closing token; it reads the ring iff it is among the step's first 7 tokens.
    first_close = (REGION_SIZE - 1 - start_position % REGION_SIZE) % REGION_SIZE
    ring_replay_possible = real & (first_close < REGION_SIZE - 1) & (first_close < chunk_len)
    ring_replay_slot = tl.load(summary_slot_ptr + chunk_start + first_close, mask=ring_replay_possible, other=-1)
    ring_replay = ring_replay_possible & (ring_replay_slot >= 0)  # same value in every program of the request

    # This program's replay: the leader runs the ring replay; others run their own input-only replay.
    own_slot = tl.load(summary_slot_ptr + t)
    own_replay = real & (position % REGION_SIZE == REGION_SIZE - 1) & (offset >= REGION_SIZE - 1) & (own_slot >= 0)
    replay = (is_leader & ring_replay) | own_replay
    target = tl.where(is_leader, chunk_start + first_close, t)
    target_position = tl.where(is_leader, start_position + first_close, position)
    slot = tl.where(is_leader, ring_replay_slot, own_slot)

    d = tl.arange(0, BLOCK_P)
    # A scalar branch: uniform across the program, and it spares the interpreter the work of masked lanes.
    if replay:
        m, a = _load_region_row(
            index_k_ptr, index_z_ptr, ring_ptr, stride_k0, stride_k1, stride_z0, stride_z1, stride_ring0,
            stride_ring1, capacity, P, target, target_position, chunk_start, ring_base, 0, d, replay,
        )  # fmt: skip
        s = tl.full([BLOCK_P], 1.0, dtype=tl.float32)
        for j in tl.static_range(1, REGION_SIZE):
            z, k = _load_region_row(
                index_k_ptr, index_z_ptr, ring_ptr, stride_k0, stride_k1, stride_z0, stride_z1, stride_ring0,
                stride_ring1, capacity, P, target, target_position, chunk_start, ring_base, j, d, replay,
            )  # fmt: skip
            m_new = tl.maximum(m, z)
            alpha = _exp_fp32(m - m_new)
            beta = _exp_fp32(z - m_new)
            s = s * alpha + beta
            a = a * alpha + beta * k
            m = m_new
        summary = round_fp32_to_bf16(tl.math.div_rn(a, s))
        summary_offsets = slot.to(tl.int64) * stride_summary0 + d * stride_summary1
        if FP8_SUMMARY:
            tl.store(summary_ptr + summary_offsets, fp8_e4m3_code(summary), mask=_lanes(d, P, replay))
        else:
            tl.store(summary_ptr + summary_offsets, summary.to(tl.bfloat16), mask=_lanes(d, P, replay))

    # The ring replay's reads complete before this program stores anything.
    tl.debug_barrier()

    # Ring rows the request's ring replay reads: positions [start_position + first_close - 7, start_position).
    read_first = start_position + first_close - (REGION_SIZE - 1)
    num_read = REGION_SIZE - 1 - first_close
    stores = real & (offset >= chunk_len - capacity)
    kept = (ring_replay == 0) | ((position - read_first) % capacity >= num_read)  # not deferred to the leader
    own_row = ring_base + position % capacity
    own = _lanes(d, P, stores & kept)
    ring_offsets = own_row.to(tl.int64) * stride_ring0 + d * stride_ring1
    k_own = tl.load(index_k_ptr + t.to(tl.int64) * stride_k0 + d * stride_k1, mask=own)
    z_own = tl.load(index_z_ptr + t.to(tl.int64) * stride_z0 + d * stride_z1, mask=own)
    tl.store(ring_ptr + ring_offsets, k_own, mask=own)
    tl.store(ring_ptr + ring_offsets + P * stride_ring1, z_own, mask=own)

    # The leader stores the deferred rows: for each read position r, the stored position q = r (mod capacity).
    store_first = start_position + tl.maximum(chunk_len - capacity, 0)
    store_end = start_position + chunk_len
    if is_leader & ring_replay:
        for i in tl.static_range(REGION_SIZE - 1):
            r = read_first + i
            q = store_first + ((r % capacity) - (store_first % capacity) + capacity) % capacity
            move = _lanes(d, P, (i < num_read) & (q < store_end))
            src = chunk_start + (q - start_position)
            row = ring_base + q % capacity
            k_q = tl.load(index_k_ptr + src.to(tl.int64) * stride_k0 + d * stride_k1, mask=move)
            z_q = tl.load(index_z_ptr + src.to(tl.int64) * stride_z0 + d * stride_z1, mask=move)
            ring_q = row.to(tl.int64) * stride_ring0 + d * stride_ring1
            tl.store(ring_ptr + ring_q, k_q, mask=move)
            tl.store(ring_ptr + ring_q + P * stride_ring1, z_q, mask=move)


def csa_ring_update_triton(
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
    *,
    reverse_grid: bool = False,
) -> None:
    """Launch :func:`_csa_ring_update_kernel` on a grid of ``(T,)``; same contract as the PyTorch kernel.

    ``reverse_grid`` exists only for tests: it maps program ``i`` to token ``T - 1 - i``. The interpreter
    runs programs one at a time in grid order, so a store racing a replay's read would go unnoticed in one
    order; tests run both orders to show the result does not depend on the order of programs (no program
    reads what another writes). Callers leave it False; on a GPU it only changes the scheduling order.
    """
    _meta.check_csa_ring_update_args(
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
    num_tokens, proxy_dim = index_k.shape
    if num_tokens == 0:
        return
    fp8 = summary_cache.dtype in _meta.FP8_SUMMARY_DTYPES
    # fp8 codes are computed with integer ops and stored as bytes (see fp8_e4m3_code).
    summary = summary_cache.view(torch.uint8) if fp8 else summary_cache
    block_p = triton.next_power_of_2(proxy_dim)
    _csa_ring_update_kernel[(num_tokens,)](
        index_k,
        index_z,
        ring,
        summary,
        token_position,
        token_chunk_start,
        token_chunk_len,
        token_ring_base,
        token_summary_slot,
        index_k.stride(0),
        index_k.stride(1),
        index_z.stride(0),
        index_z.stride(1),
        ring.stride(0),
        ring.stride(1),
        summary.stride(0),
        summary.stride(1),
        capacity,
        P=proxy_dim,
        BLOCK_P=block_p,
        FP8_SUMMARY=fp8,
        REVERSE_GRID=reverse_grid,
        # About 4 lanes of P per thread (the fold keeps m, s, a and a row's k, z live in fp32 registers),
        # one warp for small P, at most 4 since a program is a single token's 8 rows.
        num_warps=max(1, min(4, block_p // 128)),
        # Keep `s * alpha + beta` two roundings, as in the PyTorch kernel, so the summaries match bitwise.
        enable_fp_fusion=False,
    )

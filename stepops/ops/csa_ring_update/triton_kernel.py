"""Triton kernel of ``stepops::csa_ring_update``: one launch per step, one program per token.

Design. The only hazard is a replay that reads ring rows while the same step stores rows. Only one replay
per request reads the ring: the request's first closing token, when it is among the step's first 7 tokens
(its region starts before the step). Every other replay reads the step's inputs only. So:
- each program stores its own token's ring row (if it is among the request's last ``capacity`` tokens),
  unless that row is one the request's ring replay reads ("deferred");
- the request's leader program (token == chunk start) reads the ring replay's rows, then
  ``tl.debug_barrier()`` (its threads' reads complete before any of its threads store), then folds them
  and stores the at most 7 deferred rows;
- every other closing token replays from ``index_k``/``index_z`` alone and never reads the ring.
No program reads a row another program writes, so there is no cross-program ordering to enforce, the grid
is ``(T,)`` and stores stay parallel (a long prefill chunk does not serialize on its leader).

Latency. A decode step moves a few KiB per token, so its time is memory round trips, not bytes. A program
issues its loads in two waves and nothing else waits on memory: (1) the token's metadata, its own row and
the summary slots of the 6 tokens after it (a leader's ring replay may write one of them), addressed by
the program id alone; (2) the 8 rows of its replay and the leader's deferred rows, addressed by wave-1
metadata (a ring row's address is ``ring_base + position % capacity``: the second wave cannot be avoided).
No load's address or mask depends on a wave-2 value, and the fold starts after both waves, in a basic
block of its own (see the kernel). ``python -m stepops.testing.gpu_build`` reads the round trips off the
SASS.

Bits. The fold is the PyTorch kernel's, op for op: one ``exp_fp32`` per step (the same fp32 operation
sequence as torch_kernel.exp_fp32), IEEE fp32 ``max``, ``*``, ``+`` with FMA contraction disabled at launch
(``enable_fp_fusion=False``), and ``div_rn``. The fp32 -> bf16 and bf16 -> float8_e4m3fn roundings are done
with integer operations on the bits, which give round-to-nearest-even identically on a GPU and under the
interpreter (whose own casts truncate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepops import layouts
from stepops._meta import csa_ring_update as _meta
from stepops.ops.csa_ring_update import torch_kernel as _spec
from stepops.ops.triton_bounds import bad_id, count_error, in_extent
from stepops.ops.triton_launch import MAX_TILE_NUMEL, CachedLaunch, next_power_of_2, tile_too_large
from stepops.ops.triton_rounding import fp8_e4m3_code, round_fp32_to_bf16

# Positions per CSA region (the closing token replays the REGION_SIZE - 1 before it).
REGION_SIZE = tl.constexpr(layouts.REGION_SIZE)
# exp_fp32's constants: the PyTorch kernel's, exactly fp32 values (see torch_kernel.py).
EXP_LOG2E = tl.constexpr(_spec.EXP_LOG2E)
EXP_LN2_HI = tl.constexpr(_spec.EXP_LN2_HI)
EXP_LN2_LO = tl.constexpr(_spec.EXP_LN2_LO)
EXP_P0, EXP_P1, EXP_P2, EXP_P3, EXP_P4, EXP_P5 = (tl.constexpr(c) for c in _spec.EXP_POLY)
EXP_MIN = tl.constexpr(_spec.EXP_MIN)
FP32_EXPONENT_BIAS = tl.constexpr(_spec.FP32_EXPONENT_BIAS)
FP32_MANTISSA_BITS = tl.constexpr(_spec.FP32_MANTISSA_BITS)


@triton.jit
def exp_fp32(x):
    """``exp`` of fp32 ``x <= 0``: torch_kernel.exp_fp32's operations in its order, so the same bits."""
    xc = tl.maximum(x, EXP_MIN)  # keeps n in the exponent's range; those x are masked to 0 below
    n = tl.floor(xc * EXP_LOG2E + 0.5)
    r = (xc - n * EXP_LN2_HI) - n * EXP_LN2_LO
    p = r * EXP_P0 + EXP_P1
    p = p * r + EXP_P2
    p = p * r + EXP_P3
    p = p * r + EXP_P4
    p = p * r + EXP_P5
    y = (p * (r * r) + r) + 1.0
    scale = ((n.to(tl.int32) + FP32_EXPONENT_BIAS) << FP32_MANTISSA_BITS).to(tl.float32, bitcast=True)
    return tl.where(x >= EXP_MIN, y * scale, 0.0)


@triton.jit
def _lanes(d, P, flag):
    """Mask of the first ``P`` lanes of ``d`` where the scalar ``flag`` holds, else none.

    Built by comparison rather than ``d < P & flag``: the interpreter broadcasts a scalar int1 to int32
    lanes, and an int32 mask is rejected by its loads.
    """
    return d < tl.where(flag, P, 0)


@triton.jit
def _wrap(x, capacity):
    """``x % capacity`` for ``0 <= x < 2 capacity``: a compare and a select where ``%`` costs an integer
    division (about 20 instructions) per row."""
    return tl.where(x >= capacity, x - capacity, x)


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
    first_ring_row,
    chunk_start,
    ring_base,
    j,
    d,
):
    """Row ``j`` (0..7) of the region closed by token ``target``, as bf16 ``(z, k)``: one load each, from
    the step's inputs if that token is in this step, else from the request's ring.
    ``first_ring_row`` is row 0's ring row within the request's block, ``(target position - 7) % capacity``.

    The choice is made on scalars (the row's base pointers, and the lane strides, which are the same
    constant 1 when all tensors are contiguous, and then fold away): a row costs each thread one 64-bit
    add per load rather than two pointer vectors and a select.
    """
    flat = target - (REGION_SIZE - 1) + j
    from_ring = flat < chunk_start
    ring_row = ring_base + _wrap(first_ring_row + j, capacity)  # capacity >= 7: at most one wrap
    ring_k = ring_ptr + ring_row.to(tl.int64) * stride_ring0
    k_base = tl.where(from_ring, ring_k, index_k_ptr + flat.to(tl.int64) * stride_k0)
    z_base = tl.where(from_ring, ring_k + P * stride_ring1, index_z_ptr + flat.to(tl.int64) * stride_z0)
    k = tl.load(k_base + d * tl.where(from_ring, stride_ring1, stride_k1), mask=d < P)
    z = tl.load(z_base + d * tl.where(from_ring, stride_ring1, stride_z1), mask=d < P)
    return z, k


@triton.jit
def fold_step(m, s, a, z, k):
    """One online-softmax step (torch_kernel.fold_region): the state rescales by ``e`` if ``z`` is the new
    maximum, else the row weighs ``e``; the other factor is ``exp(m' - m')``: 1, or 0 for an infinite or
    NaN ``m'``.

    ``max``/``min`` propagate NaN, as ``torch.maximum``/``torch.minimum`` do: Triton's default (a GPU's
    ``max.f32``, the interpreter's ``np.fmax``) returns the other operand, so a NaN in ``z`` would be folded
    as if it were ``m`` and give other finite bits than the PyTorch kernel.
    """
    m_new = tl.maximum(m, z, propagate_nan=tl.PropagateNan.ALL)
    e = exp_fp32(tl.minimum(m, z, propagate_nan=tl.PropagateNan.ALL) - m_new)
    unit = tl.where(m_new - m_new == 0.0, 1.0, 0.0)
    grew = z > m
    alpha = tl.where(grew, e, unit)
    beta = tl.where(grew, unit, e)
    return m_new, s * alpha + beta, a * alpha + beta * k


@triton.jit
def _csa_ring_update_kernel(
    index_k_ptr,  # [T, P] bf16
    index_z_ptr,  # [T, P] bf16
    ring_ptr,  # [num_rows, 2P] bf16, a row is [k | z]
    summary_ptr,  # [num_slots, P] bf16, or uint8 fp8 codes
    position_ptr,  # [T] int32, the five token_* metadata tensors
    chunk_start_ptr,
    chunk_len_ptr,
    ring_base_ptr,
    summary_slot_ptr,
    errors_ptr,  # [1] int32, or any pointer when HAS_ERRORS is off
    num_rows,
    num_slots,
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
    HAS_ERRORS: tl.constexpr,
):
    t = tl.program_id(0)
    if REVERSE_GRID:
        t = tl.num_programs(0) - 1 - t
    d = tl.arange(0, BLOCK_P)

    # Load wave 1, addressed by the program id alone: the metadata and the token's own row (read whether
    # or not the token stores it; a padding token's row is a row of the [T, P] inputs all the same).
    position = tl.load(position_ptr + t)
    chunk_start = tl.load(chunk_start_ptr + t)
    chunk_len = tl.load(chunk_len_ptr + t)
    ring_base = tl.load(ring_base_ptr + t)
    own_slot = tl.load(summary_slot_ptr + t)
    # A leader's replay writes the summary slot of the request's first closing token, t + first_close with
    # first_close in 0..6 (known only from `position`): loading all 7 candidates now, addressed by t alone,
    # spares a load that would wait for this wave. Tokens past the request's are never picked.
    slots = (own_slot,)
    for c in tl.static_range(1, REGION_SIZE - 1):
        slots = slots + (tl.load(summary_slot_ptr + t + c, mask=t + c < tl.num_programs(0), other=-1),)
    k_own = tl.load(index_k_ptr + t.to(tl.int64) * stride_k0 + d * stride_k1, mask=d < P)
    z_own = tl.load(index_z_ptr + t.to(tl.int64) * stride_z0 + d * stride_z1, mask=d < P)

    # Ids that become addresses, checked once on wave-1 scalars (stepops.ops.bounds): a real token whose
    # chunk lies outside the step or whose ring lies outside `ring` is not real, so it reads and writes
    # nothing; it and a summary slot outside the cache (never written, below) are counted.
    ids_ok = (chunk_start >= 0) & (chunk_start <= t) & (position >= t - chunk_start)
    ids_ok = ids_ok & (chunk_len >= 0) & (chunk_len <= tl.num_programs(0) - chunk_start)
    ids_ok = ids_ok & (ring_base >= 0) & (ring_base <= num_rows - capacity)
    count_error(errors_ptr, ((position >= 0) & (ids_ok == 0)) | bad_id(own_slot, num_slots), HAS_ERRORS)
    real = (position >= 0) & ids_ok
    offset = t - chunk_start
    start_position = position - offset  # the request's first position in this step
    is_leader = real & (offset == 0)
    # The request's first closing token; its replay reads the ring iff it is among the step's first 7
    # tokens. The leader then reads those ring rows and stores the step's rows that land on them, whether
    # or not the token has a summary slot: so which rows are deferred is known from wave 1.
    first_close = (REGION_SIZE - 1 - start_position % REGION_SIZE) % REGION_SIZE
    ring_replay = real & (first_close < REGION_SIZE - 1) & (first_close < chunk_len)
    leads_ring_replay = is_leader & ring_replay
    own_replay = real & (position % REGION_SIZE == REGION_SIZE - 1) & (offset >= REGION_SIZE - 1) & (own_slot >= 0)
    # This program's replay: the leader runs the ring replay; others run their own input-only replay.
    replay = leads_ring_replay | own_replay
    target = tl.where(is_leader, chunk_start + first_close, t)
    slot = own_slot
    for c in tl.static_range(1, REGION_SIZE - 1):
        slot = tl.where(is_leader & (first_close == c), slots[c], slot)
    # A closing position is 8r + 7 >= 7, so the dividend is never negative where the row is used.
    first_ring_row = (tl.where(is_leader, start_position + first_close, position) - (REGION_SIZE - 1)) % capacity

    # Ring rows the request's ring replay reads: positions [read_first, read_first + num_read).
    read_first = start_position + first_close - (REGION_SIZE - 1)
    num_read = REGION_SIZE - 1 - first_close

    # A scalar branch on a wave-1 value: uniform across the program (so its barrier is reached by all of
    # the program's threads or none), and it spares the interpreter the masked loads of tokens that do not
    # replay.
    if replay:
        # Load wave 2, addressed by wave-1 values only: the region's 8 rows and the leader's deferred rows.
        rows = ()
        for j in tl.static_range(REGION_SIZE):
            rows = rows + (
                _load_region_row(
                    index_k_ptr, index_z_ptr, ring_ptr, stride_k0, stride_k1, stride_z0, stride_z1, stride_ring0,
                    stride_ring1, capacity, P, target, first_ring_row, chunk_start, ring_base, j, d,
                ),
            )  # fmt: skip
        # The deferred rows as one [8, BLOCK_P] tile (row 7 unused), loaded now rather than after the
        # barrier, where they would cost a third round trip: the ring row of read position read_first + i
        # is overwritten by the step's stored position q = read_first + i (mod capacity), if any: the first
        # stored position store_first plus (ring row - store_first) mod capacity.
        # int64: a step ending at position 2**31 - 1 has its end (and a q past it) beyond int32, and metadata
        # that break the caller's invariants (a leader's position past its request's tokens') would wrap
        # store_first around, and with it q and the deferred rows' flat index, out of the step's rows.
        store_first = start_position.to(tl.int64) + tl.maximum(chunk_len - capacity, 0)
        i = tl.arange(0, REGION_SIZE)[:, None]
        read_row = _wrap(read_first % capacity + i, capacity)  # read_first >= 0 where the rows are used
        q = store_first + _wrap(read_row - store_first % capacity + capacity, capacity)
        deferred = (i < tl.where(leads_ring_replay, num_read, 0)) & (q < start_position.to(tl.int64) + chunk_len)
        deferred = deferred & (d[None, :] < P)
        src = (chunk_start + q - start_position).to(tl.int64)
        k_deferred = tl.load(index_k_ptr + src * stride_k0 + d[None, :] * stride_k1, mask=deferred)
        z_deferred = tl.load(index_z_ptr + src * stride_z0 + d[None, :] * stride_z1, mask=deferred)

        # The ring replay's reads complete before any of this program's threads stores a ring row (the
        # read-before-store rule); and no compiler moves a load across the barrier.
        tl.debug_barrier()

        # A branch of its own (no slot, no summary), so the fold is a basic block after the loads: in one
        # block with them, ptxas moves later rows' loads between the first fold steps (the PTX has them
        # all first; the barrier does not stop arithmetic), each then a round trip after the step before
        # it: 4 round trips instead of 2 at P = 256 (7 with 2 warps), as gpu_build reads off the SASS.
        if in_extent(slot, num_slots):
            z, k = rows[0]
            m = z.to(tl.float32)
            s = tl.full([BLOCK_P], 1.0, dtype=tl.float32)
            a = k.to(tl.float32)
            for j in tl.static_range(1, REGION_SIZE):
                z, k = rows[j]
                m, s, a = fold_step(m, s, a, z.to(tl.float32), k.to(tl.float32))
            summary = round_fp32_to_bf16(tl.math.div_rn(a, s))
            summary_offsets = slot.to(tl.int64) * stride_summary0 + d * stride_summary1
            if FP8_SUMMARY:
                tl.store(summary_ptr + summary_offsets, fp8_e4m3_code(summary), mask=d < P)
            else:
                tl.store(summary_ptr + summary_offsets, summary.to(tl.bfloat16), mask=d < P)

        ring_deferred = (ring_base + read_row).to(tl.int64) * stride_ring0 + d[None, :] * stride_ring1
        tl.store(ring_ptr + ring_deferred, k_deferred, mask=deferred)
        tl.store(ring_ptr + ring_deferred + P * stride_ring1, z_deferred, mask=deferred)

    stores = real & (offset >= chunk_len - capacity)
    kept = (ring_replay == 0) | ((position - read_first) % capacity >= num_read)  # not deferred to the leader
    own = _lanes(d, P, stores & kept)
    ring_offsets = (ring_base + position % capacity).to(tl.int64) * stride_ring0 + d * stride_ring1
    tl.store(ring_ptr + ring_offsets, k_own, mask=own)
    tl.store(ring_ptr + ring_offsets + P * stride_ring1, z_own, mask=own)


_launch_csa_ring_update = CachedLaunch(_csa_ring_update_kernel)


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
    errors: torch.Tensor | None = None,
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
        errors,
    )
    num_tokens, proxy_dim = index_k.shape
    block_p = max(next_power_of_2(proxy_dim), 1)  # P = 0: one masked lane, as the PyTorch kernel runs
    if layouts.REGION_SIZE * block_p > MAX_TILE_NUMEL:  # the deferred rows' tile
        raise tile_too_large("csa_ring_update", layouts.REGION_SIZE, block_p, P=proxy_dim)
    if num_tokens == 0:
        return
    # The kernel reads token t's metadata at `pointer + t`: strided [T] views become contiguous copies,
    # never reads of other tokens' entries.
    token_position, token_chunk_start, token_chunk_len, token_ring_base, token_summary_slot = (
        t.contiguous()
        for t in (token_position, token_chunk_start, token_chunk_len, token_ring_base, token_summary_slot)
    )
    fp8 = summary_cache.dtype in _meta.FP8_SUMMARY_DTYPES
    # fp8 codes are computed with integer ops and stored as bytes (see fp8_e4m3_code).
    summary = summary_cache.view(torch.uint8) if fp8 else summary_cache
    _launch_csa_ring_update(
        (num_tokens,),
        index_k,
        index_z,
        ring,
        summary,
        token_position,
        token_chunk_start,
        token_chunk_len,
        token_ring_base,
        token_summary_slot,
        token_position if errors is None else errors,  # any pointer when there is no counter: never touched
        ring.shape[0],
        summary.shape[0],
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
        HAS_ERRORS=errors is not None,
        # About 2 lanes of P per thread, at most 4 warps (one per SM sub-partition): a thread holds its
        # lanes of all 8 rows and 7 deferred rows before the fold, so at P = 256 two warps needed 107-120
        # registers and spilled 8 B on sm_80 with Triton 3.6; four halve that and the fold's time.
        num_warps=max(1, min(4, block_p // 64)),
        # Keep `s * alpha + beta` two roundings, as in the PyTorch kernel, so the summaries match bitwise.
        enable_fp_fusion=False,
    )

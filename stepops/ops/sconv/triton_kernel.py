"""The Triton kernel of ``stepops::sconv`` (CUDA; CPU tensors under ``TRITON_INTERPRET=1`` in tests).

One launch per call: one stream, or streams adjacent in ``D`` taken as one wider stream (Inkling's K+V
call). Program ``(t, g, b)`` owns token ``t``, heads ``[g * HEADS, (g+1) * HEADS)`` and the stream's
channels ``[b * BLOCK_W, (b+1) * BLOCK_W)`` of each of them: it stores the token's input at its own slot
(inside the stream's D-range) and convolves its ``W`` taps. Tiling by head keeps every load and store a
contiguous run of one head's channels, in ``x`` and in the cache alike, so the compiler can vectorise
them. The grid
depends only on ``T``, ``H`` and the stream width, so a step captures in a CUDA graph; all metadata are
read on the device.

No read/store hazard between programs: a program stores only the slot of its own position ``p >= p0``
(``p0`` = its request's first position in this step) and reads from the cache only positions
``q < p0`` of its request; taps at ``q >= p0`` come from ``x``, which nobody writes. In a valid step a
stored slot is therefore never a slot any program reads (different positions of one request have
different slots, requests do not write each other's blocks; ``validate=True`` of the wrapper checks
this on the host), and no program's result depends on the order in which programs run.

Arithmetic follows ``torch_kernel.py`` step for step (see its header): bf16 loads widened to fp32,
products and sums rounded separately (FMA contraction is switched off at launch so a GPU gives the same
bits), one fp32 -> bf16 rounding at the end done on the integer bits so the interpreter rounds to
nearest even like PyTorch. With ``silu=True`` the ``exp`` is the platform's (numpy's in the interpreter,
the GPU's fast ``exp``), which may differ from PyTorch's by a few fp32 ulps: see
``TOLERANCES["sconv_silu"]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepops._meta.sconv import check_sconv_args
from stepops.ops.triton_bounds import bad_id, block_and, count_error, in_extent
from stepops.ops.triton_launch import CachedLaunch, cdiv, next_power_of_2
from stepops.ops.triton_rounding import round_fp32_to_bf16

# Channels of one head per program, capped so one program's W taps (W x-rows + W cache rows of BLOCK_W
# bf16, plus the weights) stay in registers.
_MAX_BLOCK_W = 1024
# bf16 channels per thread: 8 is one 128-bit access. A program covers at least one warp's worth (32 x 8 =
# 256 channels) when the call has that many: a 128-wide stream takes two heads per program, so its accesses
# are 128-bit too. Warps =
# channels per program // 256, at most four.
_CHANNELS_PER_THREAD = 8
_CHANNELS_PER_WARP = 32 * _CHANNELS_PER_THREAD
_MAX_NUM_WARPS = 4


@triton.jit
def silu_fp32(a):
    """``a / (1 + exp(-a))`` in fp32, as ``silu_fp32`` of the PyTorch kernel. ``div_rn``: IEEE division on
    the GPU too (plain fp32 ``/`` lowers to an approximate divide there)."""
    return tl.math.div_rn(a, 1.0 + tl.exp(-a))


@triton.jit
def _sconv_kernel(
    x_ptr,  # [T, H * width] bf16, head-major
    weight_ptr,  # [H * width, W] bf16 or fp32
    cache_ptr,  # [num_blocks, H, N, D] bf16, the stream at D-range [stream_offset, + width)
    block_table_ptr,  # [R, max_blocks] int32
    token_request_ptr,  # [T] int32, the four token metadata tensors, -1 for padding
    token_chunk_start_ptr,
    slot_mapping_ptr,
    token_position_ptr,
    y_ptr,  # [T, H * width] bf16, written
    errors_ptr,  # [1] int32, or any pointer when HAS_ERRORS is off
    num_tokens,
    num_heads,
    width,
    block_size,
    num_blocks,
    num_requests,
    max_blocks,
    stream_offset,
    stride_x_token,
    stride_x_channel,
    stride_weight_channel,
    stride_weight_tap,
    stride_cache_block,
    stride_cache_head,
    stride_cache_slot,
    stride_cache_dim,
    stride_table_request,
    stride_table_block,
    stride_y_token,
    KERNEL_SIZE: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program
    BLOCK_W: tl.constexpr,  # channels of each head per program
    HAS_ERRORS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    column = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BLOCK_W], inside each head's stream
    tile = (head < num_heads)[:, None] & (column < width)[None, :]  # [HEADS, BLOCK_W]
    channel = head[:, None] * width + column[None, :]  # this tile's channels of x, y and the weight

    # The token's metadata are scalars, loaded once, all four at the same time; every address below that
    # depends on them is masked to its tensor's extent (stepops.ops.bounds): a token whose request, chunk
    # start or slot is out of range, or that reads a block past the cache, reads zeros there, writes
    # nothing there, and is counted once (by its first head group and channel block).
    request = tl.load(token_request_ptr + token).to(tl.int64)
    chunk_start = tl.load(token_chunk_start_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    position = tl.load(token_position_ptr + token).to(tl.int64)
    is_real = in_extent(request, num_requests)
    bad = bad_id(request, num_requests) | (
        is_real & ((chunk_start < 0) | (chunk_start > token) | bad_id(slot, num_blocks * block_size))
    )
    first_position = position - tl.minimum(token - chunk_start, position)  # max(p0, 0): a tap before 0 is zero

    # Offset of each channel inside one cache slot: its head, then its place in the stream's D-range.
    cache_channel = (
        head[:, None].to(tl.int64) * stride_cache_head + (stream_offset + column)[None, :].to(tl.int64) * stride_cache_dim
    )
    x_channel = channel.to(tl.int64) * stride_x_channel

    acc = tl.zeros([HEADS, BLOCK_W], dtype=tl.float32)
    one = tl.arange(0, 1)
    bad_block = one < 0  # [1]: a tap read a block past the cache
    for j in tl.static_range(KERNEL_SIZE):
        q = position - (KERNEL_SIZE - 1) + j
        in_step = is_real & (q >= first_position)
        in_cache = is_real & (q >= 0) & (q < first_position)
        x_row = token - (KERNEL_SIZE - 1 - j)
        from_x = tl.load(
            x_ptr + x_row * stride_x_token + x_channel,
            mask=block_and(tile, in_step & in_extent(x_row, num_tokens)),
            other=0.0,
        ).to(tl.float32)
        # Masked-off addresses are still formed: keep them non-negative.
        q_safe = tl.maximum(q, 0)
        block_column = q_safe // block_size
        # An unallocated block (a column past the table, or a negative entry) is a zero tap, as in the
        # PyTorch kernel: its table entry and its cache row are never read.
        in_table = in_cache & (block_column < max_blocks)
        # The table entry as a one-element block (a scalar load cannot take the scalar mask, see block_and),
        # broadcast over the tile as it is: no reduction between it and the cache load it addresses.
        in_table_1 = block_and(one == 0, in_table)
        block = tl.load(
            block_table_ptr + tl.maximum(request, 0) * stride_table_request + block_column * stride_table_block
            + one,
            mask=in_table_1,
            other=-1,
        ).to(tl.int64)  # [1]
        bad_block = bad_block | (in_table_1 & (block >= num_blocks))
        allocated = in_table_1 & in_extent(block, num_blocks)
        from_cache = tl.load(
            cache_ptr + tl.maximum(block, 0) * stride_cache_block + (q_safe % block_size) * stride_cache_slot
            + cache_channel,
            mask=tile & allocated,
            other=0.0,
        ).to(tl.float32)
        tap_j = tl.where(in_step, from_x, from_cache)
        # Tap j of the tile's channels: one contiguous vector load per thread when the weight is stored
        # tap-major (stride 1 along channels, as the models keep it), strided element loads otherwise.
        w_j = tl.load(weight_ptr + channel * stride_weight_channel + j * stride_weight_tap, mask=tile, other=0.0)
        acc = acc + w_j.to(tl.float32) * tap_j

    if SILU:
        acc = silu_fp32(acc)
    x_own = tl.load(x_ptr + token * stride_x_token + x_channel, mask=block_and(tile, is_real), other=0.0)
    if RESIDUAL:
        acc = acc + x_own.to(tl.float32)
    # A padding token's row of y is 0: its taps are masked to 0, but a non-finite weight times 0 is NaN.
    acc = tl.where(is_real, acc, 0.0)
    tl.store(y_ptr + token * stride_y_token + channel, round_fp32_to_bf16(acc).to(tl.bfloat16), mask=tile)

    stores = is_real & in_extent(slot, num_blocks * block_size)
    slot_safe = tl.where(stores, slot, 0)
    tl.store(
        cache_ptr + (slot_safe // block_size) * stride_cache_block + (slot_safe % block_size) * stride_cache_slot
        + cache_channel,
        x_own,
        mask=block_and(tile, stores),
    )
    bad = bad | (tl.max(bad_block.to(tl.int32), axis=0) > 0)
    count_error(errors_ptr, bad & (tl.program_id(1) == 0) & (tl.program_id(2) == 0), HAS_ERRORS)


_launch_sconv = CachedLaunch(_sconv_kernel)


def sconv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    token_request: torch.Tensor,
    token_chunk_start: torch.Tensor,
    slot_mapping: torch.Tensor,
    token_position: torch.Tensor,
    stream_offset: int,
    residual: bool = True,
    silu: bool = False,
    errors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch :func:`_sconv_kernel` on grid ``(T, cdiv(H, HEADS), cdiv(width, BLOCK_W))``; semantics of
    ``sconv_torch``."""
    num_tokens, num_heads, width, kernel_size, block_size = check_sconv_args(
        x, weight, cache, block_table, token_request, token_chunk_start, slot_mapping, token_position,
        stream_offset, errors,
    )  # fmt: skip
    channels = num_heads * width
    y = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    # The kernel reads token t's metadata at `pointer + t`: strided [T] views (e.g. columns of one [T, 4]
    # table) become contiguous copies, never reads of other tokens' entries.
    token_request, token_chunk_start, slot_mapping, token_position = (
        t.contiguous() for t in (token_request, token_chunk_start, slot_mapping, token_position)
    )
    block_w = min(next_power_of_2(width), _MAX_BLOCK_W)
    heads = min(max(_CHANNELS_PER_WARP // block_w, 1), next_power_of_2(num_heads))
    _launch_sconv(
        (num_tokens, cdiv(num_heads, heads), cdiv(width, block_w)),
        x,
        weight,
        cache,
        block_table,
        token_request,
        token_chunk_start,
        slot_mapping,
        token_position,
        y,
        slot_mapping if errors is None else errors,  # any pointer when there is no counter: never touched
        num_tokens,
        num_heads,
        width,
        block_size,
        cache.shape[0],
        block_table.shape[0],
        block_table.shape[1],
        stream_offset,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        *cache.stride(),
        block_table.stride(0),
        block_table.stride(1),
        y.stride(0),
        KERNEL_SIZE=kernel_size,
        RESIDUAL=residual,
        SILU=silu,
        HEADS=heads,
        BLOCK_W=block_w,
        HAS_ERRORS=errors is not None,
        num_warps=min(max(heads * block_w // _CHANNELS_PER_WARP, 1), _MAX_NUM_WARPS),
        # Separate rounding of every product and sum, as in the PyTorch kernel, so GPU and CPU agree bit
        # for bit; the kernel is memory-bound, the lost FMAs cost nothing measurable.
        enable_fp_fusion=False,
    )
    return y

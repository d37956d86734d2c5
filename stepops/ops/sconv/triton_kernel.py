"""The Triton kernel of ``stepops::sconv`` (CUDA; CPU tensors under ``TRITON_INTERPRET=1`` in tests).

One launch per stream. Program ``(t, b)`` owns token ``t`` and channels ``[b * BLOCK_C, (b+1) * BLOCK_C)``
of ``x``'s ``H * width`` head-major channels: it stores the token's input at its own slot (inside the
stream's D-range of every head) and convolves its ``W`` taps. The grid depends only on ``T`` and the
channel count, so a step captures in a CUDA graph; all metadata are read on the device.

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

# Channels per program, capped so one program's W taps (W x-rows + W cache rows of BLOCK_C bf16, plus
# the weights) stay in registers; 1024 bf16 = 2 KiB per row keeps each load a few 128-bit transactions per
# thread at 4 warps.
_MAX_BLOCK_C = 1024
_NUM_WARPS = 4


@triton.jit
def _round_fp32_to_bf16(value):
    """Round fp32 to the nearest bf16 value (ties to even), returned as fp32, with integer ops.

    The interpreter's fp32 -> bf16 cast truncates; adding ``0x7FFF + lsb`` before dropping the low 16 bits
    is PyTorch's round-to-nearest-even. NaN keeps its own bits (the carry could turn a NaN into Inf).
    """
    bits = value.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    bits = (bits >> 16) << 16
    rounded = bits.to(tl.float32, bitcast=True)
    return tl.where(value != value, value, rounded)


@triton.jit
def _sconv_kernel(
    x_ptr,
    weight_ptr,
    cache_ptr,
    block_table_ptr,
    token_request_ptr,
    token_chunk_start_ptr,
    slot_mapping_ptr,
    token_position_ptr,
    y_ptr,
    channels,
    width,
    block_size,
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
    BLOCK_C: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channel < channels

    # Token scalars are broadcast over the channel block, so every mask below is built from block-shaped
    # comparisons: triton 3.9's interpreter gives a splatted scalar bool an int32 payload, which tl.load
    # rejects as a mask. On a GPU the broadcast loads of one address cost one transaction per warp.
    zero = tl.zeros([BLOCK_C], dtype=tl.int64)
    request = tl.load(token_request_ptr + token).to(tl.int64) + zero
    is_real = request >= 0
    position = tl.load(token_position_ptr + token).to(tl.int64) + zero
    first_position = position - (token - tl.load(token_chunk_start_ptr + token).to(tl.int64))
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64) + zero

    # Offset of each channel inside one cache slot: its head, then its place in the stream's D-range.
    head = channel // width
    cache_channel = head.to(tl.int64) * stride_cache_head + (stream_offset + channel - head * width).to(
        tl.int64
    ) * stride_cache_dim
    x_channel = channel.to(tl.int64) * stride_x_channel

    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL_SIZE):
        q = position - (KERNEL_SIZE - 1) + j
        in_step = is_real & (q >= first_position)
        in_cache = is_real & (q >= 0) & (q < first_position)
        from_x = tl.load(
            x_ptr + (token - (KERNEL_SIZE - 1 - j)) * stride_x_token + x_channel,
            mask=channel_mask & in_step,
            other=0.0,
        ).to(tl.float32)
        # Masked-off lanes still form addresses: keep them non-negative.
        q_safe = tl.maximum(q, 0)
        block = tl.load(
            block_table_ptr + request * stride_table_request + (q_safe // block_size) * stride_table_block,
            mask=channel_mask & in_cache,
            other=0,
        ).to(tl.int64)
        from_cache = tl.load(
            cache_ptr + block * stride_cache_block + (q_safe % block_size) * stride_cache_slot + cache_channel,
            mask=channel_mask & in_cache,
            other=0.0,
        ).to(tl.float32)
        tap = tl.where(in_step, from_x, from_cache)
        w = tl.load(weight_ptr + channel * stride_weight_channel + j * stride_weight_tap, mask=channel_mask, other=0.0)
        acc = acc + w.to(tl.float32) * tap

    if SILU:
        # div_rn: IEEE division on the GPU too (plain fp32 `/` lowers to an approximate divide there).
        acc = tl.math.div_rn(acc, 1.0 + tl.exp(-acc))
    x_own = tl.load(x_ptr + token * stride_x_token + x_channel, mask=channel_mask & is_real, other=0.0)
    if RESIDUAL:
        acc = acc + x_own.to(tl.float32)
    acc = tl.where(is_real, acc, 0.0)
    tl.store(y_ptr + token * stride_y_token + channel, _round_fp32_to_bf16(acc).to(tl.bfloat16), mask=channel_mask)

    stores = is_real & (slot >= 0)
    slot_safe = tl.maximum(slot, 0)
    tl.store(
        cache_ptr + (slot_safe // block_size) * stride_cache_block + (slot_safe % block_size) * stride_cache_slot
        + cache_channel,
        x_own,
        mask=channel_mask & stores,
    )


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
) -> torch.Tensor:
    """Launch :func:`_sconv_kernel` on grid ``(T, cdiv(H * width, BLOCK_C))``; semantics of ``sconv_torch``."""
    num_tokens, num_heads, width, kernel_size, block_size = check_sconv_args(
        x, weight, cache, block_table, token_request, token_chunk_start, slot_mapping, token_position, stream_offset
    )
    channels = num_heads * width
    y = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    block_c = min(triton.next_power_of_2(channels), _MAX_BLOCK_C)
    grid = (num_tokens, triton.cdiv(channels, block_c))
    _sconv_kernel[grid](
        x,
        weight,
        cache,
        block_table,
        token_request,
        token_chunk_start,
        slot_mapping,
        token_position,
        y,
        channels,
        width,
        block_size,
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
        BLOCK_C=block_c,
        num_warps=_NUM_WARPS,
        # Separate rounding of every product and sum, as in the PyTorch kernel, so GPU and CPU agree bit
        # for bit; the kernel is memory-bound, the lost FMAs cost nothing measurable.
        enable_fp_fusion=False,
    )
    return y

"""The naive reference of ``stepops::sconv``: token by token, tap by tap, from the documented formula.

Independent of :mod:`stepops.ops.sconv.torch_kernel` (no metadata arithmetic on tensors, one Python lookup
per tap) and summed in the op's documented order, so a kernel that follows the docs equals it bit for bit.
The op tests, the benchmark's naive provider and Inkling's recompute all use it; ``nn.Conv1d`` in
``tests/ops/test_sconv_steps.py`` is the second, independent check.
"""

from __future__ import annotations

import torch


def sconv_reference(
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
    """``torch.ops.stepops.sconv``'s arguments and effect (``y`` returned, inputs stored in ``cache``).

    Each tap of token ``t`` at position ``q = p - (W-1) + j`` is zero (``q < 0``), row ``t - (p - q)`` of
    ``x`` (this step), zero (an unallocated block) or the cache slot as it was before the step; the taps
    are summed in fp32 in order ``j = 0 .. W-1`` and rounded once. Stores come after every read.
    """
    num_heads, block_size = cache.shape[1], cache.shape[2]
    width = x.shape[1] // num_heads
    kernel_size = weight.shape[1]
    request, chunk_start = token_request.tolist(), token_chunk_start.tolist()
    slots, position = slot_mapping.tolist(), token_position.tolist()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        r, p = request[t], position[t]
        if r < 0:
            continue
        first = p - (t - chunk_start[t])
        zero = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        acc = zero
        for j in range(kernel_size):
            q = p - (kernel_size - 1) + j
            if q < 0:
                tap = zero
            elif q >= first:
                tap = x[t - (p - q)].float()
            elif q // block_size >= block_table.shape[1] or int(block_table[r, q // block_size]) < 0:
                tap = zero  # an unallocated block reads as zero
            else:
                block = int(block_table[r, q // block_size])
                tap = cache[block, :, q % block_size, stream_offset : stream_offset + width].reshape(-1).float()
            acc = acc + weight[:, j].float() * tap
        if silu:
            acc = acc / (1.0 + torch.exp(-acc))
        if residual:
            acc = acc + x[t].float()
        y[t] = acc.to(x.dtype)
    for t, slot in enumerate(slots):
        if request[t] >= 0 and slot >= 0:
            cache[slot // block_size, :, slot % block_size, stream_offset : stream_offset + width] = x[t].view(
                num_heads, width
            )
    return y


def short_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, *, residual: bool = True, silu: bool = False
) -> torch.Tensor:
    """One whole sequence ``x [L, C]`` with no cache: :func:`sconv_reference` as one request, nothing stored."""
    length = x.shape[0]
    none = torch.full((length,), -1, dtype=torch.int32, device=x.device)
    request = torch.zeros(length, dtype=torch.int32, device=x.device)
    position = torch.arange(length, dtype=torch.int32, device=x.device)
    cache = x.new_empty(1, 1, 1, x.shape[1])
    block_table = torch.zeros(1, 0, dtype=torch.int32, device=x.device)
    return sconv_reference(
        x, weight, cache, block_table, request, request, none, position, 0, residual=residual, silu=silu
    )

"""The PyTorch kernel of ``stepops::sconv``: the readable specification the Triton kernel must match.

Arithmetic order (the Triton kernel repeats it step for step, so the two agree bit for bit wherever the
hardware does not contract a multiply and an add into an FMA):

    acc = 0.0                                     # fp32
    for j in 0 .. W-1:  acc = acc + w[c, j] * tap_j   # one rounded multiply, then one rounded add
    if silu:            acc = acc / (1.0 + exp(-acc))
    if residual:        acc = acc + x_t[c]
    y[t, c] = bf16(acc)                           # round to nearest even, once
"""

from __future__ import annotations

import torch

from stepops._meta.sconv import check_sconv_args
from stepops.ops.bounds import IdCheck, any_bad_ids, bad_ids_error
from stepops.ops.put_rows import put_rows_


def silu_fp32(a: torch.Tensor) -> torch.Tensor:
    """``a / (1 + exp(-a))`` in fp32: one rounded ``exp``, add and IEEE division (not ``a * sigmoid(a)``,
    whose extra rounding changes fp32 bits); the Triton kernel's ``silu_fp32`` is the same formula."""
    return a / (1.0 + torch.exp(-a))


def sconv_torch(
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
    """Inkling short conv of one stream over a ragged step: store each token's input, convolve W taps.

    Shapes: ``x`` ``[T, H * width]`` bf16, head-major (head ``h`` owns columns ``[h*width, (h+1)*width)``);
    ``weight`` ``[H * width, W]`` bf16 or fp32; ``cache`` ``[num_blocks, H, N, D]`` bf16 (may be a
    page-strided view), written in place; ``block_table`` ``[R, max_blocks]`` int32; ``token_request``,
    ``token_chunk_start``, ``slot_mapping``, ``token_position`` ``[T]`` int32 (``-1`` for padding);
    ``stream_offset`` int. Returns ``y`` ``[T, H * width]`` bf16 (a new tensor).

    The stream occupies D-range ``[stream_offset, stream_offset + width)`` of every head. Token ``t``
    (request ``r``, position ``p``, first row of its request in this step ``s``, first position
    ``p0 = p - (t - s)``):

    - store: ``cache[slot // N, h, slot % N, stream_offset + i] = x[t, h * width + i]`` for every head,
      with ``slot = slot_mapping[t]``; nothing else of the cache is written.
    - output: ``y[t, c] = bf16(x[t, c] + sum_{j<W} w[c, j] * tap_j[c])`` in fp32, summed in order
      ``j = 0 .. W-1``, where ``tap_j`` is the input at position ``q = p - (W-1) + j``: row ``t - (p - q)``
      of ``x`` when ``q >= p0`` (this step), the cache slot ``block_table[r, q // N] * N + q % N`` when
      ``0 <= q < p0`` (earlier steps), zero when ``q < 0``. An earlier position whose block is not
      allocated (a negative block-table entry, or a column ``q // N`` past the table's width) is a zero
      tap too: neither kernel reads memory for it. ``silu=True`` applies
      ``a / (1 + exp(-a))`` to the conv sum before the residual; ``residual=False`` drops ``x[t, c]``.

    Padding tokens (``token_request[t] = -1``) write nothing and get a zero row of ``y``; a real token
    with ``slot_mapping[t] = -1`` gets its output but is not stored.

    Memory safety (``stepops.ops.bounds``): ``token_request`` must be -1 or a row of ``block_table``, a
    real token's ``token_chunk_start`` in ``[0, t]``, its slot -1 or in ``[0, num_blocks * N)``, and every
    block it reads negative or in ``[0, num_blocks)``. This kernel raises ``ValueError`` before writing
    anything otherwise; the Triton kernel masks such addresses (nothing written, zeros read) and counts
    the token in ``errors`` (int32 ``[1]``, optional; never written here). Reads see the cache as it was before
    the step (a valid step never reads a slot it stores, see ``docs/ops.md``).

    Caller invariants (checked on the host by ``validate=True`` of the wrapper): the rows of a request
    are contiguous, in position order, starting at ``token_chunk_start``; ``slot_mapping[t]`` is the slot
    of ``p``; every block read or written lies in ``[0, num_blocks)`` (``validate=True`` also rejects the
    unallocated blocks of earlier taps, which the kernels read as zero); stored slots are distinct and never
    among the slots the step reads.
    """
    sizes = check_sconv_args(
        x, weight, cache, block_table, token_request, token_chunk_start, slot_mapping, token_position,
        stream_offset, errors,
    )  # fmt: skip
    num_tokens, num_heads, width, kernel_size, block_size = sizes
    num_blocks, max_blocks, num_requests = cache.shape[0], block_table.shape[1], block_table.shape[0]
    stream = cache[..., stream_offset : stream_offset + width].transpose(1, 2)  # [num_blocks, N, H, width] view
    row = torch.arange(num_tokens, device=x.device, dtype=torch.int64)
    request = token_request.to(torch.int64)
    position = token_position.to(torch.int64)
    is_real = request >= 0
    first_position = (position - (row - token_chunk_start.to(torch.int64))).clamp(min=0)  # q < 0 is zero, whatever p0

    # Every tap of every token at once, [T, W]: tap j of token t is at position q = p - (W-1) + j.
    taps = torch.arange(kernel_size, device=x.device)
    q = position[:, None] - (kernel_size - 1) + taps
    in_step = is_real[:, None] & (q >= first_position[:, None])
    in_cache = is_real[:, None] & (q >= 0) & ~in_step
    q_cached = torch.where(in_cache, q, 0)
    column = q_cached // block_size
    # An empty table (R = 0, or no columns): unallocated entries keep the gather in bounds. The clamps keep
    # it in bounds for bad request ids too, which the check below reports before anything is written.
    table = block_table if block_table.numel() else block_table.new_full((max(num_requests, 1), 1), -1)
    safe_request = request.clamp(0, table.shape[0] - 1)
    block = table[safe_request[:, None], column.clamp(max=table.shape[1] - 1)].to(torch.int64)
    in_cache = in_cache & (column < max_blocks) & (block >= 0)  # an unallocated block is a zero tap

    # Every id that becomes an address is checked before anything is written (stepops.ops.bounds).
    checks = (
        IdCheck("token_request", request, num_requests, expected=f"-1 or a block_table row in [0, {num_requests})"),
        IdCheck("token_chunk_start", token_chunk_start, row + 1, where=is_real, padding=False,
                expected="in [0, t] for a real token t (the row of its request's first token in this step)"),
        IdCheck("slot_mapping", slot_mapping, num_blocks * block_size, where=is_real),
        *(IdCheck("block_table", block[:, j], num_blocks, where=in_cache[:, j], padding=False,
                  expected=f"negative (unallocated) or in [0, {num_blocks}) for every block a token reads")
          for j in range(kernel_size)),
    )  # fmt: skip
    if bool(any_bad_ids(checks)):  # the one host read
        raise bad_ids_error("sconv", checks)

    # [T, H, width] throughout, and the weights as [W, H, width]: the innermost dim is contiguous in every
    # operand (compiled, the loop over channels vectorizes).
    x_f32 = x.view(num_tokens, num_heads, width).float()
    weight_f32 = weight.float().t().reshape(kernel_size, num_heads, width)
    x_row = torch.where(in_step, row[:, None] - (kernel_size - 1) + taps, 0)
    if num_blocks:
        cached = stream[torch.where(in_cache, block, 0), q_cached % block_size]  # [T, W, H, width]
    else:  # an empty cache (no block): no tap reads it (in_cache is all False), and block 0 does not exist
        cached = x.new_zeros(num_tokens, kernel_size, num_heads, width)
    acc = torch.zeros(num_tokens, num_heads, width, dtype=torch.float32, device=x.device)
    for j in range(kernel_size):
        from_x = x_f32[x_row[:, j]]
        from_cache = torch.where(in_cache[:, j, None, None], cached[:, j].float(), 0.0)
        acc = acc + weight_f32[j] * torch.where(in_step[:, j, None, None], from_x, from_cache)
    if silu:
        acc = silu_fp32(acc)
    if residual:
        acc = acc + x_f32
    y = torch.where(is_real[:, None, None], acc, 0.0).to(x.dtype).view(num_tokens, num_heads * width)

    # Stores after all reads: the reads see the cache as it was before the step.
    slot = slot_mapping.to(torch.int64)
    stores = is_real & (slot >= 0)
    put_rows_(stream, (slot // block_size, slot % block_size), x.view(num_tokens, num_heads, width), stores)
    return y

"""Per-token metadata of ``stepops::csa_ring_update``, built on the device with no host sync."""

from __future__ import annotations

from typing import NamedTuple

import torch

from stepops.layouts import REGION_SIZE
from stepops.ops.step_metadata import (
    TokenMetadata,
    build_token_metadata,
    check_same_device,
    check_token_metadata,
    paged_slots,
    to_int32_ids,
)
from stepops.specs import check_int, is_integer_dtype


class CSARingMetadata(NamedTuple):
    """int32 tensors of shape ``[num_tokens]``; ``-1`` everywhere for a padding token."""

    position: torch.Tensor  # absolute position of the token in its sequence
    chunk_start: torch.Tensor  # flat index of the request's first token in this step
    chunk_len: torch.Tensor  # number of the request's tokens in this step
    ring_base: torch.Tensor  # first ring row of the request: ring_block * rows_per_block
    summary_slot: torch.Tensor  # summary_cache row of the region this token closes; -1 if none


def build_csa_ring_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_blocks: torch.Tensor,
    rows_per_block: int,
    summary_block_table: torch.Tensor,
    summary_block_size: int,
    num_tokens: int,
    *,
    token: TokenMetadata | None = None,
) -> CSARingMetadata:
    """Build the metadata of one step for :func:`stepops.csa_ring_update`.

    ``query_start_loc`` ``[R + 1]`` and ``seq_lens`` ``[R]`` as for
    :func:`stepops.ops.step_metadata.build_token_metadata` (``seq_lens`` counts the step's tokens).
    ``ring_blocks`` ``[R]`` int: the block of each request's ring; its rows start at
    ``ring_blocks[r] * rows_per_block``. ``summary_block_table`` ``[R, max_summary_blocks]`` int: the region
    ``g = position // 8`` of request ``r`` has its summary at slot
    ``summary_block_table[r, g // summary_block_size] * summary_block_size + g % summary_block_size``.
    A closing token gets slot ``-1`` (no summary is written) when that block-table entry is negative or its
    column is past the table's width. The four tensors must share one device (``ValueError`` otherwise);
    every output is on it and has length ``num_tokens``; nothing is read back to the host, so the builder
    can run inside a CUDA graph. ``token``: the step's :class:`~stepops.ops.step_metadata.TokenMetadata`
    when the caller has built them from the same arguments (a model step builds them once).
    """
    check_same_device(
        "build_csa_ring_metadata",
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        ring_blocks=ring_blocks,
        summary_block_table=summary_block_table,
    )
    builder = "build_csa_ring_metadata"
    if seq_lens.dim() != 1:
        raise ValueError(f"{builder}: seq_lens must be [R], got {tuple(seq_lens.shape)}")
    if ring_blocks.dim() != 1 or ring_blocks.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{builder}: ring_blocks must be [R] = [{seq_lens.shape[0]}], got {tuple(ring_blocks.shape)}")
    if (
        summary_block_table.dim() != 2
        or summary_block_table.shape[0] != seq_lens.shape[0]
        or summary_block_table.shape[1] < 1
    ):
        raise ValueError(
            f"{builder}: summary_block_table must be [R = {seq_lens.shape[0]}, max_blocks >= 1], got "
            f"{tuple(summary_block_table.shape)}"
        )
    for name, tensor in (("ring_blocks", ring_blocks), ("summary_block_table", summary_block_table)):
        if not is_integer_dtype(tensor.dtype):
            raise TypeError(f"{builder}: {name} must be an integer tensor (block ids), got {tensor.dtype}")
    check_int(f"{builder}: rows_per_block", rows_per_block, 1)
    check_int(f"{builder}: summary_block_size", summary_block_size, 1)
    if token is None:
        token = build_token_metadata(query_start_loc, seq_lens, num_tokens, builder=builder)
    else:
        check_token_metadata(builder, token, num_tokens)
    if ring_blocks.device.type == "cpu" and not torch.compiler.is_compiling():
        # Free to check on CPU: a negative block would put a ring before the cache.
        has_tokens = query_start_loc[1:] > query_start_loc[:-1]
        bad = has_tokens & (ring_blocks < 0)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            raise ValueError(
                f"{builder}: ring_blocks[{r}] = {int(ring_blocks[r])} for a request with tokens in this step; "
                "a ring block is >= 0"
            )
    if seq_lens.shape[0] == 0:  # no request: every token is padding, and there is nothing to gather
        pad = token.position
        return CSARingMetadata(pad, token.chunk_start, pad.clone(), pad.clone(), pad.clone())
    real = token.position >= 0
    request = token.request.long().clamp(min=0)  # padding reads request 0 and is masked below
    position = token.position.long()
    qsl = query_start_loc.long()
    chunk_len = qsl[request + 1] - qsl[request]
    ring_base = ring_blocks.long()[request] * rows_per_block
    # The region a closing token closes; -1 (no summary slot) for the others and for padding (position -1).
    closed_region = torch.where(position % REGION_SIZE == REGION_SIZE - 1, position // REGION_SIZE, -1)
    pad = torch.full_like(position, -1)
    return CSARingMetadata(
        position=token.position,
        chunk_start=token.chunk_start,
        chunk_len=torch.where(real, chunk_len, pad).to(torch.int32),
        ring_base=to_int32_ids(torch.where(real, ring_base, pad)),
        summary_slot=to_int32_ids(paged_slots(summary_block_table, request, closed_region, summary_block_size)),
    )

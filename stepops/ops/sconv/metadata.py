"""Per-token metadata of ``stepops::sconv``, built on the device with no host sync."""

from __future__ import annotations

from typing import NamedTuple

import torch

from stepops.ops.step_metadata import (
    TokenMetadata,
    build_token_metadata,
    check_same_device,
    check_token_metadata,
    paged_slot_mapping,
)
from stepops.specs import check_int


class SconvMetadata(NamedTuple):
    """int32 ``[T]`` tensors, in the op's argument order; ``-1`` marks a padding token everywhere."""

    token_request: torch.Tensor  # index of the token's request (row of block_table)
    token_chunk_start: torch.Tensor  # flat index of the request's first token in this step
    slot_mapping: torch.Tensor  # block * N + offset of the token's own position
    token_position: torch.Tensor  # absolute position of the token in its sequence


def build_sconv_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int,
    *,
    token: TokenMetadata | None = None,
) -> SconvMetadata:
    """Metadata of a ragged step of ``num_tokens`` flat token slots (the CUDA-graph capture size).

    ``query_start_loc`` ``[R + 1]`` int (request ``r`` owns tokens ``query_start_loc[r] :
    query_start_loc[r + 1]``), ``seq_lens`` ``[R]`` int (tokens of request ``r`` after this step),
    ``block_table`` ``[R, max_blocks]`` int32, ``block_size`` = ``N`` of the cache. Token ``t`` at position
    ``p`` of request ``r`` gets ``slot_mapping[t] = block_table[r, p // N] * N + p % N``; tokens past
    ``query_start_loc[-1]`` are padding (``-1``). A real token whose block is not allocated (a negative
    block-table entry, or a column ``p // N`` past the table's width) gets slot ``-1``: the op computes its
    output but stores nothing, rather than writing another position's slot. The three tensors must share
    one device (``ValueError`` otherwise); everything stays on it and shapes depend only on ``num_tokens``.
    ``token``: the step's :class:`~stepops.ops.step_metadata.TokenMetadata` when the caller has built them
    from the same arguments (a model step builds them once).
    """
    check_same_device(
        "build_sconv_metadata", block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens
    )
    check_int("build_sconv_metadata: block_size (the cache's N, cache.shape[2])", block_size, 1)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[1] < 1:
        raise ValueError(
            f"build_sconv_metadata: block_table must be [R, max_blocks] int32 with max_blocks >= 1, got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    if block_table.shape[0] != seq_lens.numel():
        raise ValueError(
            f"build_sconv_metadata: block_table has {block_table.shape[0]} rows for {seq_lens.numel()} requests "
            "(seq_lens); it needs one row per request"
        )
    if token is None:
        token = build_token_metadata(query_start_loc, seq_lens, num_tokens, builder="build_sconv_metadata")
    else:
        check_token_metadata("build_sconv_metadata", token, num_tokens)
    return SconvMetadata(
        token_request=token.request,
        token_chunk_start=token.chunk_start,
        slot_mapping=paged_slot_mapping(token, block_table, block_size),
        token_position=token.position,
    )

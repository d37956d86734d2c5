"""Per-token metadata of a ragged step, built on the device with no host sync.

A step flattens the new tokens of many requests: request ``r`` owns tokens
``query_start_loc[r] : query_start_loc[r + 1]`` and, after the step, holds ``seq_lens[r]`` tokens, so its
first new token sits at position ``seq_lens[r] - (query_start_loc[r + 1] - query_start_loc[r])``.
Buffers have a fixed length ``num_tokens`` (the CUDA-graph capture size); tokens past
``query_start_loc[-1]`` are padding and get ``-1`` everywhere. Padded requests have zero new tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stepops._meta.errors import check_arg_types
from stepops.specs import check_int, is_integer_dtype


_INT32 = torch.iinfo(torch.int32)


def to_int32_ids(ids: torch.Tensor) -> torch.Tensor:
    """int64 ``ids`` as the ops' int32, saturated rather than wrapped: an id outside int32 becomes
    ``-2**31`` or ``2**31 - 1``, which the op refuses (CPU) or masks and counts (CUDA) for any tensor of
    fewer than ``2**31 - 1`` rows. Wrapped, a garbage block id could land in range: block ``2**30`` of
    ``N = 4`` was slot 0, another request's row."""
    return ids.clamp(_INT32.min, _INT32.max).to(torch.int32)


class TokenMetadata(NamedTuple):
    """int32 tensors of shape ``[num_tokens]``; ``-1`` marks a padding token."""

    request: torch.Tensor  # index of the token's request
    chunk_start: torch.Tensor  # flat index of the request's first token in this step
    position: torch.Tensor  # absolute position of the token in its sequence


def check_same_device(builder: str, **tensors: torch.Tensor) -> None:
    """``ValueError`` naming the first tensor not on the first one's device (a builder's inputs must agree:
    a CPU index tensor gathering from a CUDA tensor would sync, or fail deep inside an op); ``TypeError``
    naming the first argument that is not a tensor at all."""
    check_arg_types(builder, tuple(tensors.items()))
    (first, first_tensor), *others = tensors.items()
    for name, tensor in others:
        if tensor.device != first_tensor.device:
            raise ValueError(
                f"{builder}: {name} is on {tensor.device}, {first} on {first_tensor.device}; "
                "all must share one device"
            )


def check_step_lengths(builder: str, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> None:
    """``ValueError``/``TypeError`` naming ``builder`` and the argument unless the step is consistent.

    Shapes, dtypes and ``num_tokens`` are always checked. The data rules (``query_start_loc`` starts at 0
    and never decreases, ends at most at ``num_tokens``; ``seq_lens[r]`` counts at least the request's
    tokens in this step, and at most ``2**31``, so every position fits int32) are checked only where they
    cost no device sync: CPU tensors, outside ``torch.compile``. On a GPU the op's ``validate=True`` reports
    their consequences.
    """
    check_int(f"{builder}: num_tokens", num_tokens, 0)
    if query_start_loc.dim() != 1 or seq_lens.dim() != 1 or query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError(
            f"{builder}: query_start_loc must be [R + 1] and seq_lens [R]; got {tuple(query_start_loc.shape)} "
            f"and {tuple(seq_lens.shape)}"
        )
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not is_integer_dtype(tensor.dtype):
            raise TypeError(f"{builder}: {name} must be an integer tensor, got {tensor.dtype}")
    if query_start_loc.device.type != "cpu" or torch.compiler.is_compiling():
        return
    qsl = query_start_loc.tolist()
    if qsl[0] != 0:
        raise ValueError(f"{builder}: query_start_loc must start at 0, got {qsl[0]}")
    query_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    for r, n in enumerate(query_lens):
        if n < 0:
            raise ValueError(
                f"{builder}: query_start_loc decreases at request {r} ({qsl[r]} -> {qsl[r + 1]}); it must be "
                "non-decreasing"
            )
    if qsl[-1] > num_tokens:
        raise ValueError(
            f"{builder}: num_tokens = {num_tokens} is less than the step's {qsl[-1]} tokens (query_start_loc[-1]); "
            "it must be at least that (the padded token count)"
        )
    for r, (n, length) in enumerate(zip(query_lens, seq_lens.tolist())):
        if length < n:
            raise ValueError(
                f"{builder}: seq_lens[{r}] = {length} is less than request {r}'s {n} tokens in this step; "
                "seq_lens counts the tokens after the step, this step's included"
            )
        if length > _INT32.max + 1:  # its positions would saturate to one int32 position (to_int32_ids)
            raise ValueError(
                f"{builder}: seq_lens[{r}] = {length} puts positions past 2**31 - 1, the last the ops' int32 "
                "metadata hold"
            )


def build_token_metadata(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, *, builder: str = "build_token_metadata"
) -> TokenMetadata:
    """Map each of ``num_tokens`` flat token slots to its request, chunk start and position.

    ``query_start_loc``: ``[R + 1]`` int, non-decreasing, starting at 0, ending at most at ``num_tokens``.
    ``seq_lens``: ``[R]`` int, each at least its request's tokens in this step, on the same device
    (``ValueError`` otherwise; the data rules are checked where that costs no sync, see
    :func:`check_step_lengths`). Every output lives on that device; shapes depend only on ``num_tokens``;
    ``R = 0`` and ``num_tokens = 0`` are allowed. ``builder`` names the caller in error messages.
    """
    check_same_device(builder, query_start_loc=query_start_loc, seq_lens=seq_lens)
    check_step_lengths(builder, query_start_loc, seq_lens, num_tokens)
    qsl = query_start_loc.to(torch.int64)
    token = torch.arange(num_tokens, device=qsl.device, dtype=torch.int64)
    if seq_lens.numel() == 0:  # a step of padding only: there is no request to point at
        pad = torch.full_like(token, -1, dtype=torch.int32)
        return TokenMetadata(request=pad, chunk_start=pad.clone(), position=pad.clone())
    # right=True skips zero-length (padded) requests: a token belongs to the last request starting at or
    # before it.
    request = torch.searchsorted(qsl, token, right=True) - 1
    is_real = token < qsl[-1]
    request = torch.where(is_real, request, torch.zeros_like(request)).clamp_(max=seq_lens.numel() - 1)
    chunk_start = qsl[request]
    query_len = qsl[request + 1] - chunk_start
    position = seq_lens.to(torch.int64)[request] - query_len + (token - chunk_start)
    pad = torch.full_like(token, -1)
    return TokenMetadata(
        request=torch.where(is_real, request, pad).to(torch.int32),
        chunk_start=torch.where(is_real, chunk_start, pad).to(torch.int32),
        position=to_int32_ids(torch.where(is_real, position, pad)),  # seq_lens may be garbage on a GPU
    )


def table_blocks(
    block_table: torch.Tensor, row: torch.Tensor, column: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block at ``column`` of ``block_table`` row ``row`` (``[R, max_blocks]``; ``row`` broadcasts against
    ``column``, both integer): int64, clamped to ``>= 0`` so that every gather through it stays in range, and
    bool, whether that block is allocated (the column inside the table and its entry not negative).

    The one rule for every paged lookup (slots of the metadata, keys of the attention): a block that is not
    allocated must be masked, never read, as block 0 belongs to another request. ``row`` must index a row of
    the table (the caller clamps padding's ``-1``).
    """
    max_blocks = block_table.shape[1]
    if max_blocks == 0:  # no block at all: nothing is allocated
        shape = torch.broadcast_shapes(row.shape, column.shape)
        return column.new_zeros(shape, dtype=torch.int64), column.new_zeros(shape, dtype=torch.bool)
    # The clamp only keeps the gather in range; the columns it changes are masked out.
    block = block_table[row, column.clamp(0, max_blocks - 1)].long()
    return block.clamp(min=0), (column >= 0) & (column < max_blocks) & (block >= 0)


def paged_slots(block_table: torch.Tensor, request: torch.Tensor, index: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``block_table[r, i // N] * N + i % N``, shaped like ``index``: the paged slot of index ``i`` (a
    token position, or a region) of request ``r`` (``request [T]``, ``index [T, ...]``, ``N = block_size``).

    ``-1`` where the index is negative (padding), its column is past the table or its block entry is
    negative (unallocated) (:func:`table_blocks`): such an index has no slot, and any slot made up for it
    would be another request's. A negative request is read as request 0 (its index must be masked by the
    caller, or be negative). The CSA op writes region summaries where the indexer reads them.
    """
    index = index.long()
    if block_table.shape[0] == 0:  # R = 0: every token is padding
        return torch.full_like(index, -1)
    row = request.long().clamp(min=0)
    if index.dim() > 1:  # one request per leading index row
        row = row.view(-1, *(1,) * (index.dim() - 1))
    block, allocated = table_blocks(block_table, row, index // block_size)  # floor: i < 0 has column < 0
    return torch.where(allocated, block * block_size + index % block_size, -1)


def paged_slot_mapping(token: TokenMetadata, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[T]`` int32: the :func:`paged_slots` of each token's position in its request's ``block_table`` rows
    ``[R, max_blocks]``; ``-1`` (write nothing) for padding, a position past the table's ``max_blocks * N``
    and an unallocated block (the runner sizes its tables so that real tokens never hit these cases)."""
    return to_int32_ids(paged_slots(block_table, token.request, token.position, block_size))


def check_token_metadata(builder: str, token: TokenMetadata, num_tokens: int) -> None:
    """``TypeError`` unless ``token`` is a :class:`TokenMetadata`, ``ValueError`` unless its tensors are int32
    ``[num_tokens]`` (what :func:`build_token_metadata` returns): an op builder's token metadata. A model step
    builds the token metadata once and derives every op's metadata from them."""
    if not isinstance(token, TokenMetadata):
        raise TypeError(f"{builder}: token must be a TokenMetadata (build_token_metadata), got {type(token).__name__}")
    for name, tensor in zip(TokenMetadata._fields, token):
        if tensor.dtype != torch.int32 or tuple(tensor.shape) != (num_tokens,):
            raise ValueError(
                f"{builder}: token.{name} must be int32 [{num_tokens}] (num_tokens), got {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )

"""Decoder attention that reads the paged KV cache in place, with memory independent of the context length.

Three pieces, each with static shapes (sizes depend only on the step's padded token count ``T``, the
block-table widths and Python ints, never on the data; no ``.item()``), so a step compiles with
``fullgraph=True`` and captures into a CUDA graph:

- :func:`paged_attention`: causal attention of every token over its request's paged context, full or a
  sliding window, with GQA, an optional per-token relative-position bias table and a score scale. The
  step's tokens are grouped into *query tiles* (up to ``query_tile`` consecutive tokens of one request),
  and a static loop walks the tiles' block-table columns in chunks with an fp32 online softmax: a decode or
  verify step of at most ``query_tile`` tokens per request reads each KV page once per (request, KV head),
  and the transient memory is one chunk, ``[tiles, chunk keys, Hkv, D + Dv]``, whatever the context.
- :func:`sparse_region_attention`: Step5's CSA attention: each token (per KV group) attends causally to the
  8-token regions it selected and to its own region; only those rows are gathered.
- :func:`streaming_topk` (+ :func:`csa_region_scorer`): the indexer's top-k over regions, chunk by chunk,
  with exactly the result of a full stable descending sort (ties to the lower id), from any chunk scorer.

Both decoder families' layers attend through these. The dense
:func:`stepops.testing.dense_attention.masked_attention` over
:func:`~stepops.testing.dense_attention.gather_paged_keys` is the test oracle. FlexAttention was
evaluated first and not used; see docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from stepops.layouts import REGION_SIZE
from stepops.ops.step_metadata import TokenMetadata, paged_slots, table_blocks

# A finite "no key yet" running max: exp(finite - finite) never makes inf - inf = NaN.
_NO_MAX = torch.finfo(torch.float32).min
# Default keys per chunk (the models' ``attention_keys_per_chunk``): at 64 decode requests of the tiny models
# one chunk's transient memory is 17 MiB compiled (27 MiB eager), and a 16k-token context is 16 chunks
# unrolled into the graph; smaller chunks lower the peak and lengthen the compile (docs/models.md).
DEFAULT_KEYS_PER_CHUNK = 1024


class _QueryTiles(NamedTuple):
    """The step's tokens regrouped as ``[num_tiles, query_tile]`` (``-1`` = empty slot), and back."""

    token: torch.Tensor  # [tiles, Qt] int64: flat token index of each slot, -1 if empty
    request: torch.Tensor  # [tiles] int64: the tile's request (clamped to 0 for an unused tile)
    position: torch.Tensor  # [tiles, Qt] int64: each slot's position, -1 if empty
    flat_slot: torch.Tensor  # [T] int64: token t's slot in the flattened [tiles * Qt], -1 for padding


def _max(a: int | torch.SymInt, b: int | torch.SymInt) -> int | torch.SymInt:
    """``max`` for sizes: ``torch.sym_max`` keeps a symbolic size symbolic; on plain ints it is Python's
    ``max`` (torch 2.11's Dynamo cannot trace ``torch.sym_max`` of two constants: "returned non-Tensor")."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return torch.sym_max(a, b)


def _query_tiles(token: TokenMetadata, num_requests: int, query_tile: int) -> _QueryTiles:
    """Split each request's tokens of the step into tiles of ``query_tile`` consecutive tokens.

    The tile count is static: ``n + (T - n) // Qt`` with ``n = min(R, T)`` bounds ``sum_r ceil(len_r / Qt)``
    over every split of ``T`` tokens among ``R`` requests. Tokens of a request are contiguous from its
    ``chunk_start`` (:func:`~stepops.ops.step_metadata.build_token_metadata`).
    """
    num_tokens = token.position.shape[0]
    # n + (T - n) // Qt with n = min(R, T) = R - max(R - T, 0), written for the symbolic T of a compiled
    # step: no guard on T vs R (one graph for every T), and a max with 1 (a no-op for T >= 1) is one sympy
    # atom known to be positive, so views over the tile dim need no guard (2 * tiles is not expanded into a
    # sum whose divisibility, or a floor division whose nonzero-ness, sympy cannot prove; a dynamic T fails).
    # At least 2 tiles (a spare one is padding): a tile dim that is 1 at the first compile (one request, a
    # short step) would be specialised by broadcasting and contiguity checks, failing every longer step.
    busy = num_requests - _max(num_requests - num_tokens, 0)
    num_tiles = _max(2, (num_tokens + (query_tile - 1) * busy) // query_tile)
    device = token.position.device
    real = token.position >= 0
    request = token.request.long().clamp(min=0)
    lengths = torch.zeros(num_requests, dtype=torch.int64, device=device).index_add_(0, request, real.long())
    tiles_per_request = (lengths + query_tile - 1) // query_tile
    first_tile = torch.cumsum(tiles_per_request, 0) - tiles_per_request
    local = torch.arange(num_tokens, device=device) - token.chunk_start.long()
    flat_slot = first_tile[request] * query_tile + local
    flat_slot = torch.where(real, flat_slot, -1)
    # Padding scatters into one spare slot past the end, dropped below.
    slots = torch.full((num_tiles * query_tile + 1,), -1, dtype=torch.int64, device=device)
    target = torch.where(real, flat_slot, num_tiles * query_tile)
    slots = slots.scatter(0, target, torch.where(real, torch.arange(num_tokens, device=device), -1))
    tile_token = slots[:-1].view(num_tiles, query_tile)
    position = torch.where(tile_token >= 0, token.position.long()[tile_token.clamp(min=0)], -1)
    tile_request = request[tile_token[:, 0].clamp(min=0)]
    return _QueryTiles(tile_token, tile_request, position, flat_slot)


class _SoftmaxState(NamedTuple):
    """fp32 online-softmax state of query rows ``[..., Q]``: running max, running sum, accumulator."""

    max: torch.Tensor  # [..., Q, 1]
    sum: torch.Tensor  # [..., Q, 1]
    acc: torch.Tensor  # [..., Q, Dv]


def _softmax_start(rows_shape: tuple[int, ...], value_dim: int, device: torch.device) -> _SoftmaxState:
    return _SoftmaxState(
        torch.full((*rows_shape, 1), _NO_MAX, dtype=torch.float32, device=device),
        torch.zeros((*rows_shape, 1), dtype=torch.float32, device=device),
        torch.zeros((*rows_shape, value_dim), dtype=torch.float32, device=device),
    )


def _softmax_fold(
    state: _SoftmaxState, scores: torch.Tensor, value: torch.Tensor, weight_dtype: torch.dtype
) -> _SoftmaxState:
    """Fold one chunk: ``scores [..., Q, S]`` fp32 (``-inf`` = masked), ``value [..., S, Dv]`` fp32 and
    finite (a masked key's weight is 0, and ``0 * NaN`` would still poison the sum).

    The weights ``exp(s - max)`` enter the running sum in fp32 and ``P V`` rounded to ``weight_dtype`` (the
    query's: bf16 in a bf16 model, a no-op in fp32), as fused attention kernels multiply them: Step5's
    reference ``tl.dot(probabilities.to(values.dtype), values)``, transformers' eager ``.to(query.dtype)``."""
    new_max = torch.maximum(state.max, scores.amax(-1, keepdim=True))
    weights = torch.exp(scores - new_max)  # masked keys: exp(-inf) = 0
    rescale = torch.exp(state.max - new_max)
    return _SoftmaxState(
        new_max,
        state.sum * rescale + weights.sum(-1, keepdim=True),
        state.acc * rescale + weights.to(weight_dtype).float() @ value,
    )


def _softmax_finish(state: _SoftmaxState) -> torch.Tensor:
    """``acc / sum``; a row that saw no allowed key (padding) is zero."""
    return state.acc / torch.where(state.sum > 0, state.sum, torch.ones_like(state.sum))


def _check_attention_inputs(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, token: TokenMetadata
) -> None:
    if query.dim() != 3 or kv_cache.dim() != 4:
        raise ValueError(
            f"query must be [T, Hq, D] and kv_cache [num_blocks, N, Hkv, D + Dv]; got {tuple(query.shape)} "
            f"and {tuple(kv_cache.shape)}"
        )
    num_heads, head_size = query.shape[1:]
    num_kv_heads, packed = kv_cache.shape[2:]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if packed <= head_size:
        raise ValueError(f"kv_cache's last dim ({packed}) must hold K ({head_size}) and V after it")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be [R, max_blocks] int32/int64, got {tuple(block_table.shape)} {block_table.dtype}"
        )
    if token.position.shape != query.shape[:1]:
        raise ValueError(
            f"token metadata of shape {tuple(token.position.shape)} for a query of {query.shape[0]} tokens: build it "
            "for this step's tokens"
        )


def _distance_bias(distance_bias: torch.Tensor, rows: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """``distance_bias [T, Hq, E]`` read at ``distance`` for token ``rows``: 0 outside ``0 <= d < E``.

    ``rows [...]`` flat token indices (clamped), ``distance [..., S]``; returns ``[..., Hq, S]`` fp32.
    """
    extent = distance_bias.shape[-1]
    table = distance_bias.float()[rows]  # [..., Hq, E]
    index = distance.clamp(0, extent - 1).unsqueeze(-2).expand(*table.shape[:-1], distance.shape[-1])
    bias = table.gather(-1, index)
    return bias.masked_fill(((distance < 0) | (distance >= extent)).unsqueeze(-2), 0.0)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    token: TokenMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    distance_bias: torch.Tensor | None = None,
    query_tile: int = 4,
    keys_per_chunk: int = DEFAULT_KEYS_PER_CHUNK,
) -> torch.Tensor:
    """Causal GQA attention of each token over its request's paged cache; ``[T, Hq, Dv]`` in ``query.dtype``.

    ``query [T, Hq, D]``; ``kv_cache [num_blocks, N, Hkv, D + Dv]`` (K then V per head; any strides);
    ``block_table [R, max_blocks]`` (``< 0`` = unallocated: those keys are masked); ``token`` the step's
    :class:`TokenMetadata` (padding: position ``-1``, a zero output row). Query head ``h`` reads KV head
    ``h // (Hq / Hkv)``. Token ``t`` at position ``p`` attends to positions ``k <= p`` of its request,
    and ``k > p - sliding_window`` when a window is given:
    ``softmax_k(scale * q.k + distance_bias[t, h, p - k])`` with the bias 0 unless ``0 <= p - k < E``
    (``distance_bias [T, Hq, E]``, Inkling's relative logits). Scores and softmax are fp32 (online over
    chunks), the weights enter ``P V`` rounded to ``query.dtype`` (as the reference kernels multiply them), the
    output is rounded once.

    Static tiling: ``query_tile`` (Qt) consecutive tokens of a request share their key reads (set it to the
    step's tokens per request, e.g. k + 1 for verify, for one read per page per request and KV head);
    ``keys_per_chunk`` (rounded down to whole blocks) bounds the transient
    ``[tiles, chunk, Hkv, D + Dv]`` gather and ``[tiles, Hq, Qt, chunk]`` fp32 scores. Full attention walks
    every column of the table; a window only the ``(window + Qt - 2) // N + 2`` columns around each tile.
    """
    _check_attention_inputs(query, kv_cache, block_table, token)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if query_tile < 1 or keys_per_chunk < 1:
        raise ValueError(f"query_tile ({query_tile}) and keys_per_chunk ({keys_per_chunk}) must be >= 1")
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[1], kv_cache.shape[2]
    value_size = kv_cache.shape[3] - head_size
    if distance_bias is not None and (
        distance_bias.dim() != 3 or distance_bias.shape[:2] != (num_tokens, num_heads) or distance_bias.shape[2] < 1
    ):
        raise ValueError(
            f"distance_bias must be [T, Hq, E] = [{num_tokens}, {num_heads}, E >= 1] (None for no bias), got "
            f"{tuple(distance_bias.shape)}"
        )
    if num_tokens == 0 or block_table.shape[0] == 0:  # T = 0 or R = 0: every token is padding
        return query.new_zeros(num_tokens, num_heads, value_size)
    group = num_heads // num_kv_heads
    max_blocks = block_table.shape[1]
    tiles = _query_tiles(token, block_table.shape[0], query_tile)
    num_tiles = tiles.token.shape[0]
    device = query.device

    # [tiles, Hkv, G * Qt, D]: the query rows that share each KV head's reads.
    q = query.float()[tiles.token.clamp(min=0)]  # [tiles, Qt, Hq, D]
    q = q.view(num_tiles, query_tile, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_tiles, num_kv_heads, group * query_tile, head_size)
    q_position = tiles.position[:, :, None]  # [tiles, Qt, 1]
    if sliding_window is None:
        # Every tile starts at column 0. Not an added zeros tensor: Inductor's no-op removal of x + zeros
        # compares the [tiles, C] and [C] shapes element by element and guards tiles == C (a dynamic T fails).
        first_column = None
        num_columns = max_blocks
    else:
        # Slot 0 holds the tile's first (lowest) position: keys from p0 - window + 1 on.
        first_column = (tiles.position[:, 0] - sliding_window + 1).clamp(min=0) // block_size
        num_columns = min(max_blocks, (sliding_window + query_tile - 2) // block_size + 2)
    columns_per_chunk = max(1, keys_per_chunk // block_size)
    state = _softmax_start((num_tiles, num_kv_heads, group * query_tile), value_size, device)
    for start in range(0, num_columns, columns_per_chunk):
        width = min(columns_per_chunk, num_columns - start)
        # ``after`` is an exact 0 (x < 0 is false even for NaN; sums and |x| are never < 0) that depends on
        # the previous chunk's whole fold (sum and values): it orders the chunks for a compiler, which may
        # otherwise gather every chunk before folding any, or keep every chunk's weights for one late sum.
        # Measured (benchmarks/bench_attention.py, 16k-token contexts, Inductor CPU): compiled peak 80 MiB
        # with no ordering, 32 MiB ordered on the values alone, 17 MiB as here (17 MiB at 1k).
        after = ((state.acc[:1, :1, :1, :1].abs() < 0) | (state.sum[:1, :1, :1] < 0)).long().view(1, 1)
        column = start + torch.arange(width, device=device) + after  # [1, C]
        column = (column if first_column is None else first_column[:, None] + column).expand(num_tiles, width)
        block, live = table_blocks(block_table, tiles.request[:, None], column)
        k_position = (column[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
        distance = q_position - k_position[:, None, :]  # [tiles, Qt, C * N]
        allowed = live.repeat_interleave(block_size, 1)[:, None, :] & (distance >= 0) & (q_position >= 0)
        if sliding_window is not None:
            allowed = allowed & (distance < sliding_window)
        # K and V gathered apart, each straight into its fp32 operand: a joint [K | V] gather made Inductor
        # keep a bf16 copy of the chunk beside them (compiled peak 18 MiB instead of 17 at 4k+).
        key = kv_cache[..., :head_size][block].flatten(1, 2)  # [tiles, C * N, Hkv, D]
        # K @ q^T, then the small product transposed: torch 2.11's Inductor CPU code failed to compile the
        # transposed bf16 gather that q @ K^T asks for (an undeclared temporary in transpose_mxn).
        scores = (key.float().transpose(1, 2) @ q.transpose(-1, -2)).transpose(-1, -2) * scale
        # Explicit sizes, no -1: inferring one makes T-dependent divisibility guards that sympy cannot prove
        # for the symbolic tile count, and a compiled step with a dynamic T fails its constraint.
        keys = width * block_size
        scores = scores.view(num_tiles, num_kv_heads, group, query_tile, keys)  # [tiles, Hkv, G, Qt, C * N]
        if distance_bias is not None:
            bias = _distance_bias(distance_bias, tiles.token.clamp(min=0), distance)  # [tiles, Qt, Hq, C * N]
            scores = scores + bias.view(num_tiles, query_tile, num_kv_heads, group, keys).permute(0, 2, 3, 1, 4)
        # logical_not, not ~: Python's ~ on a CUDA tensor needs a CUDA build even under fake tensors, and
        # tests/models/test_compile.py traces the CUDA path on a CPU-only wheel.
        scores = scores.masked_fill(allowed[:, None, None].logical_not(), float("-inf")).flatten(2, 3)
        value = kv_cache[..., head_size:][block].flatten(1, 2)  # [tiles, C * N, Hkv, Dv]
        # A key no query of the tile may read can be a row never written (NaN, Inf): its weight is an exact
        # 0, but 0 * NaN is NaN, so its value is replaced, not multiplied away (its score is masked_fill'ed).
        value = torch.where(allowed.any(1)[:, :, None, None], value, 0.0)
        state = _softmax_fold(state, scores, value.float().transpose(1, 2), query.dtype)
    out = _softmax_finish(state).view(num_tiles, num_kv_heads, group, query_tile, value_size)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_tiles * query_tile, num_heads, value_size)
    out = torch.where((tiles.flat_slot >= 0)[:, None, None], out[tiles.flat_slot.clamp(min=0)], 0.0)
    return out.to(query.dtype)


def sparse_region_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    token: TokenMetadata,
    selected_regions: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Step5 CSA attention: each token attends causally to its selected regions and its own region.

    ``query [T, Hq, D]``, ``kv_cache``, ``block_table``, ``token`` as in :func:`paged_attention`; the block
    size ``N`` must be a multiple of the region size 8. ``selected_regions [T, G, K]`` int: per token and
    KV group (``G`` divides ``Hkv``; KV heads ``g * Hkv/G .. (g+1) * Hkv/G - 1`` form group ``g``; ``G = 1``
    is one selection for all heads, ``G = Hkv`` one per KV head) the region ids to read, ``-1`` = none.
    Ids must be distinct; the own region (``position // 8``) is always read, so an id equal to it is
    ignored, and keys after the token (``k > p``) or in unallocated blocks are masked. Gathers only
    ``[T, G, (K + 1) * 8, Hkv/G, D + Dv]`` rows; returns ``[T, Hq, Dv]`` in ``query.dtype`` (fp32 softmax, its
    weights rounded to ``query.dtype`` into ``P V`` as in :func:`paged_attention`; zero rows for padding).
    """
    _check_attention_inputs(query, kv_cache, block_table, token)
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[1], kv_cache.shape[2]
    value_size = kv_cache.shape[3] - head_size
    if block_size % REGION_SIZE:
        raise ValueError(f"block size ({block_size}) must be a multiple of the region size {REGION_SIZE}")
    if selected_regions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"selected_regions must be int32/int64 region ids, got {selected_regions.dtype}")
    shape = tuple(selected_regions.shape)
    if len(shape) != 3 or shape[0] != num_tokens or shape[1] == 0 or num_kv_heads % shape[1]:
        raise ValueError(
            f"selected_regions must be [T, G, K] with T = {num_tokens} and G dividing Hkv = {num_kv_heads}, "
            f"got {shape}"
        )
    if num_tokens == 0 or block_table.shape[0] == 0:  # T = 0 or R = 0: every token is padding
        return query.new_zeros(num_tokens, num_heads, value_size)
    num_groups = selected_regions.shape[1]
    heads_per_group = num_kv_heads // num_groups
    device = query.device
    position = token.position.long()
    own = (position.clamp(min=0) // REGION_SIZE)[:, None, None].expand(num_tokens, num_groups, 1)
    selected = selected_regions.long()
    region = torch.cat([torch.where(selected == own, -1, selected), own], dim=2)  # [T, G, K + 1]
    key_position = region[..., None] * REGION_SIZE + torch.arange(REGION_SIZE, device=device)  # [T, G, K + 1, 8]
    request = token.request.long().clamp(min=0)[:, None, None, None]
    block, allocated = table_blocks(block_table, request, key_position // block_size)
    allowed = (region[..., None] >= 0) & allocated
    allowed = allowed & (key_position <= position[:, None, None, None])  # padding (-1) allows nothing
    # [T, G, K + 1, 8, Hkv/G, D + Dv]: each group's heads only.
    head = (torch.arange(num_groups, device=device)[:, None] * heads_per_group
            + torch.arange(heads_per_group, device=device))[None, :, None, None, :]
    rows = kv_cache[block[..., None], (key_position % block_size)[..., None], head]
    rows = rows.flatten(2, 3).permute(0, 1, 3, 2, 4)  # [T, G, Hkv/G, S, D + Dv]
    q = query.float().view(num_tokens, num_groups, heads_per_group, num_heads // num_kv_heads, head_size)
    scores = (q @ rows[..., :head_size].float().transpose(-1, -2)) * scale  # [T, G, Hkv/G, Hq/Hkv, S]
    scores = scores.masked_fill(allowed.flatten(2)[:, :, None, None, :].logical_not(), float("-inf"))
    state = _softmax_start(scores.shape[:-1], value_size, device)
    # Masked rows may never have been written (NaN, Inf): replaced, since a 0 weight times NaN is NaN.
    value = torch.where(allowed.flatten(2)[:, :, None, :, None], rows[..., head_size:], 0.0)
    out = _softmax_finish(_softmax_fold(state, scores, value.float(), query.dtype))
    return out.reshape(num_tokens, num_heads, value_size).to(query.dtype)


def streaming_topk(
    score_chunk: Callable[[int, int], torch.Tensor], num_items: int, k: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` over ``num_items`` scores produced chunk by chunk; exactly a full stable descending sort.

    ``score_chunk(start, size)`` returns the scores ``[..., size]`` (fp32; ``-inf`` = not selectable) of
    items ``start .. start + size - 1`` (Python ints: static shapes). Returns ``values [..., k]`` and
    ``ids [..., k]`` int64 equal to ``torch.sort(all_scores, -1, descending=True, stable=True)[..][..., :k]``
    (equal scores: the lower id first), ``-inf`` entries included; when ``num_items < k`` the tail is
    ``(-inf, -1)``. Memory is ``[..., k + chunk_size]``: the scores of all items never exist at once.

    Why it is exact: the running top-k is sorted by (score descending, id ascending) and every id in it is
    below the next chunk's ids, so a stable sort of ``[running, chunk]`` orders ties by id; an item left out
    of a running top-k has k items before it and can never return.
    """
    if k < 1 or chunk_size < 1 or num_items < 1:
        raise ValueError(f"k ({k}), chunk_size ({chunk_size}) and num_items ({num_items}) must be >= 1")
    values = ids = None
    for start in range(0, num_items, chunk_size):
        scores = score_chunk(start, min(chunk_size, num_items - start))
        candidate_ids = torch.arange(start, start + scores.shape[-1], device=scores.device).expand_as(scores)
        if values is not None:  # the running top-k first: its ids are all lower
            scores, candidate_ids = torch.cat([values, scores], -1), torch.cat([ids, candidate_ids], -1)
        values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        values, ids = values[..., :k], candidate_ids.gather(-1, order[..., :k])
    if num_items < k:
        pad = (*values.shape[:-1], k - num_items)
        values = torch.cat([values, values.new_full(pad, float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_full(pad, -1)], dim=-1)
    return values, ids


def region_summary_slots(
    summary_block_table: torch.Tensor, summary_block_size: int, request: torch.Tensor, start: int, size: int
) -> torch.Tensor:
    """``[T, size]`` int64: the summary-cache row of regions ``start .. start + size - 1`` of each token's
    request (``request [T]``, -1 = padding, read as request 0); ``summary_block_table [R, max_summary_blocks]``.
    ``-1`` where the region's summary block is unallocated (a negative entry, or a column past the table).
    A chunk of regions at a time, so no ``[T, num_regions]`` table exists. The slots
    :func:`stepops.build_csa_ring_metadata` has the op write summaries to (:func:`paged_slots`)."""
    region = torch.arange(start, start + size, device=summary_block_table.device)
    return paged_slots(summary_block_table, request, region.expand(request.shape[0], size), summary_block_size)


def csa_region_scorer(
    index_query: torch.Tensor,
    index_weights: torch.Tensor,
    summary_cache: torch.Tensor,
    summary_block_table: torch.Tensor,
    summary_block_size: int,
    token: TokenMetadata,
) -> Callable[[int, int], torch.Tensor]:
    """A :func:`streaming_topk` scorer for the Step5 indexer, per KV group: ``[T, G, size]`` fp32 scores.

    ``score[t, g, r] = sum_h relu(index_query[t, g, h] . summary[r]) * index_weights[t, g, h]`` for regions
    before the token's own (``r < position // 8``) whose summary block is allocated, ``-inf`` otherwise. ``index_query [T, G, H, P]`` (any
    float dtype, e.g. already rounded to e4m3 values; ``G = 1`` for one selection for all heads),
    ``index_weights [T, G, H]`` fp32, ``summary_cache [num_slots, P]`` (uint8 holding float8_e4m3fn codes, or
    any float dtype). Each chunk gathers ``[T, size, P]`` summaries, never ``[T, num_regions, P]``. Feed
    ``torch.where(values > -inf, ids, -1)`` of the top-k to :func:`sparse_region_attention`.
    """
    if index_query.dim() != 4 or index_weights.shape != index_query.shape[:3]:
        raise ValueError(
            f"index_query must be [T, G, H, P] and index_weights [T, G, H]; got {tuple(index_query.shape)} "
            f"and {tuple(index_weights.shape)}"
        )
    summaries = summary_cache.view(torch.float8_e4m3fn) if summary_cache.dtype == torch.uint8 else summary_cache
    own = (token.position.long() // REGION_SIZE)[:, None, None]

    previous = None  # the last chunk's scores

    def score_chunk(start: int, size: int) -> torch.Tensor:
        nonlocal previous
        slots = region_summary_slots(summary_block_table, summary_block_size, token.request, start, size)
        if previous is not None:
            # An exact 0 (|x| < 0 is false, NaN and -inf included) that depends on the previous chunk's
            # scores: it orders the chunks' gathers for a compiler, which otherwise gathered every chunk's
            # summaries before scoring any (compiled step peak growing with the context).
            slots = slots + (previous[:1, :1, :1].abs() < 0).long().view(1, 1)
        per_head = torch.einsum("tghp,trp->tghr", index_query.float(), summaries[slots.clamp(min=0)].float())
        scores = (torch.relu(per_head) * index_weights[..., None]).sum(2)  # [T, G, size]
        region = torch.arange(start, start + size, device=scores.device)
        # An unallocated summary block is never scored: block 0 would be another request's summaries.
        previous = scores.masked_fill((region >= own) | (slots < 0)[:, None, :], float("-inf"))
        return previous

    return score_chunk

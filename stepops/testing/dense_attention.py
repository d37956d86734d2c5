"""Dense attention over the paged KV cache: the test oracle of :mod:`stepops.models.paged_attention`.

Every token gathers its request's whole block table (``[T, max_blocks * N, H, D + Dv]``) and attends over
it with a dense mask: memory grows with tokens x context, so no model path uses it. It is the formulation
the layers used before :mod:`stepops.models.paged_attention`, kept to compare against (tests, benchmarks).
Softmax in fp32, its weights rounded to the query's dtype into ``P V`` as the paged path multiplies them,
output rounded once to the query's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stepops.ops.step_metadata import TokenMetadata


class PagedKeys(NamedTuple):
    """Each token's view of its request's paged KV cache, position-ordered, ``S`` = max positions.

    ``key [T, S, H, D]``, ``value [T, S, H, Dv]``: the cache rows of the token's request at positions
    ``0..S-1`` (gathered through the block table; rows past the sequence hold stale data and are masked).
    ``causal [T, S]`` bool: key position ``s <= position[t]`` of a real token.
    """

    key: torch.Tensor
    value: torch.Tensor
    causal: torch.Tensor


def gather_paged_keys(
    kv_cache: torch.Tensor, head_size: int, block_table: torch.Tensor, token: TokenMetadata
) -> PagedKeys:
    """Gather every token's request's keys and values from ``kv_cache [num_blocks, N, H, D + Dv]``.

    ``block_table [R, max_blocks]`` int32 (entries ``< 0`` are unallocated: their keys are read from block
    0 and masked out of ``causal``), ``token`` the step's :class:`TokenMetadata`. ``S = max_blocks * N``: a
    static size, so the step keeps one shape.
    """
    block_size = kv_cache.shape[1]
    request = token.request.long().clamp(min=0)
    table = block_table.long()[request]  # [T, max_blocks]
    rows = kv_cache[table.clamp(min=0)]  # [T, max_blocks, N, H, D + Dv]
    rows = rows.flatten(1, 2)  # [T, S, H, D + Dv]
    key_position = torch.arange(rows.shape[1], device=kv_cache.device)
    allocated = (table >= 0).repeat_interleave(block_size, 1)  # [T, S]
    causal = (key_position[None, :] <= token.position.long()[:, None]) & allocated  # padding (-1) allows nothing
    return PagedKeys(rows[..., :head_size], rows[..., head_size:], causal)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    *,
    rel_bias: torch.Tensor | None = None,
    position: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of each token over its own key set.

    ``query [T, Hq, D]``, ``key [T, S, Hkv, D]``, ``value [T, S, Hkv, Dv]``, ``allowed [T, S]`` bool, or
    ``[T, Hkv, S]`` when each KV head has its own key set (Step5's per-group region selection);
    ``Hq`` a multiple of ``Hkv`` (query head ``h`` reads KV head ``h // (Hq / Hkv)``). Scores, softmax and
    the weighted sum are fp32, the weights ``exp(s - max)`` rounded to ``query.dtype`` into ``P V`` as
    :mod:`stepops.models.paged_attention` multiplies them (one chunk of its online softmax) and the sum divided
    after; the output ``[T, Hq, Dv]`` is rounded once to ``query.dtype``. A row with no allowed key (a padding
    token) is zero.

    ``rel_bias [T, Hq, E]`` (with ``position [T]``, the keys being positions ``0..S-1``): a relative
    position bias added to ``score * scale``, entry ``d`` for the key at distance ``d = position - s``
    when ``0 <= d < E``, nothing otherwise (Inkling). A per-token table, so a paged kernel can take it as is.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[2]
    q = query.float().view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_size)
    scores = torch.einsum("tkgd,tskd->tkgs", q, key.float()) * scale
    if rel_bias is not None:
        if position is None:
            raise ValueError("masked_attention: rel_bias needs each token's position")
        extent = rel_bias.shape[-1]
        distance = position.long()[:, None] - torch.arange(key.shape[1], device=key.device)[None, :]  # [T, S]
        index = distance.clamp(0, extent - 1)[:, None, :].expand(-1, num_heads, -1)
        bias = rel_bias.float().gather(-1, index).masked_fill(((distance < 0) | (distance >= extent))[:, None], 0.0)
        scores = scores + bias.view(scores.shape)
    mask = allowed[:, None, None, :] if allowed.dim() == 2 else allowed[:, :, None, :]
    scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    # A fully masked row would be NaN; give it a finite max so it softmaxes to zeros after the mask below.
    row_max = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(scores - row_max) * mask
    denom = weights.sum(-1, keepdim=True)
    # A masked key's weight is an exact 0, but 0 * NaN is NaN: a masked row's value (stale, never written) is
    # replaced, not multiplied away, so a row with no allowed key is zero as documented.
    value_mask = allowed[:, :, None, None] if allowed.dim() == 2 else allowed.transpose(1, 2)[..., None]
    out = torch.einsum("tkgs,tskd->tkgd", weights.to(query.dtype).float(), torch.where(value_mask, value.float(), 0.0))
    out = out / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.reshape(num_tokens, num_heads, value.shape[-1]).to(query.dtype)

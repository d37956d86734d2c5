"""Pieces both decoder families share: RMSNorm, NEOX rope, the SwiGLU MLP and paged attention.

Every function has static shapes: sizes depend on the step's padded token count ``T`` and on the fixed
block-table widths, never on the data, so a step compiles to one graph and captures into a CUDA graph.
Arithmetic is fp32 inside (norms, rope, softmax) and rounds once to the activation dtype (bf16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stepops.ops.step_metadata import TokenMetadata


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * scale`` over the last dim, in fp32, rounded once to ``x.dtype``.

    ``zero_centred=True`` stores ``w`` initialised at 0 and uses ``scale = 1 + w`` (the CSA indexer's query
    norm); otherwise ``scale = w`` initialised at 1.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centred: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float() + 1.0 if self.zero_centred else self.weight.float()
        return (y * scale).to(x.dtype)


def rope_neox(x: torch.Tensor, position: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NEOX-style rotary embedding on the first ``rotary_dim`` dims of ``x [T, ..., D]`` at ``position [T]``.

    The rotated dims are split in halves ``(a, b)`` and become ``(a cos - b sin, b cos + a sin)`` with angle
    ``position * theta^(-2i / rotary_dim)``, in fp32, rounded once. Padding positions (``-1``) rotate by a
    harmless angle; their rows are never committed.
    """
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) * 2.0 / rotary_dim)
    angle = position.float()[:, None] * inv_freq  # [T, half]
    shape = (angle.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x32 = x.float()
    a, b = x32[..., :half], x32[..., half:rotary_dim]
    rotated = torch.cat([a * cos - b * sin, b * cos + a * sin, x32[..., rotary_dim:]], dim=-1)
    return rotated.to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``gate`` and ``up`` are one fused projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


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

    ``block_table [R, max_blocks]`` int32 (entries ``< 0`` are unallocated and only ever masked), ``token``
    the step's :class:`TokenMetadata`. ``S = max_blocks * N``: a static size, so the step keeps one shape.
    """
    num_blocks, block_size = kv_cache.shape[:2]
    request = token.request.long().clamp(min=0)
    blocks = block_table.long().clamp(min=0)[request]  # [T, max_blocks]
    rows = kv_cache[blocks]  # [T, max_blocks, N, H, D + Dv]
    rows = rows.flatten(1, 2)  # [T, S, H, D + Dv]
    key_position = torch.arange(rows.shape[1], device=kv_cache.device)
    causal = key_position[None, :] <= token.position.long()[:, None]  # padding (-1) allows nothing
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
    the weighted sum are fp32; the output ``[T, Hq, Dv]`` is rounded once to ``query.dtype``. A row with no
    allowed key (a padding token) is zero.

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
    weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("tkgs,tskd->tkgd", weights, value.float())
    return out.reshape(num_tokens, num_heads, value.shape[-1]).to(query.dtype)

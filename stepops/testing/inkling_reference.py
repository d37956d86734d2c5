"""Inkling's full recompute of committed sequences with no cache: the yardstick for its incremental layers.

One request at a time, the whole sequence at once, with independent formulations of everything the
incremental path does through caches and metadata: attention as one dense softmax with an additive mask
(the relative bias placed by distance, ``-inf`` outside the causal window); short convs by sconv's one
naive reference (:func:`stepops.ops.sconv.reference.short_conv_reference`, one request, no
cache). The per-token pieces with no state (projections, norms, the per-token bias table and log scaling,
the MLP) are the layer's own modules. Step5's recompute, which shares nothing with its layers, is
:mod:`stepops.testing.step5_reference`; the comparison helpers are in :mod:`stepops.testing.recompute`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stepops.models.inkling import InklingDecoderLayer, split_kv
from stepops.ops.sconv.reference import short_conv_reference


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [L, Hq, D]``, ``k``/``v [L, Hkv, D]``, additive ``mask [Hq, L, L]`` -> ``[L, Hq, D]``: fp32 scores and
    softmax in one pass, the weights ``exp(s - max)`` rounded to ``q.dtype`` into ``P V`` (as bf16 attention
    kernels multiply them, and as the layers do), the sum divided after, the output rounded once."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("lhd,mhd->hlm", q.float(), k.float().repeat_interleave(group, dim=1)) * scale + mask
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # every row allows its own token
    out = torch.einsum("hlm,mhd->hld", weights.to(q.dtype).float(), v.float().repeat_interleave(group, dim=1))
    return (out / weights.sum(-1, keepdim=True)).transpose(0, 1).to(q.dtype)


def _causal(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)


def inkling_layer_reference(layer: InklingDecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """One request's committed inputs ``x [L, hidden]`` through an Inkling layer, no cache, in ``x``'s dtype
    (bf16, or fp32 with an fp32 layer): the relative bias as a dense ``[Hq, L, L]`` additive mask."""
    length = x.shape[0]
    position = torch.arange(length, device=x.device)
    h = layer.input_norm(x)
    q = layer.q_proj(h).view(length, layer.num_heads, layer.head_dim)
    # K and V each by itself, from the halves of the layer's fused weights.
    (w_k, w_v), (conv_k, conv_v) = (split_kv(w, layer.num_kv_heads) for w in (layer.kv_proj.weight, layer.conv_kv))
    k = short_conv_reference(F.linear(h, w_k), conv_k)
    v = short_conv_reference(F.linear(h, w_v), conv_v)
    q = layer.scaled_query(layer.q_norm(q), position)
    k = layer.k_norm(k.view(length, layer.num_kv_heads, layer.head_dim))
    v = v.view(length, layer.num_kv_heads, layer.head_dim)
    table = layer.relative_bias_table(h, position).float()  # [L, Hq, E]
    distance = position[:, None] - position[None, :]
    bias = torch.zeros(layer.num_heads, length, length, device=x.device)
    for d in range(min(table.shape[-1], length)):
        bias = torch.where(distance == d, table[:, :, d].t()[:, :, None], bias)
    mask = bias.masked_fill(~_causal(length, layer.sliding_window, x.device), float("-inf"))
    attn = _attention(q, k, v, mask, 1.0 / layer.head_dim)
    x = x + short_conv_reference(layer.o_proj(attn.flatten(1)), layer.conv_attn)
    return x + short_conv_reference(layer.mlp(layer.post_norm(x)), layer.conv_mlp)

"""Inkling's full recompute of committed sequences with no cache: the yardstick for its incremental layers.

One request at a time, the whole sequence at once, with independent formulations of everything the
incremental path does through caches and metadata: attention as one dense softmax over the whole sequence
(:func:`~stepops.testing.dense_attention.masked_attention`, the relative bias placed by distance, the causal
window as a mask); short convs by sconv's one naive reference
(:func:`stepops.ops.sconv.reference.short_conv_reference`, one request, no cache). The per-token pieces with no state (projections, norms, the per-token bias table and log scaling,
the MLP) are the layer's own modules. Step5's recompute, which shares nothing with its layers, is
:mod:`stepops.testing.step5_reference`; the comparison helpers are in :mod:`stepops.testing.recompute`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stepops.models.inkling import InklingDecoderLayer, split_kv
from stepops.ops.sconv.reference import short_conv_reference
from stepops.testing.dense_attention import masked_attention


def _causal(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)


def inkling_layer_reference(layer: InklingDecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """One request's committed inputs ``x [L, hidden]`` through an Inkling layer, no cache, in ``x``'s dtype
    (bf16, or fp32 with an fp32 layer); every token attends over the whole sequence, causally masked."""
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
    table = layer.relative_bias_table(h, position)  # [L, Hq, E]
    keys, values = (t[None].expand(length, -1, -1, -1) for t in (k, v))  # every token sees the whole sequence
    attn = masked_attention(q, keys, values, _causal(length, layer.sliding_window, x.device), 1.0 / layer.head_dim,
                            rel_bias=table, position=position)
    x = x + short_conv_reference(layer.o_proj(attn.flatten(1)), layer.conv_attn)
    return x + short_conv_reference(layer.mlp(layer.post_norm(x)), layer.conv_mlp)

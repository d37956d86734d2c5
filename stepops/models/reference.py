"""Full recompute of committed sequences with no cache: the yardstick for the incremental layers.

One request at a time, the whole sequence at once, with independent formulations of everything the
incremental path does through caches and metadata: region summaries as a plain softmax over each complete
region (not the op's online fold), region selection by a Python sort on ``(-score, region)``, attention by
``scaled_dot_product_attention`` with a dense boolean mask, short convs by ``F.conv1d``. The per-token
pieces with no state (projections, norms, rope, the MLP) are the layer's own modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stepops.models.inkling import SLIDING as INKLING_SLIDING
from stepops.models.inkling import InklingDecoderLayer, InklingModel
from stepops.models.layers import rope_neox
from stepops.models.step5 import CSA, Step5DecoderLayer, Step5Model

_REGION = 8


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [L, Hq, D]``, ``k``/``v [L, Hkv, D]``, ``allowed [L, L]`` -> ``[L, Hq, D]`` (fp32 math, cast once)."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(group, dim=1).transpose(0, 1),
        v.float().repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=allowed,
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


def _causal(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)


def step5_layer_reference(layer: Step5DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """One request's committed inputs ``x [L, hidden]`` bf16 through a Step5 layer, no cache."""
    c = layer.config
    length = x.shape[0]
    position = torch.arange(length, device=x.device)
    h = layer.input_norm(x)
    q, k, v = layer.qkv_proj(h).split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1
    )
    q = rope_neox(q.view(length, c.num_heads, c.head_dim), position, c.head_dim, c.rope_theta)
    k = rope_neox(k.view(length, c.num_kv_heads, c.head_dim), position, c.head_dim, c.rope_theta)
    v = v.view(length, c.num_kv_heads, c.head_dim)
    if layer.kind == CSA:
        allowed = _causal(length, None, x.device) & _selected_tokens(layer, h, position)
    else:
        allowed = _causal(length, c.sliding_window, x.device)
    attn = _attention(q, k, v, allowed, c.head_dim**-0.5)
    x = x + layer.o_proj(attn.flatten(1))
    return x + layer.mlp(layer.post_norm(x))


def _selected_tokens(layer: Step5DecoderLayer, h: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``[L, L]`` bool: key ``j`` is in a region query ``i`` selects (top-k earlier regions + its own)."""
    c = layer.config
    length = h.shape[0]
    iq = layer.index_q_norm(layer.index_q_proj(h).view(length, c.index_num_heads, c.index_proxy_dim))
    iq = rope_neox(iq, position, c.index_rope_dim, c.rope_theta).float()
    ik = layer.index_k_norm(layer.index_k_proj(h).float()).to(h.dtype)
    ik = rope_neox(ik, position, c.index_rope_dim, c.rope_theta).float()
    iz = layer.index_z_proj(h).float()
    weights = layer.index_weights_proj(h.float()) * c.index_num_heads**-0.5
    num_complete = length // _REGION
    # Summary of region r: per dimension, softmax over its 8 tokens of z applied to k; stored as bf16.
    k_regions = ik[: num_complete * _REGION].view(num_complete, _REGION, -1)
    z_regions = iz[: num_complete * _REGION].view(num_complete, _REGION, -1)
    summaries = (torch.softmax(z_regions, dim=1) * k_regions).sum(1).to(torch.bfloat16).float()
    scores = (F.relu(torch.einsum("lhp,rp->lhr", iq, summaries)) * weights[:, :, None]).sum(1)  # [L, regions]
    scores = scores.cpu().tolist()
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        own = i // _REGION
        ranked = sorted(range(own), key=lambda r: (-scores[i][r], r))
        for r in ranked[: c.index_top_k] + [own]:
            allowed[i, r * _REGION : (r + 1) * _REGION] = True
    return allowed.to(h.device)


def _short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of ``x [L, C]`` with ``weight [C, W]`` plus the residual, fp32, rounded once."""
    width = weight.shape[1]
    x32 = x.float().t()[None]  # [1, C, L]
    y = F.conv1d(x32, weight.float()[:, None, :], padding=width - 1, groups=x.shape[1])[..., : x.shape[0]]
    return (y[0].t() + x.float()).to(x.dtype)


def inkling_layer_reference(layer: InklingDecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """One request's committed inputs ``x [L, hidden]`` bf16 through an Inkling layer, no cache."""
    c = layer.config
    length = x.shape[0]
    position = torch.arange(length, device=x.device)
    h = layer.input_norm(x)
    q = layer.q_proj(h).view(length, c.num_heads, c.head_dim)
    k = _short_conv(layer.k_proj(h), layer.conv_k)
    v = _short_conv(layer.v_proj(h), layer.conv_v)
    q = rope_neox(layer.q_norm(q), position, c.head_dim, c.rope_theta)
    k = rope_neox(layer.k_norm(k.view(length, c.num_kv_heads, c.head_dim)), position, c.head_dim, c.rope_theta)
    v = v.view(length, c.num_kv_heads, c.head_dim)
    window = c.sliding_window if layer.kind == INKLING_SLIDING else None
    attn = _attention(q, k, v, _causal(length, window, x.device), c.head_dim**-0.5)
    x = x + _short_conv(layer.o_proj(attn.flatten(1)), layer.conv_attn)
    return x + _short_conv(layer.mlp(layer.post_norm(x)), layer.conv_mlp)


def model_reference(model: Step5Model | InklingModel, x: torch.Tensor) -> torch.Tensor:
    """A whole stack over one request's committed inputs ``x [L, hidden]``, no cache."""
    layer_reference = step5_layer_reference if isinstance(model, Step5Model) else inkling_layer_reference
    with torch.inference_mode():
        for layer in model.layers:
            x = layer_reference(layer, x)
    return x

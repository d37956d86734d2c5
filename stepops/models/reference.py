"""Full recompute of committed sequences with no cache: the yardstick for the incremental layers.

One request at a time, the whole sequence at once, with independent formulations of everything the
incremental path does through caches and metadata: region summaries as a plain softmax over each complete
region (not the op's online fold), region selection by a Python sort on ``(-score, region)``, attention by
``scaled_dot_product_attention`` with a dense boolean mask, short convs by ``F.conv1d``. The per-token
pieces with no state (projections, norms, rope, the MLP) are the layer's own modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stepops.models.inkling import SLIDING as INKLING_SLIDING
from stepops.models.inkling import InklingDecoderLayer, InklingModel
from stepops.models.layers import rope_neox
from stepops.models.step5 import CSA, Step5DecoderLayer, Step5Model
from stepops.testing.tolerances import Tolerance

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
    return _step5_layer(layer, x, near_tie_margin=None)[0]


def _step5_layer(
    layer: Step5DecoderLayer, x: torch.Tensor, near_tie_margin: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`step5_layer_reference` and ``[L]`` bool: the tokens whose region choice is a near tie."""
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
    near_tie = torch.zeros(length, dtype=torch.bool)
    if layer.kind == CSA:
        scores = _region_scores(layer, h, position)
        allowed = _causal(length, None, x.device) & _selected_tokens(scores, c.index_top_k).to(x.device)
        if near_tie_margin is not None:
            near_tie = _near_ties(scores, c.index_top_k, near_tie_margin)
    else:
        allowed = _causal(length, c.sliding_window, x.device)
    attn = _attention(q, k, v, allowed, c.head_dim**-0.5)
    x = x + layer.o_proj(attn.flatten(1))
    return x + layer.mlp(layer.post_norm(x)), near_tie


def _region_scores(layer: Step5DecoderLayer, h: torch.Tensor, position: torch.Tensor) -> list[list[float]]:
    """``scores[i][r]``: query ``i``'s indexer score of each complete region ``r`` (fp32, as Python floats)."""
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
    return scores.cpu().tolist()


def _ranked(scores: list[list[float]], i: int) -> list[int]:
    """Query ``i``'s earlier complete regions, best first; equal scores in ascending region order."""
    return sorted(range(i // _REGION), key=lambda r: (-scores[i][r], r))


def _selected_tokens(scores: list[list[float]], top_k: int) -> torch.Tensor:
    """``[L, L]`` bool: key ``j`` is in a region query ``i`` selects (top-k earlier regions + its own)."""
    length = len(scores)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        own = i // _REGION
        for r in _ranked(scores, i)[:top_k] + [own]:
            allowed[i, r * _REGION : (r + 1) * _REGION] = True
    return allowed


def _near_ties(scores: list[list[float]], top_k: int, margin: float) -> torch.Tensor:
    """``[L]`` bool: query ``i`` has more than ``top_k`` candidate regions and its ``top_k``-th and
    ``(top_k + 1)``-th best scores are within ``margin`` times its largest candidate score's magnitude."""
    near = torch.zeros(len(scores), dtype=torch.bool)
    for i in range(len(scores)):
        ranked = _ranked(scores, i)
        if len(ranked) > top_k:
            kth, next_best = scores[i][ranked[top_k - 1]], scores[i][ranked[top_k]]
            scale = max(abs(scores[i][r]) for r in ranked)
            near[i] = kth - next_best <= margin * scale
    return near


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
    return model_reference_with_near_ties(model, x, near_tie_margin=None)[0]


# Region choices closer than this (relative to the token's largest candidate score) may go either way between
# two correct implementations: a score is a sum over 16 heads of products of bf16-rounded inputs, which a
# GPU's kernels (or Inductor's fusions) round a few bf16 ulps (2**-8 relative each) differently than the
# recompute; 2**-5 is a few times that. A flipped choice changes the token's attention by O(1).
NEAR_TIE_MARGIN = 2**-5
# Left-out rows must stay few, or the comparison would say little: seen on CPU, 0-3 of 93 rows with the CSA
# layer last and up to 9 with it first (a near tie there marks every later row of the request).
MAX_NEAR_TIE_FRACTION = 1 / 10


def model_reference_with_near_ties(
    model: Step5Model | InklingModel, x: torch.Tensor, near_tie_margin: float | None = NEAR_TIE_MARGIN
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`model_reference` and ``[L]`` bool: the rows whose output depends on a near-tie region choice.

    A token whose ``k``-th and ``(k + 1)``-th best region scores in some CSA layer (of the recompute) are
    within ``near_tie_margin`` of each other (relative to its largest candidate score) may select either
    region correctly. In the last layer that changes only its own row; in an earlier layer its changed
    output enters the later layers' keys and values, so it and every later row of the request are marked.
    ``near_tie_margin=None`` marks nothing (Inkling has no region choice and marks nothing either).
    """
    rows = torch.zeros(x.shape[0], dtype=torch.bool)
    with torch.inference_mode():
        for index, layer in enumerate(model.layers):
            if isinstance(model, Step5Model):
                x, near_tie = _step5_layer(layer, x, near_tie_margin)
                if index < len(model.layers) - 1:
                    near_tie = near_tie.cummax(0).values
                rows |= near_tie
            else:
                x = inkling_layer_reference(layer, x)
    return x, rows


@dataclass(frozen=True)
class RecomputeComparison:
    """Committed outputs of a run vs the recompute, over the rows that do not depend on a near tie.

    ``max_abs_err``: largest ``|incremental - recompute|``; ``max_row_relative_err``: largest error relative
    to its token's scale, the power of two at or below the row's largest ``|recompute|`` (one bf16 ulp there
    is ``2**-7`` of it); ``differing_fraction``: the share of
    compared elements that differ at all; ``within_bound``: whether every compared element is inside the
    given tolerance's ``atol + rtol * |recompute|`` (``None`` without one); ``near_tie_rows`` of ``rows``
    were left out.
    """

    max_abs_err: float
    max_row_relative_err: float
    differing_fraction: float
    within_bound: bool | None
    rows: int
    near_tie_rows: int

    @property
    def few_near_ties(self) -> bool:
        """Whether at most :data:`MAX_NEAR_TIE_FRACTION` of the rows were left out."""
        return self.near_tie_rows <= MAX_NEAR_TIE_FRACTION * self.rows


def compare_with_recompute(
    model: Step5Model | InklingModel,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    *,
    tolerance: Tolerance | None = None,
    near_tie_margin: float | None = NEAR_TIE_MARGIN,
) -> RecomputeComparison:
    """Compare each request's committed ``outputs`` (``[L, hidden]``) with the recompute of its ``inputs`` on
    ``model``'s device, leaving out the rows of near-tie region choices (:func:`model_reference_with_near_ties`)."""
    device = next(model.parameters()).device
    worst = worst_relative = 0.0
    differing = compared = rows = near_tie_rows = 0
    inside = True
    for x, y in zip(inputs, outputs):
        want, near_tie = model_reference_with_near_ties(model, x.to(device), near_tie_margin)
        keep = ~near_tie
        want, got = want.cpu().float()[keep], y.float()[keep]
        rows += x.shape[0]
        near_tie_rows += int(near_tie.sum())
        if not keep.any():
            continue
        err = (got - want).abs()
        worst = max(worst, float(err.max()))
        # 2**e with 2**e <= m < 2**(e + 1) for the row's largest magnitude m (frexp: m = f * 2**E, f in [0.5, 1)).
        row_max = want.abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.bfloat16).tiny)
        binade = torch.ldexp(torch.ones_like(row_max), torch.frexp(row_max).exponent - 1)
        worst_relative = max(worst_relative, float((err / binade).max()))
        differing += int((err > 0).sum())
        compared += err.numel()
        if tolerance is not None:
            inside &= bool((err <= tolerance.atol + tolerance.rtol * want.abs()).all())
    return RecomputeComparison(
        max_abs_err=worst,
        max_row_relative_err=worst_relative,
        differing_fraction=differing / max(compared, 1),
        within_bound=inside if tolerance is not None else None,
        rows=rows,
        near_tie_rows=near_tie_rows,
    )

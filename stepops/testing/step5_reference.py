"""An independent dense recompute of a Step5 stack, written from StepFun's public reference formulas.

It reads a checkpoint in the reference's names (``layers.{i}.self_attn.q_proj.weight``, ...; fp8 experts
with ``weight_scale_inv`` run the reference's fp8 GEMM, inputs quantised to e4m3 included) and one
request's committed inputs ``x [L, hidden]``, and recomputes the whole sequence with no cache. Of the model
it imports only the config's numbers (:mod:`stepops.models.step5_config`), no module or function that
computes a layer: its own norms, rope and llama3 scaling, indexer, region summaries (a plain softmax over
each complete region, not the op's online fold), selection (a Python sort on ``(-score, region)`` per KV
group), attention (a dense per-group mask, one softmax pass with its weights rounded to bf16 into ``P V``
as the reference's kernel multiplies them: :func:`~stepops.testing.dense_attention.masked_attention`, the
paged attention's test oracle), MLP and MoE (a per-expert loop over the routed tokens, as the reference's
CPU path).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from stepops.layouts import REGION_SIZE
from stepops.models.step5_config import CSA, Step5Config
from stepops.testing.dense_attention import masked_attention

_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max
_FP8_BLOCK = 128
_RENORM_EPS = 1e-20


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32 (not rounded)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + 1.0)


def _frequencies(span: int, theta: float, scaling) -> torch.Tensor:
    """The reference's ``build_rope_cache`` frequencies (fp32), with ``_apply_llama3_scaling``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, span, 2, dtype=torch.float32) / span))
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    t = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    band = (wavelen >= original / scaling.high_freq_factor) & (wavelen <= original / scaling.low_freq_factor)
    return torch.where(band, (1 - t) * stretched / scaling.factor + t * stretched, stretched)


def _rope(x: torch.Tensor, span: int, theta: float, scaling) -> torch.Tensor:
    """``x [L, ..., D]`` bf16 at positions ``0..L-1``: dims ``(d, d + span/2)`` for ``d < span/2`` rotate by
    ``position * inv_freq[d]`` with bf16 cos/sin tables; the rest pass through."""
    half = span // 2
    freqs = torch.outer(torch.arange(x.shape[0], dtype=torch.float32), _frequencies(span, theta, scaling))
    cos = freqs.cos().to(torch.bfloat16).float().to(x.device)
    sin = freqs.sin().to(torch.bfloat16).float().to(x.device)
    cos, sin = (t.view(x.shape[0], *([1] * (x.dim() - 2)), half) for t in (cos, sin))
    real, imaginary = x[..., :half].float(), x[..., half:span].float()
    out = x.clone()
    out[..., :half] = (real * cos - imaginary * sin).to(x.dtype)
    out[..., half:span] = (real * sin + imaginary * cos).to(x.dtype)
    return out


def _act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``act_quant`` of ``x [M, K]``: per row and 128-wide block along K, e4m3 codes of
    ``x / scale`` (clamped to +-448) and the fp32 ``scale = max(amax, 1e-10) * (1 / 448)``."""
    rows, width = x.shape
    codes = torch.empty(rows, width, dtype=_FP8, device=x.device)
    scales = torch.empty(rows, -(-width // _FP8_BLOCK), dtype=torch.float32, device=x.device)
    for block in range(scales.shape[1]):
        cols = slice(block * _FP8_BLOCK, (block + 1) * _FP8_BLOCK)
        values = x[:, cols].float()
        scale = values.abs().amax(-1).clamp(min=1e-10) * (1.0 / _FP8_MAX)
        codes[:, cols] = torch.clamp(values * (1.0 / scale)[:, None], -_FP8_MAX, _FP8_MAX).to(_FP8)
        scales[:, block] = scale
    return codes, scales


def _linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    """The reference's ``linear_fp8_or_bf16``: ``F.linear`` without a scale; with one, ``fp8_gemm`` of
    ``_act_quant(x)`` and the e4m3 ``weight``: per 128-wide K block the fp8 dot in fp32, times the row's
    activation scale and the block's weight scale, summed over the blocks in fp32, rounded to bf16."""
    if scale_inv is None:
        return F.linear(x, weight)
    codes, x_scales = _act_quant(x)
    out_features = weight.shape[0]
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for block in range(x_scales.shape[1]):
        cols = slice(block * _FP8_BLOCK, (block + 1) * _FP8_BLOCK)
        partial = codes[:, cols].float() @ weight[:, cols].float().t()
        w_scales = scale_inv[:, block].repeat_interleave(_FP8_BLOCK)[:out_features]
        out = out + partial * x_scales[:, block, None] * w_scales
    return out.to(torch.bfloat16)


def _swiglu(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    scales: tuple[torch.Tensor | None, ...] = (None, None, None),
) -> torch.Tensor:
    a = F.silu(_linear(x, gate, scales[0]).float()).clamp(max=limit)
    b = _linear(x, up, scales[1]).float().clamp(min=-limit, max=limit)
    return _linear((a * b).to(x.dtype), down, scales[2])


def _of_layer(limit: float | tuple[float, ...], i: int) -> float:
    """Layer ``i``'s entry of a per-layer list (the reference's ``swiglu_limits[layer_idx]``), or the one value."""
    return limit[i] if isinstance(limit, tuple) else limit


def _moe(c: Step5Config, state: Mapping[str, torch.Tensor], i: int, h: torch.Tensor) -> torch.Tensor:
    """Routed experts of layer ``i`` on ``h [L, hidden]`` bf16 -> bf16: the reference's ``Step4MoE.forward``
    CPU path."""
    prefix = f"layers.{i}."
    bias = state[f"{prefix}moe.router_bias"].float()
    scores = torch.sigmoid(h.float() @ state[f"{prefix}moe.gate.weight"].float().t()) + bias
    top, ids = torch.topk(scores, c.moe_top_k, dim=-1)
    weights = top - bias[ids]
    if c.moe_renormalize:  # the reference's norm_expert_weight
        weights = weights / (weights.sum(-1, keepdim=True) + _RENORM_EPS)
    weights = weights * c.moe_router_scaling_factor
    names = ("gate_proj", "up_proj", "down_proj")
    experts = [state[f"{prefix}moe.{name}.weight"] for name in names]  # e4m3 codes where a scale is given
    scales = [state.get(f"{prefix}moe.{name}.weight_scale_inv") for name in names]
    limit = _of_layer(c.swiglu_limit, i)
    slot_output = torch.zeros(h.shape[0], c.moe_top_k, h.shape[1], dtype=h.dtype, device=h.device)
    for e in range(c.moe_num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            expert_scales = tuple(None if scale is None else scale[e] for scale in scales)
            slot_output[rows, slots] = _swiglu(h[rows], *(w[e] for w in experts), limit, expert_scales)
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for slot in range(c.moe_top_k):
        out = out + slot_output[:, slot].float() * weights[:, slot, None]
    return out.to(h.dtype)


def indexer_scores(
    c: Step5Config, state: Mapping[str, torch.Tensor], prefix: str, h: torch.Tensor, theta: float, scaling
) -> torch.Tensor:
    """``[L, G, num_complete_regions]`` fp32: each query's score of each complete region, per KV group."""
    dots, _, head_weights = indexer_terms(c, state, prefix, h, theta, scaling)
    return region_scores(dots, head_weights)


def region_scores(dots: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """The sum over a KV group's heads of ``relu(dot) * head weight`` (:func:`indexer_terms`'s)."""
    return (dots.clamp(min=0) * head_weights[..., None]).sum(2)


def indexer_terms(
    c: Step5Config, state: Mapping[str, torch.Tensor], prefix: str, h: torch.Tensor, theta: float, scaling
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's terms per query, KV group, head of the group and complete region: the dots of the e4m3
    query and summary ``[L, G, H, R]``, the sums of their products' magnitudes (the scale a rounding of the
    dot goes with) ``[L, G, H, R]``, and the head weights ``[L, G, H]``."""
    length, groups, per_group, dim = h.shape[0], c.num_kv_heads, c.index_heads_per_group, c.index_proxy_dim
    p = f"{prefix}self_attn.sparse_indexer_"
    q = F.linear(h, state[p + "q.weight"]).view(length, c.index_num_heads, dim)
    q = _norm(q, state[p + "q_norm.weight"].to(torch.bfloat16), c.rms_norm_eps).to(torch.bfloat16)
    q = _rope(q, c.index_rope_dim, theta, scaling)
    k = F.linear(h, state[p + "k.weight"]).float()
    mean = k.mean(-1, keepdim=True)
    k = (k - mean) * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) - mean**2 + c.rms_norm_eps)
    k = k * state[p + "k_norm.weight"].to(torch.bfloat16).float() + state[p + "k_norm.bias"].to(torch.bfloat16).float()
    k = _rope(k.to(torch.bfloat16), c.index_rope_dim, theta, scaling)
    z = F.linear(h, state[p + "z.weight"])
    w = F.linear(h, state[p + "w.weight"].to(torch.bfloat16)).float() * per_group**-0.5
    n = length // REGION_SIZE
    k_regions = k[: n * REGION_SIZE].float().view(n, REGION_SIZE, dim)
    z_regions = z[: n * REGION_SIZE].float().view(n, REGION_SIZE, dim)
    summaries = (torch.softmax(z_regions, dim=1) * k_regions).sum(1)  # per-dimension softmax over the 8 tokens
    summaries = summaries.to(torch.bfloat16).float().clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).float()
    q8 = q.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).float().view(length, groups, per_group, dim)
    dots = torch.einsum("lghd,rd->lghr", q8, summaries)
    magnitudes = torch.einsum("lghd,rd->lghr", q8.abs(), summaries.abs())
    return dots, magnitudes, w.view(length, groups, per_group)


def _ranked(row: list[float], candidates: int) -> list[int]:
    """Candidate regions ``0..candidates-1`` best first; equal scores in ascending region order."""
    return sorted(range(candidates), key=lambda r: (-row[r], r))


def region_selection(
    scores: torch.Tensor, top_k: int, margin: float | None, unsettled: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, L, L]`` bool (key ``j`` in a region group ``g`` of query ``i`` selects: its top-k earlier complete
    regions and its own) and ``[L]`` bool (some group's k-th and (k+1)-th scores are within ``margin`` times
    its largest candidate magnitude).

    ``unsettled [L, G, R]`` (:func:`unsettled_scores`) separates exact ties at 0 from near ones. A score is 0
    where every head's dot is at most 0 (its relu closes), common with few heads per group. Where the k-th
    and (k+1)-th scores are both 0, no zero score is unsettled and no other score lies within the margin of
    0, every correct implementation scores the same candidates 0 and breaks the tie by the lower region id:
    no near tie. Without ``unsettled``, every gap within the margin is one, exact ties included."""
    length, groups = scores.shape[0], scores.shape[1]
    table = scores.cpu().tolist()
    unsettled_table = None if unsettled is None else unsettled.cpu().tolist()
    allowed = torch.zeros(groups, length, length, dtype=torch.bool)
    near = torch.zeros(length, dtype=torch.bool)
    for i in range(length):
        own = i // REGION_SIZE
        for g in range(groups):
            ranked = _ranked(table[i][g], own)
            for r in ranked[:top_k] + [own]:
                allowed[g, i, r * REGION_SIZE : (r + 1) * REGION_SIZE] = True
            if margin is not None and len(ranked) > top_k:
                row = table[i][g]
                kth, following = row[ranked[top_k - 1]], row[ranked[top_k]]
                bound = margin * max(abs(row[r]) for r in ranked)
                settled_zero_tie = (
                    unsettled_table is not None
                    and kth == following == 0
                    and not any(0 < abs(row[r]) <= bound or (row[r] == 0 and unsettled_table[i][g][r]) for r in ranked)
                )
                near[i] |= kth - following <= bound and not settled_zero_tie
    return allowed, near


def unsettled_scores(dots: torch.Tensor, magnitudes: torch.Tensor, margin: float) -> torch.Tensor:
    """``[L, G, R]`` bool: the scores with a head whose dot is not clearly below 0 (above ``-margin`` times its
    products' magnitudes, :func:`indexer_terms`): a rounding apart, its relu may pass a value where this one
    gives 0."""
    return (dots > -margin * magnitudes).any(2)


def recompute_layer(
    c: Step5Config, state: Mapping[str, torch.Tensor], i: int, x: torch.Tensor, margin: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i`` on the fp32 residual ``x [L, hidden]``; returns it and the near-tie rows ``[L]``."""
    prefix, kind = f"layers.{i}.", c.layer_types[i]
    a = f"{prefix}self_attn."
    length, heads, groups, dim = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    theta = c.sliding_rope_theta if kind != CSA else c.csa_rope_theta
    scaling = c.csa_rope_scaling if kind == CSA else None
    span = dim if kind != CSA else int(round(dim * c.csa_partial_rotary_factor)) // 2 * 2
    h = _norm(x, state[prefix + "input_layernorm.weight"], c.rms_norm_eps).to(torch.bfloat16)
    q = _norm(F.linear(h, state[a + "q_proj.weight"]).view(length, heads, dim), state[a + "q_norm.weight"], c.rms_norm_eps)
    k = _norm(F.linear(h, state[a + "k_proj.weight"]).view(length, groups, dim), state[a + "k_norm.weight"], c.rms_norm_eps)
    q, k = _rope(q.to(torch.bfloat16), span, theta, scaling), _rope(k.to(torch.bfloat16), span, theta, scaling)
    v = F.linear(h, state[a + "v_proj.weight"]).view(length, groups, dim)
    i_pos = torch.arange(length)[:, None]
    j_pos = torch.arange(length)[None, :]
    near = torch.zeros(length, dtype=torch.bool)
    if kind == CSA:
        dots, magnitudes, head_weights = indexer_terms(c, state, prefix, h, theta, scaling)
        unsettled = None if margin is None else unsettled_scores(dots, magnitudes, margin)
        allowed, near = region_selection(region_scores(dots, head_weights), c.index_top_k, margin, unsettled)
        allowed &= j_pos <= i_pos
    else:
        allowed = ((j_pos <= i_pos) & (j_pos > i_pos - c.sliding_window)).expand(groups, length, length)
    # One tile of the reference kernel's fold (kernel.py ``sparse_attention_prefill``): fp32 scores, the
    # weights exp(s - max) rounded to bf16 into P V (``tl.dot(probabilities.to(values.dtype), values)``).
    keys, values = (t.to(torch.bfloat16)[None].expand(length, -1, -1, -1) for t in (k, v))
    attn = masked_attention(q.to(torch.bfloat16), keys, values, allowed.transpose(0, 1).to(x.device), dim**-0.5)
    if c.head_wise_attn_gate:  # Step4Attention._gate_and_project
        attn = attn * torch.sigmoid(F.linear(h, state[a + "g_proj.weight"]))[:, :, None]
    x = x + F.linear(attn.reshape(length, heads * dim), state[a + "o_proj.weight"]).float()
    h = _norm(x, state[prefix + "post_attention_layernorm.weight"], c.rms_norm_eps).to(torch.bfloat16)
    if i in c.moe_layers:
        s = f"{prefix}share_expert."
        shared = _swiglu(h, state[s + "gate_proj.weight"], state[s + "up_proj.weight"], state[s + "down_proj.weight"],
                         _of_layer(c.swiglu_limit_shared, i))
        # Step4DecoderLayer._feed_forward: the two branches are summed in fp32 before the residual add.
        return x + (_moe(c, state, i, h).float() + shared.float()), near
    m = f"{prefix}mlp."
    mlp = _swiglu(h, state[m + "gate_proj.weight"], state[m + "up_proj.weight"], state[m + "down_proj.weight"],
                  _of_layer(c.swiglu_limit, i))
    return x + mlp.float(), near


def step5_recompute(
    config: Step5Config, state: Mapping[str, torch.Tensor], x: torch.Tensor, near_tie_margin: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's committed inputs ``x [L, hidden]`` through the whole stack and the final norm.

    Returns ``[L, hidden]`` bf16 and ``[L]`` bool: the rows whose output depends on a near-tie region choice
    (see :func:`region_selection`). A near tie in a layer before the last changes that row's keys and values
    there, so it and every later row of the request are marked.
    """
    rows = torch.zeros(x.shape[0], dtype=torch.bool)
    residual = x.float()
    with torch.inference_mode():
        for i in range(len(config.layer_types)):
            residual, near = recompute_layer(config, state, i, residual, near_tie_margin)
            rows |= near.cummax(0).values if i < len(config.layer_types) - 1 else near
        out = _norm(residual.to(torch.bfloat16), state["norm.weight"], config.rms_norm_eps).to(torch.bfloat16)
    return out, rows

"""Step5 decoder layers on the stepops cache ops, as StepFun's public reference computes them.

A step takes the step's flattened hidden states ``[T, hidden]`` (prefill chunks, decode and verify tokens of
many requests, padding last) and its :class:`Step5StepMetadata`. The residual stream is fp32; matmul inputs
are bf16. Per layer (``docs/models.md`` maps each line to the reference)::

    h = bf16(ZCNorm(x))                              ZCNorm(x) = x / rms(x) * (1 + w), fp32
    q, k, v = q_proj(h), k_proj(h), v_proj(h);  q, k = rope(ZCNorm_head(q)), rope(ZCNorm_head(k))
    paged_kv_write(k, v -> this layer's KV cache)
    sliding layer: each token attends to the last ``sliding_window`` positions (rope theta 1e4, whole head)
    CSA layer:     rope theta 5e6 over a third of the head, llama3-scaled; the indexer, per KV group g:
                   iq = rope(ZCNorm(Wq h)) [T, G, Hg, 256],  ik = rope(LayerNorm(Wk h)),  iz = Wz h,
                   w = (Ww h) * Hg**-0.5 [T, G, Hg];  csa_ring_update(ik, iz -> ring, e4m3 summaries)
                   score[t, g, r] = sum_h relu(e4m3(iq[t, g, h]) . summary[r]) * w[t, g, h],  r < own region
                   KV head g attends (causally) to the top-k regions of group g (ties: lower id) + its own
    x = x + o_proj(attn * sigmoid(g_proj(h)) per head)   (o_proj(attn) without head_wise_attn_gate)
    x = x + FFN(bf16(ZCNorm(x)))       FFN: clamped SwiGLU MLP, or routed experts + shared expert (MoE)

The stack ends with the reference's final norm: ``out = ZCNorm(bf16(x))`` in bf16. Caches are owned
through :mod:`stepops.owners` (a :class:`PagedAttentionLayer` per layer, a :class:`Step5CSATailRing` per CSA
layer) and allocated by :func:`stepops.allocator.allocate_kv_caches`; the e4m3 summary cache of each CSA
layer is the layer's own ``[num_slots, 256]`` tensor of e4m3 codes. Parameter names are the checkpoint's
(``self_attn.q_proj.weight``, ``moe.gate_proj.weight``, ...): see :mod:`stepops.models.step5_weights`.
:class:`Step5ForCausalLM` adds the reference's token embedding and output head (token ids to logits).
The numbers (:class:`Step5Config`, the released model's ``STEP5_REFERENCE``) are in
:mod:`stepops.models.step5_config`. With a ``process_group``, the routed experts are split over its ranks by
expert (expert parallelism, :class:`Step5MoE`); everything else is whole on every rank.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stepops.allocator import KVCaches, allocate_kv_caches
from stepops.layouts import REGION_SIZE, REPLAY_ROWS
from stepops.models.dtypes import check_step_hidden, tensor_dtypes
from stepops.models.metadata import (
    StepBuffers,
    Step5StepMetadata,
    build_step5_metadata,
    common_attn_block_size,
    common_size,
)
from stepops.models.moe import small_step_max_tokens
from stepops.models.paged_attention import csa_region_scorer, paged_attention, sparse_region_attention, streaming_topk
from stepops.models.step5_config import CSA, SLIDING, Llama3RopeScaling, Step5Config
from stepops.models.tensor_parallel import TensorParallel, all_reduce_sum
from stepops.ops.paged_kv_write import paged_kv_write
from stepops.owners import PagedAttentionLayer, Step5CSATailRing

# The deployed router kernel's guard on the renormalising sum (model.py ROUTER_RENORM_EPS).
ROUTER_RENORM_EPS = 1e-20
# fp8 experts (kernel.py): weights in 128 x 128 blocks of one scale, GEMM inputs rounded per 128 along K, each
# block's scale max(amax, FP8_AMAX_FLOOR) / 448.
FP8_BLOCK = 128
FP8_AMAX_FLOOR = 1e-10


def rope_inv_freq(rotary_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """``[rotary_dim // 2]`` fp32 inverse frequencies ``1 / theta^(2i / rotary_dim)``, llama3-scaled if given."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), smoothed, scaled)


def apply_rope(x: torch.Tensor, position: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NEOX rotation of the first ``2 * len(inv_freq)`` dims of ``x [T, ..., D]`` bf16 at ``position [T]``.

    As the reference: the angle is fp32, cos/sin are rounded to bf16 (its cached tables are bf16), the
    rotation is fp32 and the rotated dims are rounded once; the other dims pass through.
    """
    half = inv_freq.shape[0]
    angle = position.float()[:, None] * inv_freq  # [T, half]
    shape = (angle.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = angle.cos().to(torch.bfloat16).float().view(shape)
    sin = angle.sin().to(torch.bfloat16).float().view(shape)
    a, b = x[..., :half].float(), x[..., half : 2 * half].float()
    rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)


class ZeroCentredRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + w)`` over the last dim in fp32, rounded once to ``x.dtype``.

    ``w`` is fp32, initialised at 0 (checkpoint weights sit near 0). ``bf16_weight``: round ``w`` to bf16
    first, as the reference's indexer kernel receives it.
    """

    def __init__(self, dim: int, eps: float, *, bf16_weight: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.bf16_weight = bf16_weight
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        w = self.weight.to(torch.bfloat16) if self.bf16_weight else self.weight
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (w.float() + 1.0)).to(x.dtype)


class IndexerKeyNorm(nn.Module):
    """The indexer key's LayerNorm as the reference kernel computes it: ``var = mean(x^2) - mean^2`` in
    fp32, weight and bias (fp32 parameters) rounded to bf16, result rounded once to ``x.dtype``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) - mean * mean + self.eps)
        w, b = self.weight.to(torch.bfloat16).float(), self.bias.to(torch.bfloat16).float()
        return ((x32 - mean) * rstd * w + b).to(x.dtype)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float8_e4m3fn (``Tensor.to``, as the reference's ``round_activations_e4m3``), in fp32,
    saturating at +-448 as the summary store does.

    Clamped first: torch 2.11's eager cast (the GPU machines' torch) turns |x| >= 464 into NaN, while torch
    2.12+ and Inductor's Triton code saturate, so without the clamp eager and compiled steps, or two torch
    releases, would disagree on an overflowing indexer query (a NaN score)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    return x.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).float()


def round_to_e4m3_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as an fp8 expert GEMM of the reference sees it, in fp32: each row's blocks of
    :data:`FP8_BLOCK` along ``K`` (the last one ragged) rounded to e4m3 with the scale
    ``max(amax, 1e-10) * (1 / 448)`` of the block (``act_quant``), times that scale."""
    num_features = x.shape[-1]
    blocks = F.pad(x.float(), (0, -num_features % FP8_BLOCK)).unflatten(-1, (-1, FP8_BLOCK))
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR) * (1.0 / torch.finfo(torch.float8_e4m3fn).max)
    return (round_to_e4m3(blocks * (1.0 / scale)) * scale).flatten(-2)[..., :num_features]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)`` in fp32, rounded once to ``gate.dtype``."""
    return (F.silu(gate.float()).clamp(max=limit) * up.float().clamp(-limit, limit)).to(gate.dtype)


class Step5MLP(nn.Module):
    """Clamped SwiGLU ``down(clamped_swiglu(gate(x), up(x)))``: the dense FFN and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def check_fp8_blocks(name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """``TypeError``/``ValueError`` naming ``name`` unless ``weight [..., out, in]`` is float8_e4m3fn and
    ``scale_inv`` fp32 ``[..., ceil(out/128), ceil(in/128)]`` (one scale per 128 x 128 block)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: an fp8 expert weight must be float8_e4m3fn, got {weight.dtype}")
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"{name}: weight_scale_inv must be float32, got {scale_inv.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"{name}: an fp8 weight must be [..., out, in], got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape[-2:]
    blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    if scale_inv.shape != weight.shape[:-2] + blocks:
        raise ValueError(
            f"{name}: weight_scale_inv must be {tuple(weight.shape[:-2] + blocks)} for a weight of "
            f"{tuple(weight.shape)}, got {tuple(scale_inv.shape)}"
        )


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``weight [..., out, in]`` float8_e4m3fn times ``scale_inv [..., ceil(out/128), ceil(in/128)]`` fp32
    (each scale covers one 128 x 128 block) in fp32: the reference's ``w_fp8 * weight_scale_inv[block]``,
    for shapes :func:`check_fp8_blocks` accepts (checked once, at load; this runs in every expert GEMM). The
    codes in fp32 are viewed as ``[..., out/128, 128, in/128, 128]`` blocks (zero-padded where ragged) and
    scaled in place by the broadcast scales: no scale tensor of the weight's size is made."""
    out_features, in_features = weight.shape[-2:]
    pad_out, pad_in = -out_features % FP8_BLOCK, -in_features % FP8_BLOCK
    values = weight.float()
    if pad_out or pad_in:
        values = F.pad(values, (0, pad_in, 0, pad_out))
    *lead, rows, cols = values.shape
    blocks = values.view(*lead, rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    blocks.mul_(scale_inv[..., :, None, :, None])
    return values[..., :out_features, :in_features]


class StackedExpertWeight(nn.Module):
    """One ``[num_experts, out, in]`` weight (the checkpoint's ``moe.{gate,up,down}_proj.weight``).

    ``fp8`` (loaded with a scale, :meth:`load`): ``weight`` holds the checkpoint's e4m3 codes as they are,
    1 byte per weight, and ``weight_scale_inv`` its fp32 scale per 128 x 128 block. Each GEMM multiplies
    the experts it runs dequantised to fp32 (:meth:`dequantized`: a code times its scale is off by 2**-24
    there, by 2**-9 in bf16), with its input rounded to e4m3 as the reference's fp8 GEMM rounds it
    (:func:`round_to_e4m3_blocks`, :meth:`matmul_input`). Both tensors are in ``state_dict()``; load them
    with ``step5_weights.load_step5_state_dict`` (a fresh model has no ``weight_scale_inv`` for
    ``load_state_dict`` to fill). Loading may replace the Parameter (another dtype or device), so load before
    compiling, capturing or handing the parameters to anything.

    ``first_expert``: the model's id of expert 0 here (an expert-parallel rank holds experts
    ``[first_expert, first_expert + num_experts)`` of the checkpoint's; 0 unsharded).
    """

    def __init__(
        self, num_experts: int, out_features: int, in_features: int, dtype: torch.dtype, first_expert: int = 0
    ) -> None:
        super().__init__()
        self.first_expert = first_expert
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype))
        nn.init.uniform_(self.weight, -(in_features**-0.5), in_features**-0.5)
        self.built_dtype = dtype
        # e4m3 codes are not trained (held with requires_grad=False); a later load in ``built_dtype`` gives
        # the weight back the requires_grad it had before it held codes.
        self._requires_grad_unquantized = self.weight.requires_grad
        self.register_buffer("weight_scale_inv", None)

    @property
    def fp8(self) -> bool:
        """Whether the weight is e4m3 codes with block scales."""
        return self.weight_scale_inv is not None

    def load(
        self,
        weight: torch.Tensor,
        scale_inv: torch.Tensor | None = None,
        *,
        name: str = "weight",
        device: torch.device | str | None = None,
    ) -> None:
        """Hold a checkpoint's ``weight`` (this one's shape, never aliasing the caller's tensor): with
        ``scale_inv``, as float8_e4m3fn codes and their block scales (checked by :func:`check_fp8_blocks`);
        otherwise in the dtype it was built with. On ``device`` (default: where the weight is; a weight built
        on the meta device is allocated there once, in the dtype it is held in)."""
        if scale_inv is not None:
            check_fp8_blocks(name, weight, scale_inv)
        dtype = weight.dtype if scale_inv is not None else self.built_dtype
        device = self.weight.device if device is None else torch.device(device)
        with torch.no_grad():
            if self.weight.dtype == dtype and self.weight.device == device:
                self.weight.copy_(weight)
            else:
                if not self.fp8:
                    self._requires_grad_unquantized = self.weight.requires_grad
                held = weight.to(device=device, dtype=dtype, copy=True)
                self.weight = nn.Parameter(held, requires_grad=scale_inv is None and self._requires_grad_unquantized)
        if scale_inv is not None:
            scale_inv = scale_inv.to(device=device, copy=True)
        self.weight_scale_inv = scale_inv

    def dequantized(self, expert_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[num_experts | len(expert_ids), out, in]``: the weights of ``expert_ids`` (all experts when
        ``None``) as the GEMM multiplies them: e4m3 codes times their block scales in fp32 for an fp8
        weight (only the chosen experts' codes are gathered), as held otherwise."""
        weight, scale = self.weight, self.weight_scale_inv
        if expert_ids is not None:
            weight = weight.index_select(0, expert_ids)
            scale = None if scale is None else scale.index_select(0, expert_ids)
        return weight if scale is None else dequantize_fp8_blocks(weight, scale)

    def matmul_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as this weight's GEMM takes it: rounded to e4m3 per block in fp32 for an fp8 weight (the
        product then sums in fp32, as the reference's ``fp8_gemm``), as it is otherwise."""
        return round_to_e4m3_blocks(x) if self.fp8 else x


class Step5MoE(nn.Module):
    """Sigmoid router with a selection-only bias over stacked experts (the shared expert is the layer's).

    Routing: ``s = sigmoid(x W_gate^T) + bias`` in fp32, the top-k experts by ``s``, weights ``s - bias``
    renormalised to sum 1 (``moe_renormalize``, as in the release) and scaled by ``moe_router_scaling_factor``.
    Each chosen expert's clamped SwiGLU output (bf16; ``limit``, its layer's) is summed in slot order
    (best expert first) with an fp32 accumulator and rounded once to bf16, as the reference's
    ``Step4MoE.forward``.

    Two paths with these semantics, picked by the step's token count ``T`` (a static shape: fixed in a CUDA
    graph; the runner compiles one graph per side of :attr:`small_step_max_tokens`), neither with a
    data-dependent shape or a host sync:

    - ``T * top_k < num_experts`` (decode and verify steps of real models, e.g. 352 experts top-8 up to
      T = 43): the chosen experts' weights are gathered per (token, slot), ``[T, k, I, hidden]`` and
      ``[T, k, hidden, I]``, and run as batched matrix-vector products: ``k`` experts' work per token.
    - otherwise every expert runs on every token as one GEMM (``num_experts / top_k`` times the routed
      work) and the chosen outputs are gathered.

    They differ only where a GEMM's blocking depends on its row count (1 row per (token, slot) against ``T``
    rows): in bf16 on CPU bitwise equal (tests/models/test_moe_small_step.py), in fp32 a few ulps of a dot
    product. An fp8 checkpoint's experts are held as e4m3 codes and block scales, dequantised to fp32 for
    each GEMM, whose inputs are rounded to e4m3 and which sums in fp32, as the reference's ``fp8_gemm``
    (:class:`StackedExpertWeight`).

    Expert parallel (``ep``, a group of ``ep.size > 1`` ranks): rank ``r`` holds experts
    ``[r E/ep, (r+1) E/ep)`` (the router is whole on every rank, which routes alike) and computes the
    chosen outputs of those (token, slot) pairs, zeros elsewhere. One all-reduce of the ``[T, k, hidden]``
    bf16 outputs then gives every rank each pair's output: one rank's value plus zeros, exact. The weighted
    fp32 sum in slot order runs after it as on one rank, so the block's output is the unsharded block's,
    bit for bit, at a step size where both take the same path. Each rank picks it by its own expert count
    (``T * top_k < E / ep``: what a step reads), so a size between the two bounds takes the chosen-experts
    path on one rank and the all-experts path on ``ep``: the same bits in bf16 on CPU, a few fp32 ulps
    apart otherwise (above).
    """

    def __init__(
        self, config: Step5Config, dtype: torch.dtype, limit: float, ep: TensorParallel = TensorParallel()
    ) -> None:
        super().__init__()
        c = config
        if c.moe_num_experts % ep.size:
            raise ValueError(
                f"Step5 expert parallelism needs moe_num_experts ({c.moe_num_experts}) divisible by the "
                f"process group's size ({ep.size})"
            )
        self.top_k = c.moe_top_k
        self.scaling_factor = c.moe_router_scaling_factor
        self.renormalize = c.moe_renormalize
        self.limit = limit
        self.ep = ep
        num_experts = c.moe_num_experts // ep.size  # this rank's
        first = ep.rank * num_experts
        self.gate = nn.Linear(c.hidden_size, c.moe_num_experts, bias=False, dtype=dtype)
        self.router_bias = nn.Parameter(torch.zeros(c.moe_num_experts, dtype=torch.float32))
        self.gate_proj = StackedExpertWeight(num_experts, c.moe_intermediate_size, c.hidden_size, dtype, first)
        self.up_proj = StackedExpertWeight(num_experts, c.moe_intermediate_size, c.hidden_size, dtype, first)
        self.down_proj = StackedExpertWeight(num_experts, c.hidden_size, c.moe_intermediate_size, dtype, first)

    @property
    def small_step_max_tokens(self) -> int:
        """The largest token count that runs only the chosen experts (``T * top_k <`` this rank's experts)."""
        return small_step_max_tokens(self.gate_proj.weight.shape[0], self.top_k)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> ``(weights [T, k] fp32, expert ids [T, k])``, best expert first."""
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float())) + self.router_bias
        top, ids = torch.topk(scores, self.top_k, dim=-1)
        weights = top - self.router_bias[ids]
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + ROUTER_RENORM_EPS)
        return weights * self.scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.ep.size > 1:
            # This rank's index of each chosen expert; another rank's is clamped to one of ours, computed, and
            # its output replaced by zero before the all-reduce.
            num_experts = self.gate_proj.weight.shape[0]
            ids = ids - self.gate_proj.first_expert
            ours = (ids >= 0) & (ids < num_experts)
            ids = ids.clamp(0, num_experts - 1)
        if x.shape[0] <= self.small_step_max_tokens:
            chosen = self.chosen_experts(x, ids)
        else:
            chosen = self.all_experts(x, ids)
        if self.ep.size > 1:
            # where, not a multiply: an expert run on another rank's token may overflow to inf
            chosen = all_reduce_sum(torch.where(ours[:, :, None], chosen, 0), self.ep)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for slot in range(self.top_k):
            out = out + chosen[:, slot].float() * weights[:, slot, None]
        return out.to(x.dtype)

    def gate_up_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` as the gate and the up GEMMs take it (:meth:`StackedExpertWeight.matmul_input`), rounded once
        when both round it."""
        gate = self.gate_proj.matmul_input(x)
        return gate, gate if self.up_proj.fp8 == self.gate_proj.fp8 else self.up_proj.matmul_input(x)

    def all_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[T, k, hidden]``: every expert on every token (one GEMM), the outputs of ``ids [T, k]`` gathered."""
        num_tokens = x.shape[0]
        num_experts, inner, hidden = self.gate_proj.weight.shape

        def every_expert(proj: StackedExpertWeight, rows: torch.Tensor) -> torch.Tensor:  # [T, E, I], x's dtype
            flat = F.linear(rows, proj.dequantized().reshape(num_experts * inner, hidden))
            return flat.to(x.dtype).view(num_tokens, num_experts, inner)

        gate_rows, up_rows = self.gate_up_inputs(x)
        act = clamped_swiglu(every_expert(self.gate_proj, gate_rows), every_expert(self.up_proj, up_rows), self.limit)
        down = self.down_proj
        act = down.matmul_input(act.transpose(0, 1))  # [E, T, I]
        expert_out = torch.bmm(act, down.dequantized().transpose(1, 2)).to(x.dtype)  # [E, T, hidden]
        return expert_out.transpose(0, 1).gather(1, ids[:, :, None].expand(-1, -1, hidden))

    def chosen_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[T, k, hidden]``: only the experts ``ids [T, k]``, their weights gathered per (token, slot)."""
        num_tokens, top_k = ids.shape
        flat = ids.flatten()

        def chosen(proj: StackedExpertWeight, rows: torch.Tensor) -> torch.Tensor:  # rows [T, k|1, 1, in]
            weight = proj.dequantized(flat).view(num_tokens, top_k, *proj.weight.shape[1:])
            return (rows @ weight.transpose(-1, -2)).to(x.dtype)  # W^T per (token, slot)

        # One row per (token, slot), as F.linear's row-times-W^T.
        gate_rows, up_rows = (rows[:, None, None, :] for rows in self.gate_up_inputs(x))
        act = clamped_swiglu(chosen(self.gate_proj, gate_rows), chosen(self.up_proj, up_rows), self.limit)
        return chosen(self.down_proj, self.down_proj.matmul_input(act))[:, :, 0]  # [T, k, hidden] bf16


class Step5Attention(nn.Module):
    """The attention block: projections, per-head q/k norms, rope, the head-wise gate and, on CSA layers,
    the sparse indexer's parameters (the checkpoint keeps them here, not in a submodule)."""

    def __init__(self, config: Step5Config, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.kind = kind
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype)
        if c.head_wise_attn_gate:
            self.g_proj = nn.Linear(c.hidden_size, c.num_heads, bias=False, dtype=dtype)
        self.q_norm = ZeroCentredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(c.head_dim, c.rms_norm_eps)
        if kind == CSA:
            p = c.index_proxy_dim
            self.sparse_indexer_q = nn.Linear(c.hidden_size, c.index_num_heads * p, bias=False, dtype=dtype)
            self.sparse_indexer_k = nn.Linear(c.hidden_size, p, bias=False, dtype=dtype)
            self.sparse_indexer_z = nn.Linear(c.hidden_size, p, bias=False, dtype=dtype)
            # fp32 in the checkpoint; rounded to bf16 before its GEMM, as the deployed path loads it.
            self.sparse_indexer_w = nn.Linear(c.hidden_size, c.index_num_heads, bias=False, dtype=torch.float32)
            self.sparse_indexer_q_norm = ZeroCentredRMSNorm(p, c.rms_norm_eps, bf16_weight=True)
            self.sparse_indexer_k_norm = IndexerKeyNorm(p, c.rms_norm_eps)
        self.compute_rope_frequencies(config)

    def compute_rope_frequencies(self, config: Step5Config) -> None:
        """(Re)compute the rotary inverse frequencies from ``config`` on the device of the projections:
        ``rope_inv_freq`` and, on a CSA layer, the indexer's ``index_rope_inv_freq``. Non-persistent
        buffers, in no checkpoint: a model built on the meta device gets them here once its weights are
        real (:func:`~stepops.models.step5_weights.load_step5_state_dict`)."""
        theta, scaling = config.rope_theta(self.kind), config.rope_scaling(self.kind)
        rotary_dims = {"rope_inv_freq": config.rotary_dim(self.kind)}
        if self.kind == CSA:
            rotary_dims["index_rope_inv_freq"] = config.index_rope_dim
        with torch.device(self.q_proj.weight.device):
            for name, rotary_dim in rotary_dims.items():
                self.register_buffer(name, rope_inv_freq(rotary_dim, theta, scaling), persistent=False)


class Step5DecoderLayer(nn.Module):
    """One Step5 decoder layer (``config.layer_types[layer_index]`` picks sliding-window or CSA; the FFN is
    MoE when ``layer_index`` is in ``config.moe_layers``). Takes and returns the fp32 residual stream.

    Registers its cache owners in ``static_forward_context`` under ``{prefix}.attn`` (and
    ``{prefix}.csa_ring``); the caches are bound later by :func:`stepops.allocator.allocate_kv_caches`.
    Run it under ``torch.inference_mode()`` (the cache ops have no autograd formula).

    ``process_group``: ``None`` or a group of one is the unsharded layer; with more ranks, an MoE layer's
    routed experts are split over them (:class:`Step5MoE`) and the rest is whole on every rank.
    """

    def __init__(
        self,
        config: Step5Config,
        layer_index: int,
        *,
        static_forward_context: MutableMapping[str, Any],
        prefix: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.kind = c.layer_types[layer_index]
        self.is_moe = layer_index in c.moe_layers
        prefix = prefix or f"layers.{layer_index}"
        self.input_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Step5Attention(c, self.kind, dtype)
        limit, shared_limit = c.swiglu_limits(layer_index)
        if self.is_moe:
            self.moe = Step5MoE(c, dtype, limit, TensorParallel.from_group(process_group))
            self.share_expert = Step5MLP(c.hidden_size, c.share_expert_dim, shared_limit, dtype)
        else:
            self.mlp = Step5MLP(c.hidden_size, c.intermediate_size, limit, dtype)
        self.attn = PagedAttentionLayer(
            prefix=f"{prefix}.attn",
            num_kv_heads=c.num_kv_heads,
            head_size=c.head_dim,
            block_size=c.block_size,
            static_forward_context=static_forward_context,
            sliding_window=c.sliding_window if self.kind == SLIDING else None,
        )
        if self.kind == CSA:
            self.csa_ring = Step5CSATailRing(
                prefix=f"{prefix}.csa_ring",
                main_layer_name=f"{prefix}.attn",
                num_speculative_tokens=c.num_speculative_tokens,
                static_forward_context=static_forward_context,
            )
            self.summary_cache = torch.empty(0, c.index_proxy_dim, dtype=torch.uint8)

    def bind_summary_cache(self, summary_cache: torch.Tensor) -> None:
        """Give a CSA layer its own summary cache ``[num_slots, 256]`` uint8 holding float8_e4m3fn codes.

        Held as bytes, which the op writes as codes: no dtype view of the cache enters a compiled step (one
        that writes a dtype view of a graph input copies the whole input back afterwards)."""
        if self.kind != CSA:
            raise ValueError("only CSA layers have a summary cache")
        if summary_cache.dim() != 2 or summary_cache.shape[1] != self.config.index_proxy_dim:
            raise ValueError(f"summary_cache must be [num_slots, {self.config.index_proxy_dim}], got {tuple(summary_cache.shape)}")
        if summary_cache.dtype != torch.uint8:
            raise TypeError(f"summary_cache must be uint8 (float8_e4m3fn codes), got {summary_cache.dtype}")
        self.summary_cache = summary_cache

    def forward(self, residual: torch.Tensor, metadata: Step5StepMetadata) -> torch.Tensor:
        """``residual [T, hidden_size]`` fp32 -> ``[T, hidden_size]`` fp32; writes this layer's caches."""
        h = self.input_layernorm(residual).to(torch.bfloat16)
        residual = residual + self._attention(h, metadata).float()
        h = self.post_attention_layernorm(residual).to(torch.bfloat16)
        if self.is_moe:
            # The reference's _feed_forward: routed + shared in fp32 first, then that sum onto the residual.
            return residual + (self.moe(h).float() + self.share_expert(h).float())
        return residual + self.mlp(h).float()

    def _attention(self, h: torch.Tensor, metadata: Step5StepMetadata) -> torch.Tensor:
        c, attn = self.config, self.self_attn
        num_tokens = h.shape[0]
        position = metadata.token.position
        q = attn.q_norm(attn.q_proj(h).view(num_tokens, c.num_heads, c.head_dim))
        k = attn.k_norm(attn.k_proj(h).view(num_tokens, c.num_kv_heads, c.head_dim))
        q = apply_rope(q, position, attn.rope_inv_freq)
        k = apply_rope(k, position, attn.rope_inv_freq)
        v = attn.v_proj(h).view(num_tokens, c.num_kv_heads, c.head_dim)
        kv_cache = self.attn.kv_cache
        paged_kv_write(k, v, kv_cache[..., : c.head_dim], kv_cache[..., c.head_dim :], metadata.attn_slot_mapping)
        table, scale = metadata.attn_block_table, c.head_dim**-0.5
        if self.kind == SLIDING:
            out = paged_attention(q, kv_cache, table, metadata.token, scale=scale, sliding_window=c.sliding_window,
                                  query_tile=c.num_speculative_tokens + 1, keys_per_chunk=c.attention_keys_per_chunk)
        else:
            regions = self._select_regions(h, metadata)  # [T, G, index_top_k]
            out = sparse_region_attention(q, kv_cache, table, metadata.token, regions, scale=scale)
        if c.head_wise_attn_gate:
            out = out * torch.sigmoid(attn.g_proj(h))[:, :, None]
        return attn.o_proj(out.flatten(1))

    def _select_regions(self, h: torch.Tensor, metadata: Step5StepMetadata) -> torch.Tensor:
        """Run the CSA indexer; return ``[T, G, index_top_k]`` int64: the regions KV group ``g`` of each token
        attends to besides its own (its top-k earlier complete regions by group ``g``'s score, ties to the
        lower id; ``-1`` where fewer exist). Scored a chunk of regions at a time (:func:`streaming_topk`)."""
        c, attn = self.config, self.self_attn
        num_tokens, groups, per_group = h.shape[0], c.num_kv_heads, c.index_heads_per_group
        position = metadata.token.position
        iq = attn.sparse_indexer_q_norm(attn.sparse_indexer_q(h).view(num_tokens, c.index_num_heads, c.index_proxy_dim))
        iq = apply_rope(iq, position, attn.index_rope_inv_freq)
        ik = apply_rope(attn.sparse_indexer_k_norm(attn.sparse_indexer_k(h)), position, attn.index_rope_inv_freq)
        iz = attn.sparse_indexer_z(h)
        weights = F.linear(h, attn.sparse_indexer_w.weight.to(h.dtype)).float() * per_group**-0.5  # [T, Hi]
        # Ring rows and the e4m3 summaries of every region a token of this step closes; later tokens of the
        # step read those summaries below (the op runs first in program order).
        self.csa_ring.update(ik, iz, self.summary_cache, metadata.ring)
        iq8 = round_to_e4m3(iq).view(num_tokens, groups, per_group, c.index_proxy_dim)
        scorer = csa_region_scorer(
            iq8,
            weights.view(num_tokens, groups, per_group),
            self.summary_cache,
            metadata.summary_block_table,
            metadata.summary_block_size,
            metadata.token,
        )
        num_regions = metadata.attn_block_table.shape[1] * self.attn.kv_cache.shape[1] // REGION_SIZE
        values, ids = streaming_topk(scorer, num_regions, c.index_top_k, c.indexer_regions_per_chunk)
        return torch.where(values > float("-inf"), ids, -1)


class Step5Model(nn.Module):
    """A stack of :class:`Step5DecoderLayer` and the final norm, with its forward context (cache owners).

    :meth:`allocate_caches` gives every layer its own caches; :meth:`forward` runs one step: it derives the
    per-token metadata from the step's :class:`StepBuffers` on the device, then carries the fp32 residual
    stream through every layer and returns ``norm(bf16(residual))`` ``[T, hidden]`` bf16.

    ``process_group`` (expert parallelism, ``docs/tensor-parallel.md``): each rank holds its share of every
    MoE layer's routed experts (the rest whole) and computes the unsharded model's outputs (:class:`Step5MoE`
    says when bit for bit); load it with :func:`~stepops.models.step5_weights.load_step5` or
    :func:`~stepops.models.step5_weights.load_step5_state_dict` of the whole checkpoint. ``ValueError`` when
    the experts do not split evenly over the group.
    """

    def __init__(
        self,
        config: Step5Config = Step5Config(),
        *,
        dtype: torch.dtype = torch.bfloat16,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ep = TensorParallel.from_group(process_group)  # each MoE layer checks that its experts split
        self.static_forward_context: dict[str, Any] = {}
        self.layers = nn.ModuleList(
            Step5DecoderLayer(
                config, i, static_forward_context=self.static_forward_context, dtype=dtype, process_group=process_group
            )
            for i in range(len(config.layer_types))
        )
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.summary_block_size = 16  # regions per summary-cache block
        self.dtype = dtype
        self.built_dtypes = tensor_dtypes(self)
        self.cache_generation = 0  # how many times allocate_caches has bound new caches

    def allocate_caches(self, num_blocks: int, num_summary_blocks: int, device: torch.device | str) -> KVCaches:
        """Allocate and bind every layer's own KV cache and ring (``num_blocks`` blocks, through the
        allocator) and each CSA layer's e4m3 summary cache (``num_summary_blocks * summary_block_size`` rows)."""
        caches = allocate_kv_caches(self.static_forward_context, num_blocks, device=device)
        self.cache_generation += 1
        for layer in self.layers:
            if layer.kind == CSA:
                layer.bind_summary_cache(
                    torch.zeros(num_summary_blocks * self.summary_block_size, self.config.index_proxy_dim,
                                dtype=torch.uint8, device=device)
                )
        return caches

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every cache a step writes, one tensor per cache (to compare two models' caches)."""
        return self._written_tensors(lambda ring: ring.kv_cache)

    def mutated_tensors(self) -> list[torch.Tensor]:
        """Every tensor object a step writes through, as a compiled graph sees its inputs: each layer's KV
        cache and, for a CSA layer, its ring's 2-D ``rows`` view (what ``csa_ring_update`` receives: another
        tensor object than the ring's ``kv_cache``, over the same storage) and its summary cache. Mark these
        static (``torch._dynamo.mark_static_address``) before ``mode="reduce-overhead"``."""
        return self._written_tensors(lambda ring: ring.rows)

    def _written_tensors(self, ring_tensor) -> list[torch.Tensor]:
        """Each layer's KV cache and, for a CSA layer, ``ring_tensor(layer.csa_ring)`` and its summary cache."""
        out = []
        for layer in self.layers:
            out.append(layer.attn.kv_cache)
            if layer.kind == CSA:
                out += [ring_tensor(layer.csa_ring), layer.summary_cache]
        return out

    @property
    def attn_block_size(self) -> int:
        """Tokens per block of the bound KV caches (every layer's; ``ValueError`` if unbound or unequal)."""
        return common_attn_block_size(self.layers)

    @property
    def rows_per_block(self) -> int:
        """Rows between consecutive blocks of the bound CSA rings (every CSA layer's; ``ValueError`` if a
        ring is unbound or they differ: one ``ring_blocks`` table addresses them all)."""
        rings = {layer.csa_ring.layer_name: layer.csa_ring.rows_per_block for layer in self.layers if layer.kind == CSA}
        if not rings:
            return 1  # no CSA layer: the ring metadata is built with the others but never read
        return common_size("CSA ring rows_per_block", rings)

    @property
    def max_rollback(self) -> int | None:
        """The most positions a request's step may start before the furthest position its earlier steps fed
        (a verify step's rejected drafts), ``None`` without CSA layers (no limit).

        A region's closing token replays the 7 ring rows before its step, and the ring keeps ``capacity``
        rows: a step that went further than ``capacity - 7`` positions past the next step's start overwrote
        one of them. At least ``num_speculative_tokens`` (the layout's ``capacity >= 7 + k``); ``ValueError``
        when a ring is unbound or the rings differ (:func:`common_size`).
        """
        rings = {layer.csa_ring.layer_name: layer.csa_ring.capacity for layer in self.layers if layer.kind == CSA}
        if not rings:
            return None
        return common_size("CSA ring capacity", rings) - REPLAY_ROWS

    def build_metadata(self, buffers: StepBuffers, num_tokens: int) -> Step5StepMetadata:
        return build_step5_metadata(
            buffers,
            num_tokens,
            attn_block_size=self.attn_block_size,
            rows_per_block=self.rows_per_block,
            summary_block_size=self.summary_block_size,
        )

    def forward(self, hidden: torch.Tensor, buffers: StepBuffers) -> torch.Tensor:
        """``hidden [T, hidden_size]`` bf16 (the step's embeddings) -> ``[T, hidden_size]`` bf16."""
        check_step_hidden(hidden, self.config.hidden_size)
        metadata = self.build_metadata(buffers, hidden.shape[0])
        residual = hidden.float()
        for layer in self.layers:
            residual = layer(residual, metadata)
        return self.norm(residual.to(torch.bfloat16))


class Step5ForCausalLM(Step5Model):
    """:class:`Step5Model` with the token embedding and the output head: token ids in, logits out.

    As the reference's ``Step4ForCausalLM``: ``embed_tokens`` (bf16, ``[vocab_size, hidden]``) feeds the
    stack, and ``lm_head`` (bf16, no bias, not tied to the embedding) maps its output to bf16 logits. A
    :class:`~stepops.models.runner.StepRunner` built with ``inputs="tokens"`` runs it, ``generate`` included.
    """

    def __init__(
        self,
        config: Step5Config = Step5Config(),
        *,
        dtype: torch.dtype = torch.bfloat16,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config, dtype=dtype, process_group=process_group)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.built_dtypes = tensor_dtypes(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stack's output ``[T, hidden]`` -> ``[T, vocab_size]`` logits in the model's dtype."""
        return self.lm_head(hidden)

    def forward_tokens(self, token_ids: torch.Tensor, buffers: StepBuffers) -> torch.Tensor:
        """A whole step: ``token_ids [T]`` int64 -> logits ``[T, vocab_size]``."""
        return self.logits(self(self.embed_tokens(token_ids), buffers))

"""The Inkling text decoder (transformers 5.23.0's ``InklingForCausalLM``) on the stepops cache ops.

A step takes the step's flattened tokens (ids ``[T]`` int64, or hidden states ``[T, hidden]`` bf16) and
its :class:`InklingStepMetadata`; each decoder layer maps ``[T, hidden]`` to ``[T, hidden]``:

    h = RMSNorm(x);  q, [k|v], r = q_proj(h), kv_proj(h), r_proj(h)
    [k|v] = sconv_K+V([k|v])                         (short convs before the q/k norm, one launch)
    q, k = RMSNorm_q(q), RMSNorm_k(k) per head       (no rope: a relative position bias instead)
    bias[t, h, d] = r[t, h] . rel_proj[:, d] for backward distance 0 <= d < rel_extent, else 0
    global layers with log scaling: q, bias *= 1 + alpha log(max((pos + 1) / n_floor, 1))
    paged_kv_write(k, v);  softmax(q k / head_dim + bias) v over the causal (sliding-window) keys,
                           read from the paged cache in chunks (stepops.models.paged_attention)
    x = x + sconv_ATTN(o_proj(attn))
    x = x + sconv_MLP(MLP(RMSNorm(x)))               (dense SwiGLU, or sigmoid-routed experts + shared)

Sliding-window layers have their own geometry (``swa_num_heads``, ``swa_num_kv_heads``, ``swa_head_dim``)
and ``rel_extent = sliding_window``. The model: ``RMSNorm(embed(ids))`` -> layers -> ``RMSNorm`` ->
``lm_head(x / logits_mup_width_multiplier)`` -> the first ``unpadded_vocab_size`` logits.

Each short conv is ``stepops::sconv`` (width ``W``, its own residual, fp32, fp32 weights, rounded once) on
its stream's range of the layer's one conv-state cache (:class:`stepops.owners.InklingConvState`). The K and
V streams are adjacent in each head's ``D``, so transformers' ``k_proj``/``v_proj`` and their conv weights
are kept fused, rows per KV head ``[k_h | v_h]`` (:func:`fuse_kv`): one GEMM and one sconv launch serve
both. The conv weights are stored tap-major (stride 1 along channels), so each tap's weights of a Triton
program are one contiguous vector load; the
attention KV cache is a :class:`stepops.owners.PagedAttentionLayer`. Both follow the layer's own heads and
head size and are allocated and bound by :func:`stepops.allocator.allocate_kv_caches`.

Tensor parallel (a ``process_group`` of ``tp > 1`` ranks, :mod:`stepops.models.tensor_parallel`): q/k/v/r
and every MLP's gate/up (dense, each routed expert, each shared expert) are column-parallel (the rank's
heads and intermediate channels), ``o_proj`` and the downs row-parallel (partial sums over the full
hidden); the router, norms, embedding and head are replicated, so every rank routes every token the same
way. Both caches hold only the rank's KV heads; each output-stream conv runs on the rank's hidden shard:

    x = x + all_gather(sconv_ATTN(reduce_scatter(o_proj(attn))))     [T, hidden] -> [T, hidden/tp] -> back
    x = x + all_gather(sconv_MLP(reduce_scatter(mlp(...))))
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stepops.allocator import KVCaches, allocate_kv_caches
from stepops.layouts import InklingConvStateLayout, InklingStream
from stepops.models.dtypes import check_step_hidden, tensor_dtypes
from stepops.models.metadata import (
    InklingStepMetadata,
    StepBuffers,
    bound_size,
    bound_sizes,
    build_inkling_metadata,
)
from stepops.models.moe import small_step_max_tokens
from stepops.models.paged_attention import DEFAULT_KEYS_PER_CHUNK, paged_attention
from stepops.models.tensor_parallel import (
    ShardRule,
    TensorParallel,
    all_gather_hidden,
    reduce_scatter_hidden,
    shard_state_dict,
)
from stepops.ops.paged_kv_write import paged_kv_write
from stepops.owners import InklingConvState, PagedAttentionLayer
from stepops.specs import check_int, check_token_ids, is_int

SLIDING = "sliding"
GLOBAL = "global"
DENSE = "dense"
SPARSE = "sparse"


_FLOAT_MAX = sys.float_info.max  # an int that a float field takes must convert to a finite float


@dataclass(frozen=True)
class InklingConfig:
    """Inkling text-decoder numbers (``InklingTextConfig``'s, under the names below); the default is tiny.

    Global layers have ``num_heads`` / ``num_kv_heads`` / ``head_dim`` and ``rel_extent``; sliding-window
    layers ``swa_num_heads`` / ``swa_num_kv_heads`` / ``swa_head_dim`` and ``rel_extent = sliding_window``.
    ``mlp_layer_types`` ``None`` makes every layer sparse (transformers' default). ``block_size`` is the
    attention KV cache's declared block size (the allocator may enlarge it). ``num_speculative_tokens`` (k,
    not a transformers setting): a verify step's k + 1 tokens of a request share one read of each KV page.
    ``attention_keys_per_chunk`` (not a transformers setting either): the keys attention folds at a time
    (:func:`~stepops.models.paged_attention.paged_attention`'s ``keys_per_chunk``): the step's transient
    memory grows with it, and a global layer's compiled step unrolls ``context / it`` chunks (compile time,
    and a GPU's kernel launches, grow with that count).
    ``eos_token_ids``: the end-of-sequence ids a runner's ``generate`` stops at by default (transformers'
    ``eos_token_id``; none for a config built here).

    Checks: every int field is an int (``TypeError``), used or not; values (``ValueError``) only where the
    layer and MLP kinds in use read them, accepting what transformers builds and the conv-state cache holds.
    """

    vocab_size: int = 128
    unpadded_vocab_size: int | None = None
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    swa_num_heads: int = 4
    swa_num_kv_heads: int = 2
    swa_head_dim: int = 8
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    route_scale: float = 2.0
    conv_kernel_size: int = 4
    sliding_window: int = 16
    d_rel: int = 4
    rel_extent: int = 24
    log_scaling_n_floor: int | None = 8
    log_scaling_alpha: float = 0.1
    logits_mup_width_multiplier: float = 2.0
    rms_norm_eps: float = 1e-6
    block_size: int = 16
    num_speculative_tokens: int = 3
    attention_keys_per_chunk: int = DEFAULT_KEYS_PER_CHUNK
    layer_types: tuple[str, ...] = (SLIDING, GLOBAL)
    mlp_layer_types: tuple[str, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mlp_layer_types is None:
            object.__setattr__(self, "mlp_layer_types", (SPARSE,) * len(self.layer_types))
        if not self.layer_types:  # transformers runs one (embedding, norm, head); it has no cache to hold
            raise ValueError("layer_types must name at least one layer (num_hidden_layers >= 1)")
        if any(kind not in (SLIDING, GLOBAL) for kind in self.layer_types):
            raise ValueError(f"layer_types must be {SLIDING!r} or {GLOBAL!r}, got {self.layer_types}")
        if len(self.mlp_layer_types) != len(self.layer_types) or any(
            kind not in (DENSE, SPARSE) for kind in self.mlp_layer_types
        ):
            raise ValueError(
                f"mlp_layer_types must give {DENSE!r} or {SPARSE!r} for each of the {len(self.layer_types)} layers, "
                f"got {self.mlp_layer_types}"
            )
        # Every int field is an int, used or not, as transformers' strict InklingTextConfig requires (it refuses
        # a float, bool or str anywhere; stepops refuses enum members too): an int-valued float passes the value
        # checks below and fails later, mid-build or mid-step.
        for field in dataclasses.fields(self):
            value, optional = getattr(self, field.name), field.type == "int | None"
            if field.type in ("int", "int | None") and not (is_int(value) or optional and value is None):
                or_none = " or None" if optional else ""
                raise TypeError(f"{field.name} must be an int{or_none}, got {type(value).__name__}")
            # A float field given None or a string failed only in the first forward; NaN or inf never did.
            if field.type == "float":
                if type(value) not in (int, float):
                    raise TypeError(f"{field.name} must be a float, got {type(value).__name__}")
                if not (math.isfinite(value) if type(value) is float else abs(value) <= _FLOAT_MAX):
                    raise ValueError(f"{field.name} must be finite, got {value}")
        if self.logits_mup_width_multiplier == 0:
            raise ValueError("logits_mup_width_multiplier divides the logits: it must not be 0")
        # Values only for the layer and MLP kinds in use (transformers builds only those: an all-global model's
        # swa_* and sliding_window, or an all-sliding model's global geometry and rel_extent, are unused), and
        # at transformers' own minimums: it builds and runs zero-width relative states and MLPs.
        kinds = set(self.layer_types)
        minimums = dict(
            vocab_size=1, hidden_size=1, conv_kernel_size=1, block_size=1, d_rel=0, num_speculative_tokens=0,
            attention_keys_per_chunk=1,
        )
        if SLIDING in kinds:
            minimums.update(swa_num_heads=1, swa_num_kv_heads=1, swa_head_dim=1, sliding_window=1)
        if GLOBAL in kinds:
            minimums.update(num_heads=1, num_kv_heads=1, head_dim=1, rel_extent=1)
        if DENSE in self.mlp_layer_types:
            minimums.update(intermediate_size=0)
        if SPARSE in self.mlp_layer_types:  # top-k and shared experts are checked below
            minimums.update(moe_intermediate_size=0, n_routed_experts=1)
        for name, minimum in minimums.items():
            check_int(name, getattr(self, name), minimum)
        if not self.rms_norm_eps >= 0:
            raise ValueError(f"rms_norm_eps must be >= 0, got {self.rms_norm_eps}")
        if GLOBAL in kinds and self.log_scaling_n_floor == 0:  # a negative floor scales by 1, as in transformers
            raise ValueError("log_scaling_n_floor must be None (no log scaling) or nonzero, got 0 ((pos + 1) / 0)")
        for kind in (SLIDING, GLOBAL):
            heads, kv_heads, _ = self.attention_geometry(kind)
            if kind in kinds and heads % kv_heads:
                raise ValueError(f"{kind} layers: query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
        # k = 0 is transformers' too: every token gets only the shared experts.
        if SPARSE in self.mlp_layer_types and not 0 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 0..n_routed_experts ({self.n_routed_experts})"
            )
        if SPARSE in self.mlp_layer_types and self.n_shared_experts < 1:
            raise ValueError("sparse MLP layers need n_shared_experts >= 1 (the router's softmax includes them)")
        # transformers slices the logits only when unpadded_vocab_size < vocab_size (a larger one keeps them all).
        if self.unpadded_vocab_size is not None and self.unpadded_vocab_size < 1:
            raise ValueError(f"unpadded_vocab_size must be None or >= 1, got {self.unpadded_vocab_size}")
        check_token_ids("eos_token_ids", self.eos_token_ids, self.output_vocab_size)

    def attention_geometry(self, kind: str) -> tuple[int, int, int]:
        """``(query heads, KV heads, head_dim)`` of a ``kind`` (sliding or global) layer, all ranks."""
        if kind == SLIDING:
            return self.swa_num_heads, self.swa_num_kv_heads, self.swa_head_dim
        return self.num_heads, self.num_kv_heads, self.head_dim

    @property
    def output_vocab_size(self) -> int:
        """Logits per token: ``unpadded_vocab_size`` when the head is padded (smaller), else ``vocab_size``
        (transformers keeps every logit when ``unpadded_vocab_size >= vocab_size``)."""
        return min(self.unpadded_vocab_size or self.vocab_size, self.vocab_size)


def check_inkling_tp(config: InklingConfig, tp_size: int) -> None:
    """Raise ``ValueError`` unless ``config`` shards over ``tp_size`` ranks by whole KV heads.

    Every layer kind in use needs ``tp_size <= num_kv_heads``, ``num_kv_heads`` divisible by ``tp_size`` and,
    sharded, ``hidden_size`` by ``num_kv_heads`` (the conv-state layout's own errors); the intermediate sizes
    of the MLP kinds in use must divide by ``tp_size``.
    """
    for kind in sorted(set(config.layer_types)):
        _, kv_heads, head_dim = config.attention_geometry(kind)
        InklingConvStateLayout(
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            kernel_size=config.conv_kernel_size,
            tp_size=tp_size,
        )
    sizes = {DENSE: ("intermediate_size", config.intermediate_size)}
    sizes[SPARSE] = ("moe_intermediate_size", config.moe_intermediate_size)
    for kind in sorted(set(config.mlp_layer_types)):
        name, size = sizes[kind]
        if size % tp_size:
            raise ValueError(f"{name} ({size}) must be divisible by the tensor-parallel size ({tp_size})")


class InklingRMSNorm(nn.Module):
    """transformers' ``InklingRMSNorm``: normalise in fp32, round to ``x.dtype``, then ``weight *`` in the
    weight's dtype (the order matters in bf16: one more rounding than scaling in fp32 and rounding once)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


def _conv_weight(channels: int, kernel_size: int) -> nn.Parameter:
    """An fp32 ``[channels, W]`` conv weight stored tap-major: loading a state dict copies into it, and
    ``.to()`` preserves its strides."""
    return nn.Parameter((torch.randn(kernel_size, channels, dtype=torch.float32) * 0.3).t())


def fuse_kv(k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """K rows and V rows ``[H * hd, ...]`` each -> ``[2 * H * hd, ...]`` with rows per head ``[k_h | v_h]``:
    the layout of ``kv_proj.weight`` and ``conv_kv`` (transformers' ``k_proj``/``v_proj`` and their convs)."""
    return torch.stack([k.unflatten(0, (num_kv_heads, -1)), v.unflatten(0, (num_kv_heads, -1))], 1).flatten(0, 2)


def split_kv(kv: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_kv`: ``(k, v)`` rows (views)."""
    per_head = kv.unflatten(0, (num_kv_heads, 2, -1))
    return per_head[:, 0].flatten(0, 1), per_head[:, 1].flatten(0, 1)


def _randn(*shape: int, dtype: torch.dtype, std: float = 0.02) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, dtype=torch.float32).mul_(std).to(dtype))


class InklingMLP(nn.Module):
    """Dense SwiGLU ``down(silu(gate(x)) * up(x)) * global_scale`` (``intermediate`` = this rank's share)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate, dtype)
        self.up_proj = _linear(hidden, intermediate, dtype)
        self.down_proj = _linear(intermediate, hidden, dtype)
        self.global_scale = nn.Parameter(torch.ones(1, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) * self.global_scale


class InklingRouter(nn.Module):
    """Sigmoid router over ``E`` routed + ``S`` shared experts, in fp32 (transformers' ``InklingTopkRouter``).

    ``x [T, hidden]`` -> ``weights [T, E]`` in ``x.dtype`` (the chosen top-k experts' weights, 0 for the
    others) and ``shared_gammas [T, S]``. The top-k is chosen on ``sigmoid(logit) + e_score_correction_bias``;
    the chosen and shared experts' weights are a softmax of their ``logsigmoid(logit)`` times
    ``route_scale * global_scale``. Static shapes: a dense ``[T, E]`` weight table, no token lists.
    """

    def __init__(self, config: InklingConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.num_experts, self.top_k = c.n_routed_experts, c.num_experts_per_tok
        self.route_scale = c.route_scale
        self.weight = _randn(c.n_routed_experts + c.n_shared_experts, c.hidden_size, dtype=dtype)
        # fp32 whatever the model's dtype (transformers keeps both in fp32).
        self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, gammas, _ = self.route(x)
        return weights, gammas

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` and the chosen expert ids ``[T, k]`` int64, in ``topk(sorted=False)``'s order (which
        is the kernel's, not ascending and not by score; only the order logsumexp sums in depends on it)."""
        logits = F.linear(x.float(), self.weight.float())
        routed_logits, shared_logits = logits[:, : self.num_experts], logits[:, self.num_experts :]
        choice = logits.sigmoid()[:, : self.num_experts] + self.e_score_correction_bias.float()
        # sorted=False as transformers does: the order of the k entries is the order logsumexp sums them in.
        chosen = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        log_probs = F.logsigmoid(torch.cat([routed_logits.gather(-1, chosen), shared_logits], dim=-1))
        probs = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        probs = (probs * self.route_scale * self.global_scale.float()).to(x.dtype)
        weights = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        weights = weights.scatter(1, chosen, probs[:, : self.top_k])
        return weights, probs[:, self.top_k :], chosen


class InklingMoE(nn.Module):
    """Sparse MLP: routed experts (weighted by the router) + shared experts (weighted by their gammas).

    Each token's chosen routed experts: each output times its router weight in ``x.dtype``, summed in fp32
    (in ascending expert id order, only where the weight is not 0) and rounded once to ``x.dtype``, as
    transformers' default experts implementation (``grouped_mm``: a ``.sum`` over the top-k products) and
    fused MoE kernels do. Its eager loop instead adds into ``x.dtype``, rounding after each expert: one ulp
    apart on some outputs from top-k 3 on. Two paths with these semantics, picked by the step's token
    count ``T`` (a static shape: fixed in a CUDA graph, and the runner compiles one graph per side of the
    threshold, see :meth:`small_step_max_tokens`), neither with a host sync or a data-dependent shape:

    - ``T * top_k < n_routed_experts`` (decode and verify steps of real models): only the chosen experts
      run. Their weights are gathered per (token, slot), ``[T, k, 2I, hidden]`` and ``[T, k, hidden, I]``,
      and run as batched matrix-vector products; slots are sorted by expert id for the sum.
    - otherwise every expert runs on every token, in ascending expert order (``E / k`` times the routed
      work, but no weight is read twice); a grouped-GEMM kernel is the scalable version of this.

    The two differ only where a GEMM's blocking depends on its row count (1 row per (token, slot) against
    ``T`` rows per expert): in bf16 on CPU they were bitwise equal (tests/models/test_moe_small_step.py); in
    fp32 a few ulps of a dot product, which the transformers oracle's ``FP32_LAYER`` already allows for.
    ``intermediate`` is this rank's share of ``moe_intermediate_size`` (tensor parallel: each rank gathers
    its own shard of the chosen experts; the router is replicated, so every rank takes the same path).
    """

    def __init__(self, config: InklingConfig, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.gate = InklingRouter(c, dtype)
        self.experts_gate_up = _randn(c.n_routed_experts, 2 * intermediate, c.hidden_size, dtype=dtype)
        self.experts_down = _randn(c.n_routed_experts, c.hidden_size, intermediate, dtype=dtype)
        self.shared_gate = _randn(c.n_shared_experts, intermediate, c.hidden_size, dtype=dtype)
        self.shared_up = _randn(c.n_shared_experts, intermediate, c.hidden_size, dtype=dtype)
        self.shared_down = _randn(c.n_shared_experts, c.hidden_size, intermediate, dtype=dtype)

    @property
    def small_step_max_tokens(self) -> int:
        """The largest token count that runs only the chosen experts (``T * top_k < n_routed_experts``)."""
        return small_step_max_tokens(self.gate.num_experts, self.gate.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, gammas, chosen = self.gate.route(x)
        if x.shape[0] <= self.small_step_max_tokens:
            routed = self.chosen_experts(x, weights, chosen)
        else:
            routed = self.all_experts(x, weights)
        return routed + self._shared(x, gammas)

    def all_experts(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed output ``[T, hidden]``: every expert on every token, added in expert order where chosen."""
        routed = torch.zeros_like(x, dtype=_accumulation_dtype(x))
        for expert in range(self.experts_gate_up.shape[0]):
            gate, up = F.linear(x, self.experts_gate_up[expert]).chunk(2, dim=-1)
            out = F.linear(F.silu(gate) * up, self.experts_down[expert]) * weights[:, expert, None]
            routed = torch.where(weights[:, expert, None] != 0, routed + out.to(routed.dtype), routed)
        return routed.to(x.dtype)

    def chosen_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Routed output ``[T, hidden]``: only the ``chosen [T, k]`` experts, added in ascending id order."""
        num_tokens, top_k = chosen.shape
        ids = chosen.sort(dim=-1).values  # topk(sorted=False) gives no id order; the sum needs ascending ids
        slot_weights = weights.gather(1, ids)  # [T, k], x.dtype, as the dense table holds them
        flat = ids.flatten()
        gate_up = self.experts_gate_up.index_select(0, flat).view(num_tokens, top_k, *self.experts_gate_up.shape[1:])
        down = self.experts_down.index_select(0, flat).view(num_tokens, top_k, *self.experts_down.shape[1:])
        # One row per (token, slot): [T, k, 1, hidden] @ [T, k, hidden, 2I], the row-times-W^T of F.linear.
        gate, up = (x[:, None, None, :] @ gate_up.transpose(-1, -2)).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ down.transpose(-1, -2)  # [T, k, 1, hidden]
        out = out[:, :, 0] * slot_weights[:, :, None]
        routed = torch.zeros_like(x, dtype=_accumulation_dtype(x))
        for slot in range(top_k):
            routed = torch.where(slot_weights[:, slot, None] != 0, routed + out[:, slot].to(routed.dtype), routed)
        return routed.to(x.dtype)

    def _shared(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        """Shared experts as one batched matmul each, summed in fp32 (transformers' order)."""
        stacked = x[None].expand(self.shared_gate.shape[0], -1, -1)
        gate = torch.bmm(stacked, self.shared_gate.transpose(1, 2))
        up = torch.bmm(stacked, self.shared_up.transpose(1, 2))
        down = torch.bmm(F.silu(gate) * up * gammas.t()[:, :, None], self.shared_down.transpose(1, 2))
        return down.to(_accumulation_dtype(x)).sum(0).to(x.dtype)


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """Where the MoE sums its experts: fp32 for bf16/fp16/fp32 activations (as transformers' ``.sum`` of
    bf16 does), fp64 for fp64 ones."""
    return torch.promote_types(x.dtype, torch.float32)


def log_scaling(position: torch.Tensor, n_floor: int, alpha: float) -> torch.Tensor:
    """``[T]`` fp32 ``1 + alpha * log(max((position + 1) / n_floor, 1))``: the global layers' query and bias
    scale (transformers computes it in fp32 from the query's absolute position)."""
    return 1.0 + alpha * torch.log(((position.long() + 1).float() / n_floor).clamp(min=1.0))


class InklingDecoderLayer(nn.Module):
    """One Inkling decoder layer; ``config.layer_types[layer_index]`` picks sliding-window or global
    (and its geometry), ``config.mlp_layer_types[layer_index]`` a dense or a sparse MLP.

    Registers ``{prefix}.attn`` (paged KV cache) and ``{prefix}.conv_state`` (the four conv streams) in
    ``static_forward_context``. Parameters are ``dtype`` except the four conv weights ``[channels, W]`` and
    the router's ``global_scale`` / ``e_score_correction_bias``, which stay fp32. The step needs
    ``dtype=torch.bfloat16`` (the caches are bf16); other dtypes serve the no-cache recompute. Run under
    ``torch.inference_mode()``.

    ``process_group``: ``None`` or a group of one is the unsharded layer. With ``tp > 1`` ranks, this rank
    holds its share of query/KV heads (its caches hold only those), of the MLP's intermediate channels and
    ``hidden / tp`` channels of the output streams; load a shard from :func:`shard_inkling_state_dict`.
    ``ValueError`` (before anything is registered) when the config does not shard by whole KV heads.
    """

    def __init__(
        self,
        config: InklingConfig,
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
        self.tp = tp = TensorParallel.from_group(process_group)
        check_inkling_tp(c, tp.size)
        self.kind = c.layer_types[layer_index]
        self.mlp_kind = c.mlp_layer_types[layer_index]
        prefix = prefix or f"layers.{layer_index}"
        heads, kv_heads, self.head_dim = c.attention_geometry(self.kind)
        self.sliding_window = c.sliding_window if self.kind == SLIDING else None
        self.rel_extent = c.sliding_window if self.kind == SLIDING else c.rel_extent
        self.log_scaling = self.kind == GLOBAL and c.log_scaling_n_floor is not None
        # This rank's share; the whole model when tp = 1.
        self.num_heads, self.num_kv_heads = heads // tp.size, kv_heads // tp.size
        kv_width = self.num_kv_heads * self.head_dim
        local_hidden = c.hidden_size // tp.size
        self.input_norm = InklingRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.q_proj = _linear(c.hidden_size, self.num_heads * self.head_dim, dtype)
        self.kv_proj = _linear(c.hidden_size, 2 * kv_width, dtype)  # rows per KV head: [k_h | v_h]
        self.r_proj = _linear(c.hidden_size, self.num_heads * c.d_rel, dtype)
        self.rel_proj = _randn(c.d_rel, self.rel_extent, dtype=dtype)
        self.q_norm = InklingRMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.k_norm = InklingRMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.o_proj = _linear(self.num_heads * self.head_dim, c.hidden_size, dtype)
        self.post_norm = InklingRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if self.mlp_kind == SPARSE:
            self.mlp: nn.Module = InklingMoE(c, c.moe_intermediate_size // tp.size, dtype)
        else:
            self.mlp = InklingMLP(c.hidden_size, c.intermediate_size // tp.size, dtype)
        # Depthwise conv weights [channels, W] (nn.Conv1d's [C, 1, W] squeezed), fp32, stored tap-major; K and
        # V fused like kv_proj.
        w = c.conv_kernel_size
        self.conv_kv = _conv_weight(2 * kv_width, w)
        self.conv_attn = _conv_weight(local_hidden, w)
        self.conv_mlp = _conv_weight(local_hidden, w)
        self.attn = PagedAttentionLayer(
            prefix=f"{prefix}.attn",
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            block_size=c.block_size,
            static_forward_context=static_forward_context,
            sliding_window=self.sliding_window,
        )
        self.conv_state = InklingConvState(
            num_kv_heads=kv_heads,
            head_dim=self.head_dim,
            hidden_size=c.hidden_size,
            kernel_size=c.conv_kernel_size,
            prefix=f"{prefix}.conv_state",
            static_forward_context=static_forward_context,
            tp_size=tp.size,
        )

    def relative_bias_table(self, h: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """``[T, Hq, rel_extent]``: each token's bias by backward distance ``0..rel_extent-1`` (log-scaled on
        global layers). Attention adds entry ``d`` to the score of the key ``d`` positions back."""
        r = self.r_proj(h).view(h.shape[0], self.num_heads, self.config.d_rel)
        table = r @ self.rel_proj
        if self.log_scaling:
            tau = log_scaling(position, self.config.log_scaling_n_floor, self.config.log_scaling_alpha)
            table = (table.float() * tau[:, None, None]).to(table.dtype)
        return table

    def scaled_query(self, q: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The normed query ``[T, Hq, D]``, log-scaled on global layers (in fp32, rounded once)."""
        if not self.log_scaling:
            return q
        tau = log_scaling(position, self.config.log_scaling_n_floor, self.config.log_scaling_alpha)
        return (q.float() * tau[:, None, None]).to(q.dtype)

    def forward(self, hidden: torch.Tensor, metadata: InklingStepMetadata) -> torch.Tensor:
        """``hidden [T, hidden_size]`` bf16 -> ``[T, hidden_size]`` bf16; writes this layer's caches."""
        num_tokens, head_dim = hidden.shape[0], self.head_dim
        position = metadata.token.position
        conv, table, sconv_meta = self.conv_state.conv, metadata.conv_block_table, metadata.sconv
        h = self.input_norm(hidden)
        q = self.q_proj(h).view(num_tokens, self.num_heads, head_dim)
        kv = conv((InklingStream.K, InklingStream.V), self.kv_proj(h), self.conv_kv, table, sconv_meta)
        kv = kv.view(num_tokens, self.num_kv_heads, 2, head_dim)
        q = self.scaled_query(self.q_norm(q), position)
        k, v = self.k_norm(kv[:, :, 0]), kv[:, :, 1]
        kv_cache = self.attn.kv_cache
        paged_kv_write(k, v, kv_cache[..., :head_dim], kv_cache[..., head_dim:], metadata.attn_slot_mapping)
        attn = paged_attention(
            q,
            kv_cache,
            metadata.attn_block_table,
            metadata.token,
            scale=1.0 / head_dim,  # q and k are RMS-normed per head: 1/d, not 1/sqrt(d)
            sliding_window=self.sliding_window,
            distance_bias=self.relative_bias_table(h, position),
            query_tile=self.config.num_speculative_tokens + 1,
            keys_per_chunk=self.config.attention_keys_per_chunk,
        )
        attn_out = self.o_proj(attn.flatten(1))
        hidden = hidden + self._output_conv(InklingStream.ATTN_OUT, attn_out, self.conv_attn, metadata)
        mlp = self.mlp(self.post_norm(hidden))
        return hidden + self._output_conv(InklingStream.MLP_OUT, mlp, self.conv_mlp, metadata)

    def _output_conv(
        self, stream: InklingStream, out: torch.Tensor, weight: torch.Tensor, metadata: InklingStepMetadata
    ) -> torch.Tensor:
        """A sublayer output ``[T, hidden]`` (a partial sum when sharded) through its stream's short conv.

        Sharded, the conv runs on this rank's hidden channels between a reduce-scatter (which completes
        the sum) and an all-gather; the channels are those of the rank's cache heads' stream ranges.
        """
        conv, table, sconv_meta = self.conv_state.conv, metadata.conv_block_table, metadata.sconv
        if self.tp.size == 1:
            # KV heads that do not divide hidden: zero channels fill the last head's chunk (their output is 0).
            pad = self.conv_state.layout.hidden_padding
            if pad:
                padded = conv(stream, F.pad(out, (0, pad)), F.pad(weight, (0, 0, 0, pad)), table, sconv_meta)
                return padded[:, : out.shape[1]]
            return conv(stream, out, weight, table, sconv_meta)
        shard = conv(stream, reduce_scatter_hidden(out, self.tp), weight, table, sconv_meta)
        return all_gather_hidden(shard, self.tp)


class InklingModel(nn.Module):
    """The Inkling text decoder: normed embedding, :class:`InklingDecoderLayer` stack, final norm, head.

    ``forward(hidden, buffers)`` runs the decoder stack on hidden states (``[T, hidden]``, no embedding or
    final norm); :meth:`forward_tokens` runs a whole step from token ids to logits. Load a transformers
    checkpoint with :func:`stepops.models.inkling_checkpoint.load_inkling`. ``process_group`` shards every
    layer over its ranks; load a shard from :func:`shard_inkling_state_dict`. Inputs and outputs are
    replicated: every rank passes the same step and gets the same result.
    """

    def __init__(
        self,
        config: InklingConfig = InklingConfig(),
        *,
        dtype: torch.dtype = torch.bfloat16,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = c = config
        self.static_forward_context: dict[str, Any] = {}
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.embed_norm = InklingRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(
            InklingDecoderLayer(c, i, static_forward_context=self.static_forward_context, dtype=dtype, process_group=process_group)
            for i in range(len(c.layer_types))
        )
        self.norm = InklingRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = _linear(c.hidden_size, c.vocab_size, dtype)
        self.dtype = dtype
        self.built_dtypes = tensor_dtypes(self)
        self.cache_generation = 0  # how many times allocate_caches has bound new caches

    def allocate_caches(self, num_blocks: int, device: torch.device | str) -> KVCaches:
        """Allocate and bind every layer's own KV cache and conv-state cache (``num_blocks`` blocks each)."""
        caches = allocate_kv_caches(self.static_forward_context, num_blocks, device=device)
        self.cache_generation += 1
        return caches

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every cache a step writes, one tensor per cache (to compare two models' caches)."""
        return [t for layer in self.layers for t in (layer.attn.kv_cache, layer.conv_state.kv_cache)]

    def mutated_tensors(self) -> list[torch.Tensor]:
        """Every tensor object a step writes through (the ops receive the caches themselves or views made
        inside the step): here the same as :meth:`cache_tensors`. Mark these static before reduce-overhead."""
        return self.cache_tensors()

    def _conv_block_sizes(self) -> list[int]:
        """Each layer's bound conv-state block size ``N``."""
        conv = {layer.conv_state.prefix: bound_size(layer.conv_state.kv_cache, 2) for layer in self.layers}
        return bound_sizes("conv-state block size", conv)

    def _block_sizes(self) -> list[tuple[int, int]]:
        """Each layer's bound ``(attention N, conv-state N)``."""
        attn = {layer.attn.layer_name: bound_size(layer.attn.kv_cache, 1) for layer in self.layers}
        return list(zip(bound_sizes("attention block size", attn), self._conv_block_sizes()))

    @property
    def attn_block_size(self) -> int:
        """The smallest bound attention block size: block tables need ``ceil(len / N)`` columns for it.

        Layers may differ (the allocator scales each layer's block to the common page); they share one
        block table, each reading it with its own ``N`` (each layer owns its cache, so ids do not clash).
        """
        return min(attn for attn, _ in self._block_sizes())

    @property
    def conv_block_size(self) -> int:
        """The smallest bound conv-state block size ``N`` (as :attr:`attn_block_size`)."""
        return min(self._conv_block_sizes())

    def forward(self, hidden: torch.Tensor, buffers: StepBuffers) -> torch.Tensor:
        """The decoder stack on ``hidden [T, hidden]`` bf16 (the embedding's output) -> ``[T, hidden]``."""
        check_step_hidden(hidden, self.config.hidden_size)
        metadata: dict[tuple[int, int], InklingStepMetadata] = {}
        for layer, (attn_n, conv_n) in zip(self.layers, self._block_sizes()):
            if (attn_n, conv_n) not in metadata:
                metadata[attn_n, conv_n] = build_inkling_metadata(
                    buffers, hidden.shape[0], attn_block_size=attn_n, conv_block_size=conv_n
                )
            hidden = layer(hidden, metadata[attn_n, conv_n])
        return hidden

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [T]`` -> ``RMSNorm(embedding)`` ``[T, hidden]`` (padding ids may be any valid id)."""
        return self.embed_norm(self.embed_tokens(token_ids))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stack's output ``[T, hidden]`` -> ``[T, output_vocab_size]`` logits in the model's dtype."""
        logits = self.lm_head(self.norm(hidden) / self.config.logits_mup_width_multiplier)
        return logits[:, : self.config.output_vocab_size]

    def forward_tokens(self, token_ids: torch.Tensor, buffers: StepBuffers) -> torch.Tensor:
        """A whole step: ``token_ids [T]`` int64 -> logits ``[T, output_vocab_size]``."""
        return self.logits(self(self.embed(token_ids), buffers))


# How each Inkling parameter shards, by its name inside a layer (model-level names are replicated):
# ShardRule(dim, parts) splits each of ``parts`` equal chunks along ``dim`` into tp slices.
_LAYER_SHARDING: dict[str, ShardRule] = {
    "q_proj.weight": ShardRule(0),
    "kv_proj.weight": ShardRule(0),  # whole heads of [k_h | v_h] rows
    "r_proj.weight": ShardRule(0),
    "conv_kv": ShardRule(0),
    "conv_attn": ShardRule(0),
    "conv_mlp": ShardRule(0),
    "o_proj.weight": ShardRule(1),
    "mlp.gate_proj.weight": ShardRule(0),
    "mlp.up_proj.weight": ShardRule(0),
    "mlp.down_proj.weight": ShardRule(1),
    "mlp.experts_gate_up": ShardRule(1, parts=2),
    "mlp.experts_down": ShardRule(2),
    "mlp.shared_gate": ShardRule(1),
    "mlp.shared_up": ShardRule(1),
    "mlp.shared_down": ShardRule(2),
}
_REPLICATED_IN_LAYER = (
    "input_norm.weight",
    "post_norm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "rel_proj",
    "mlp.global_scale",
    "mlp.gate.weight",
    "mlp.gate.global_scale",
    "mlp.gate.e_score_correction_bias",
)
_REPLICATED_IN_MODEL = ("embed_tokens.weight", "embed_norm.weight", "norm.weight", "lm_head.weight")


_MODEL_LAYER_KEY = re.compile(r"layers\.\d+\.(.+)")


def inkling_sharding(keys: list[str] | Mapping[str, Any]) -> dict[str, ShardRule | None]:
    """Each key of an Inkling model (``layers.N.q_proj.weight``, ``lm_head.weight``) or layer
    (``q_proj.weight``) state dict -> its :class:`ShardRule`, ``None`` when replicated; ``ValueError`` for a
    key with no rule (a new parameter must say how it shards, not be replicated by accident)."""
    rules: dict[str, ShardRule | None] = {}
    for key in keys:
        layer_key = _MODEL_LAYER_KEY.fullmatch(key)
        name = layer_key.group(1) if layer_key else key
        if name in _LAYER_SHARDING:
            rules[key] = _LAYER_SHARDING[name]
        elif name in _REPLICATED_IN_LAYER or (name == key and key in _REPLICATED_IN_MODEL):
            rules[key] = None
        else:
            raise ValueError(f"shard_inkling_state_dict: no sharding rule for {key!r}")
    return rules


def shard_inkling_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: InklingConfig, *, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Slice a full (tp = 1) Inkling model or layer state dict into rank ``tp_rank``'s shard of ``tp_size``.

    Keys keep their names; values are contiguous copies of the rank's slice (see :data:`_LAYER_SHARDING`:
    projections by the rank's heads' rows or input columns, the MLPs' and experts' intermediate channels,
    the output-stream conv weights by hidden rows; norms, router, embedding and head whole). Loading the
    result into a model built with a ``tp_size`` group makes it compute the full model's function.
    ``ValueError`` for a config that does not shard (:func:`check_inkling_tp`), a bad rank, or an unknown key.
    """
    check_inkling_tp(config, tp_size)
    return shard_state_dict(state_dict, inkling_sharding(state_dict), tp_rank=tp_rank, tp_size=tp_size)

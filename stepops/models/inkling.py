"""Inkling decoder layers on the stepops cache ops.

A layer step takes the step's flattened hidden states ``[T, hidden]`` bf16 and its
:class:`InklingStepMetadata` and returns ``[T, hidden]``:

    h = RMSNorm(x);  q, k, v = q_proj(h), k_proj(h), v_proj(h)
    k = sconv_K(k);  v = sconv_V(v)                  (short convs before the q/k norm)
    q, k = RMSNorm_q(q), RMSNorm_k(k) per head;  rope(q, k)
    paged_kv_write(k, v -> this layer's KV cache);  GQA attention, causal, sliding-window or global
    x = x + sconv_ATTN(o_proj(attn))
    x = x + sconv_MLP(SwiGLU(RMSNorm(x)))

Each short conv is ``stepops::sconv`` (width ``W``, its own residual, fp32, rounded once) on its stream's
range of the layer's one conv-state cache (:class:`stepops.owners.InklingConvState`); the attention KV
cache is a :class:`stepops.owners.PagedAttentionLayer`. Both are allocated and bound by
:func:`stepops.allocator.allocate_kv_caches`.

Tensor parallel (a ``process_group`` of ``tp > 1`` ranks, :mod:`stepops.models.tensor_parallel`): q/k/v
and the MLP's gate/up are column-parallel (the rank's heads and intermediate channels), ``o_proj`` and the
MLP's down row-parallel (partial sums over the full hidden); both caches hold only the rank's KV heads.
The K/V convs run on the rank's heads; each output-stream conv runs on the rank's hidden shard:

    x = x + all_gather(sconv_ATTN(reduce_scatter(o_proj(attn))))     [T, hidden] -> [T, hidden/tp] -> back
    x = x + all_gather(sconv_MLP(reduce_scatter(down(...))))
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepops.allocator import KVCaches, allocate_kv_caches
from stepops.layouts import InklingStream
from stepops.models.layers import RMSNorm, SwiGLU, gather_paged_keys, masked_attention, rope_neox
from stepops.models.metadata import (
    InklingStepMetadata,
    StepBuffers,
    bound_size,
    build_inkling_metadata,
    common_attn_block_size,
    common_size,
)
from stepops.models.tensor_parallel import TensorParallel, all_gather_hidden, check_inkling_tp, reduce_scatter_hidden
from stepops.ops.paged_kv_write import paged_kv_write
from stepops.owners import InklingConvState, PagedAttentionLayer

SLIDING = "sliding"
GLOBAL = "global"


@dataclass(frozen=True)
class InklingConfig:
    """Inkling decoder numbers; the default is tiny (CPU tests)."""

    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    conv_kernel_size: int = 4
    sliding_window: int = 16
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    layer_types: tuple[str, ...] = field(default=(SLIDING, GLOBAL))

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_size % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must split over num_kv_heads ({self.num_kv_heads})")
        if any(kind not in (SLIDING, GLOBAL) for kind in self.layer_types):
            raise ValueError(f"layer_types must be {SLIDING!r} or {GLOBAL!r}, got {self.layer_types}")


class InklingDecoderLayer(nn.Module):
    """One Inkling decoder layer; ``config.layer_types[layer_index]`` picks sliding-window or global.

    Registers ``{prefix}.attn`` (paged KV cache) and ``{prefix}.conv_state`` (the four conv streams) in
    ``static_forward_context``. Run under ``torch.inference_mode()``.

    ``process_group``: ``None`` or a group of one is the unsharded layer. With ``tp > 1`` ranks, this rank
    holds ``num_heads / tp`` query heads, ``num_kv_heads / tp`` KV heads (its caches hold only those) and
    ``hidden / tp`` channels of the output streams, and its parameters have the shapes of
    :func:`~stepops.models.tensor_parallel.shard_inkling_state_dict`'s shard (load one: random
    initialisation differs per rank). ``ValueError`` (before anything is registered) when the config does
    not shard by whole KV heads, e.g. ``tp > num_kv_heads``.
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
        prefix = prefix or f"layers.{layer_index}"
        # This rank's share; the whole model when tp = 1.
        self.num_heads = c.num_heads // tp.size
        self.num_kv_heads = c.num_kv_heads // tp.size
        kv_width = self.num_kv_heads * c.head_dim
        local_hidden = c.hidden_size // tp.size
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * c.head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, kv_width, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, kv_width, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.o_proj = nn.Linear(self.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size // tp.size).to(dtype)
        # Depthwise conv weights [channels, W] (nn.Conv1d's [C, 1, W] squeezed), one per stream.
        w = c.conv_kernel_size
        self.conv_k = nn.Parameter(torch.randn(kv_width, w, dtype=dtype) * 0.3)
        self.conv_v = nn.Parameter(torch.randn(kv_width, w, dtype=dtype) * 0.3)
        self.conv_attn = nn.Parameter(torch.randn(local_hidden, w, dtype=dtype) * 0.3)
        self.conv_mlp = nn.Parameter(torch.randn(local_hidden, w, dtype=dtype) * 0.3)
        self.attn = PagedAttentionLayer(
            prefix=f"{prefix}.attn",
            num_kv_heads=self.num_kv_heads,
            head_size=c.head_dim,
            block_size=c.block_size,
            static_forward_context=static_forward_context,
            sliding_window=c.sliding_window if self.kind == SLIDING else None,
        )
        self.conv_state = InklingConvState(
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            hidden_size=c.hidden_size,
            kernel_size=c.conv_kernel_size,
            prefix=f"{prefix}.conv_state",
            static_forward_context=static_forward_context,
            tp_size=tp.size,
        )

    def forward(self, hidden: torch.Tensor, metadata: InklingStepMetadata) -> torch.Tensor:
        """``hidden [T, hidden_size]`` bf16 -> ``[T, hidden_size]`` bf16; writes this layer's caches."""
        c = self.config
        num_tokens = hidden.shape[0]
        position = metadata.token.position
        conv, table, sconv_meta = self.conv_state.conv, metadata.conv_block_table, metadata.sconv
        h = self.input_norm(hidden)
        q = self.q_proj(h).view(num_tokens, self.num_heads, c.head_dim)
        k = conv(InklingStream.K, self.k_proj(h), self.conv_k, table, sconv_meta)
        v = conv(InklingStream.V, self.v_proj(h), self.conv_v, table, sconv_meta)
        q = rope_neox(self.q_norm(q), position, c.head_dim, c.rope_theta)
        k = k.view(num_tokens, self.num_kv_heads, c.head_dim)
        k = rope_neox(self.k_norm(k), position, c.head_dim, c.rope_theta)
        v = v.view(num_tokens, self.num_kv_heads, c.head_dim)
        kv_cache = self.attn.kv_cache
        paged_kv_write(k, v, kv_cache[..., : c.head_dim], kv_cache[..., c.head_dim :], metadata.attn_slot_mapping)
        keys = gather_paged_keys(kv_cache, c.head_dim, metadata.attn_block_table, metadata.token)
        allowed = keys.causal
        if self.kind == SLIDING:
            key_position = torch.arange(allowed.shape[1], device=hidden.device)
            allowed = allowed & (key_position[None, :] > position.long()[:, None] - c.sliding_window)
        attn = masked_attention(q, keys.key, keys.value, allowed, c.head_dim**-0.5)
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
            return conv(stream, out, weight, table, sconv_meta)
        shard = conv(stream, reduce_scatter_hidden(out, self.tp), weight, table, sconv_meta)
        return all_gather_hidden(shard, self.tp)


class InklingModel(nn.Module):
    """A stack of :class:`InklingDecoderLayer` with its forward context (the layers' cache owners).

    ``process_group`` shards every layer over its ranks (see :class:`InklingDecoderLayer`); load a shard
    from :func:`~stepops.models.tensor_parallel.shard_inkling_state_dict`. Inputs and outputs ``[T, hidden]``
    are replicated: every rank passes the same step and gets the same result.
    """

    def __init__(
        self,
        config: InklingConfig = InklingConfig(),
        *,
        dtype: torch.dtype = torch.bfloat16,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.static_forward_context: dict[str, Any] = {}
        self.layers = nn.ModuleList(
            InklingDecoderLayer(
                config, i, static_forward_context=self.static_forward_context, dtype=dtype, process_group=process_group
            )
            for i in range(len(config.layer_types))
        )

    def allocate_caches(self, num_blocks: int, device: torch.device | str) -> KVCaches:
        """Allocate and bind every layer's own KV cache and conv-state cache (``num_blocks`` blocks each)."""
        return allocate_kv_caches(self.static_forward_context, num_blocks, device=device)

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every cache a step writes, one tensor per cache (to compare two models' caches)."""
        return [t for layer in self.layers for t in (layer.attn.kv_cache, layer.conv_state.kv_cache)]

    def mutated_tensors(self) -> list[torch.Tensor]:
        """Every tensor object a step writes through (the ops receive the caches themselves or views made
        inside the step): here the same as :meth:`cache_tensors`. Mark these static before reduce-overhead."""
        return self.cache_tensors()

    @property
    def attn_block_size(self) -> int:
        """Tokens per block of the bound KV caches (every layer's; ``ValueError`` if unbound or unequal)."""
        return common_attn_block_size(self.layers)

    @property
    def conv_block_size(self) -> int:
        """Tokens per block ``N`` of the bound conv-state caches (every layer's, as above)."""
        return common_size(
            "conv-state block size",
            {layer.conv_state.prefix: bound_size(layer.conv_state.kv_cache, 2) for layer in self.layers},
        )

    def build_metadata(self, buffers: StepBuffers, num_tokens: int) -> InklingStepMetadata:
        return build_inkling_metadata(
            buffers, num_tokens, attn_block_size=self.attn_block_size, conv_block_size=self.conv_block_size
        )

    def forward(self, hidden: torch.Tensor, buffers: StepBuffers) -> torch.Tensor:
        metadata = self.build_metadata(buffers, hidden.shape[0])
        for layer in self.layers:
            hidden = layer(hidden, metadata)
        return hidden

"""Step5 decoder layers on the stepops cache ops: sliding-window layers and CSA layers.

A layer step takes the step's flattened hidden states ``[T, hidden]`` bf16 (prefill chunks, decode and
verify tokens of many requests, padding last) and its :class:`Step5StepMetadata`, and returns ``[T, hidden]``:

    h = RMSNorm(x);  q, k, v = proj(h);  rope(q, k)
    paged_kv_write(k, v -> this layer's KV cache)
    sliding layer: each token attends to the last ``sliding_window`` positions (causal)
    CSA layer:     indexer  iq = rope32(ZeroCentredRMSNorm(Wq h)) [T, Hi, 256]
                            ik = rope32(LayerNorm(Wk h)) [T, 256],  iz = Wz h [T, 256],  w = Ww h (fp32) [T, Hi]
                   csa_ring_update(ik, iz -> ring rows, summaries of the regions this step closes)
                   score[t, r] = sum_h relu(iq[t, h] . summary[r]) * w[t, h], r < own region of t
                   attend (causal) to the tokens of the top-k regions (ties: lower id) + the own region
    x = x + o_proj(attn);  x = x + SwiGLU(RMSNorm(x))

Caches are owned through :mod:`stepops.owners` (a :class:`PagedAttentionLayer` per layer, a
:class:`Step5CSATailRing` per CSA layer) and allocated by :func:`stepops.allocator.allocate_kv_caches`;
the summary cache of each CSA layer is the layer's own ``[num_slots, 256]`` tensor.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stepops._meta.csa_ring_update import REGION_SIZE
from stepops.allocator import KVCaches, allocate_kv_caches
from stepops.layouts import smallest_block_size
from stepops.models.layers import RMSNorm, SwiGLU, gather_paged_keys, masked_attention, rope_neox
from stepops.models.metadata import (
    StepBuffers,
    Step5StepMetadata,
    build_step5_metadata,
    common_attn_block_size,
    common_size,
)
from stepops.ops.paged_kv_write import paged_kv_write
from stepops.owners import PagedAttentionLayer, Step5CSATailRing

SLIDING = "sliding"
CSA = "csa"


@dataclass(frozen=True)
class Step5Config:
    """Step5 decoder numbers. The default is tiny (CPU tests); the indexer's ``index_proxy_dim`` stays 256
    because a ring row ``[index_k | index_z]`` is 1024 bytes of bf16 (:data:`stepops.layouts.ROW_BYTES`)."""

    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    sliding_window: int = 16
    index_num_heads: int = 16  # as in Step5: with few heads, all-zero relu scores tie often
    index_proxy_dim: int = 256
    index_rope_dim: int = 32
    index_top_k: int = 2  # regions of 8 tokens selected per query, besides its own
    num_speculative_tokens: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    layer_types: tuple[str, ...] = field(default=(SLIDING, CSA))

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.index_proxy_dim != 256:
            raise ValueError(f"index_proxy_dim must be 256 (1024-byte ring rows), got {self.index_proxy_dim}")
        if any(kind not in (SLIDING, CSA) for kind in self.layer_types):
            raise ValueError(f"layer_types must be {SLIDING!r} or {CSA!r}, got {self.layer_types}")

    @property
    def block_size(self) -> int:
        """The attention block size: the smallest whose page (K + V of all KV heads, bf16) holds the ring."""
        bytes_per_token = self.num_kv_heads * 2 * self.head_dim * torch.bfloat16.itemsize
        return smallest_block_size(bytes_per_token=bytes_per_token, num_speculative_tokens=self.num_speculative_tokens)


class Step5DecoderLayer(nn.Module):
    """One Step5 decoder layer (``config.layer_types[layer_index]`` picks sliding-window or CSA).

    Registers its cache owners in ``static_forward_context`` under ``{prefix}.attn`` (and
    ``{prefix}.csa_ring``); the caches are bound later by :func:`stepops.allocator.allocate_kv_caches`.
    Run it under ``torch.inference_mode()`` (the cache ops have no autograd formula).
    """

    def __init__(
        self,
        config: Step5Config,
        layer_index: int,
        *,
        static_forward_context: MutableMapping[str, Any],
        prefix: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.kind = c.layer_types[layer_index]
        prefix = prefix or f"layers.{layer_index}"
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_proj = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size).to(dtype)
        self.attn = PagedAttentionLayer(
            prefix=f"{prefix}.attn",
            num_kv_heads=c.num_kv_heads,
            head_size=c.head_dim,
            block_size=c.block_size,
            static_forward_context=static_forward_context,
            sliding_window=c.sliding_window if self.kind == SLIDING else None,
        )
        if self.kind == CSA:
            p = c.index_proxy_dim
            self.index_q_proj = nn.Linear(c.hidden_size, c.index_num_heads * p, bias=False, dtype=dtype)
            self.index_q_norm = RMSNorm(p, c.rms_norm_eps, zero_centred=True)
            self.index_k_proj = nn.Linear(c.hidden_size, p, bias=False, dtype=dtype)
            self.index_k_norm = nn.LayerNorm(p, eps=c.rms_norm_eps)
            self.index_z_proj = nn.Linear(c.hidden_size, p, bias=False, dtype=dtype)
            # fp32 per-head weights: the score's head mix is kept in full precision.
            self.index_weights_proj = nn.Linear(c.hidden_size, c.index_num_heads, bias=False, dtype=torch.float32)
            self.csa_ring = Step5CSATailRing(
                prefix=f"{prefix}.csa_ring",
                main_layer_name=f"{prefix}.attn",
                num_speculative_tokens=c.num_speculative_tokens,
                static_forward_context=static_forward_context,
            )
            self.summary_cache = torch.empty(0, p, dtype=torch.bfloat16)

    def bind_summary_cache(self, summary_cache: torch.Tensor) -> None:
        """Give a CSA layer its own summary cache ``[num_slots, 256]`` bf16 (region summaries)."""
        if self.kind != CSA:
            raise ValueError("only CSA layers have a summary cache")
        if summary_cache.dim() != 2 or summary_cache.shape[1] != self.config.index_proxy_dim:
            raise ValueError(f"summary_cache must be [num_slots, {self.config.index_proxy_dim}], got {tuple(summary_cache.shape)}")
        if summary_cache.dtype != torch.bfloat16:
            raise TypeError(f"summary_cache must be bf16, got {summary_cache.dtype}")
        self.summary_cache = summary_cache

    def forward(self, hidden: torch.Tensor, metadata: Step5StepMetadata) -> torch.Tensor:
        """``hidden [T, hidden_size]`` bf16 -> ``[T, hidden_size]`` bf16; writes this layer's caches."""
        c = self.config
        num_tokens = hidden.shape[0]
        position = metadata.token.position
        h = self.input_norm(hidden)
        q, k, v = self.qkv_proj(h).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1
        )
        q = rope_neox(q.view(num_tokens, c.num_heads, c.head_dim), position, c.head_dim, c.rope_theta)
        k = rope_neox(k.view(num_tokens, c.num_kv_heads, c.head_dim), position, c.head_dim, c.rope_theta)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        kv_cache = self.attn.kv_cache
        paged_kv_write(k, v, kv_cache[..., : c.head_dim], kv_cache[..., c.head_dim :], metadata.attn_slot_mapping)
        keys = gather_paged_keys(kv_cache, c.head_dim, metadata.attn_block_table, metadata.token)
        key_position = torch.arange(keys.causal.shape[1], device=hidden.device)
        if self.kind == SLIDING:
            allowed = keys.causal & (key_position[None, :] > position.long()[:, None] - c.sliding_window)
        else:
            selected_regions = self._select_regions(h, metadata)
            allowed = keys.causal & selected_regions[:, key_position // REGION_SIZE]
        attn = masked_attention(q, keys.key, keys.value, allowed, c.head_dim**-0.5)
        hidden = hidden + self.o_proj(attn.flatten(1))
        return hidden + self.mlp(self.post_norm(hidden))

    def _select_regions(self, h: torch.Tensor, metadata: Step5StepMetadata) -> torch.Tensor:
        """Run the CSA indexer; return ``[T, num_regions]`` bool: the regions each token attends to."""
        c = self.config
        num_tokens = h.shape[0]
        position = metadata.token.position
        iq = self.index_q_norm(self.index_q_proj(h).view(num_tokens, c.index_num_heads, c.index_proxy_dim))
        iq = rope_neox(iq, position, c.index_rope_dim, c.rope_theta)
        ik = self.index_k_norm(self.index_k_proj(h).float()).to(h.dtype)
        ik = rope_neox(ik, position, c.index_rope_dim, c.rope_theta)
        iz = self.index_z_proj(h)
        weights = self.index_weights_proj(h.float()) * c.index_num_heads**-0.5  # [T, Hi] fp32
        # Ring rows and the summaries of every region a token of this step closes; later tokens of the step
        # read those summaries below (the op runs first in program order).
        self.csa_ring.update(ik, iz, self.summary_cache, metadata.ring)
        summaries = self.summary_cache[metadata.summary_slots].float()  # [T, num_regions, 256]
        per_head = torch.einsum("thp,trp->thr", iq.float(), summaries)
        scores = (F.relu(per_head) * weights[:, :, None]).sum(1)  # [T, num_regions]
        region = torch.arange(scores.shape[1], device=h.device)
        own = (position.long() // REGION_SIZE)[:, None]
        scores = scores.masked_fill(region[None, :] >= own, float("-inf"))  # only complete earlier regions
        # Stable descending sort: equal scores keep ascending region order, so ties go to the lower id.
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
        top = ranked.indices[:, : c.index_top_k]
        top_valid = ranked.values[:, : c.index_top_k] > float("-inf")
        selected = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, top_valid)
        return selected | (region[None, :] == own)


class Step5Model(nn.Module):
    """A stack of :class:`Step5DecoderLayer` with its forward context (the layers' cache owners).

    :meth:`allocate_caches` gives every layer its own caches; :meth:`forward` runs one step: it derives the
    per-token metadata from the step's :class:`StepBuffers` on the device, then every layer.
    """

    def __init__(self, config: Step5Config = Step5Config(), *, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.config = config
        self.static_forward_context: dict[str, Any] = {}
        self.layers = nn.ModuleList(
            Step5DecoderLayer(config, i, static_forward_context=self.static_forward_context, dtype=dtype)
            for i in range(len(config.layer_types))
        )
        self.summary_block_size = 16  # regions per summary-cache block

    def allocate_caches(self, num_blocks: int, num_summary_blocks: int, device: torch.device | str) -> KVCaches:
        """Allocate and bind every layer's own KV cache and ring (``num_blocks`` blocks, through the
        allocator) and each CSA layer's summary cache (``num_summary_blocks * summary_block_size`` rows)."""
        caches = allocate_kv_caches(self.static_forward_context, num_blocks, device=device)
        for layer in self.layers:
            if layer.kind == CSA:
                layer.bind_summary_cache(
                    torch.zeros(num_summary_blocks * self.summary_block_size, self.config.index_proxy_dim,
                                dtype=torch.bfloat16, device=device)
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

    def build_metadata(self, buffers: StepBuffers, num_tokens: int) -> Step5StepMetadata:
        return build_step5_metadata(
            buffers,
            num_tokens,
            attn_block_size=self.attn_block_size,
            rows_per_block=self.rows_per_block,
            summary_block_size=self.summary_block_size,
        )

    def forward(self, hidden: torch.Tensor, buffers: StepBuffers) -> torch.Tensor:
        metadata = self.build_metadata(buffers, hidden.shape[0])
        for layer in self.layers:
            hidden = layer(hidden, metadata)
        return hidden

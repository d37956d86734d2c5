"""Step5's numbers: :class:`Step5Config` (checked when built), its rope scaling and the released model's
:data:`STEP5_REFERENCE`.

Apart from the modules that compute the layers (:mod:`stepops.models.step5`), so that the independent
recompute (:mod:`stepops.testing.step5_reference`) can read the same numbers and import nothing else of the
model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from stepops.layouts import smallest_block_size
from stepops.models.paged_attention import DEFAULT_KEYS_PER_CHUNK
from stepops.specs import INT64_MIN, check_int, check_token_ids, is_int

SLIDING = "sliding"
CSA = "csa"
# Regions the CSA indexer scores at a time: a 16k-token context is 2048 regions, 16 chunks of [T, 128, 256]
# summaries.
DEFAULT_INDEXER_REGIONS_PER_CHUNK = 128


def _check_rope_theta(name: str, theta: float) -> None:
    """A rope base: a number, finite and > 1 (NaN gave NaN outputs)."""
    if type(theta) not in (int, float):
        raise TypeError(f"{name} must be a number, got {type(theta).__name__}")
    if not 1 < theta < math.inf:
        raise ValueError(f"{name} must be finite and > 1, got {theta}")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """``rope_scaling`` of type ``llama3``: long wavelengths are stretched by ``factor``, short ones kept,
    the band between interpolated (applied to CSA layers only: the reference's ``yarn_only_types``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        check_int("original_max_position_embeddings", self.original_max_position_embeddings, 1)
        if not 0 < self.factor < math.inf:
            raise ValueError(f"llama3 rope scaling needs a finite factor > 0: {self}")
        if not 0 < self.low_freq_factor < self.high_freq_factor < math.inf:
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, finite: {self}")


@dataclass(frozen=True)
class Step5Config:
    """Step5 decoder numbers. The defaults are a tiny model for CPU tests, chosen so that every part acts:
    more regions than ``index_top_k``, 8 indexer heads per KV group, a llama3 band inside the CSA layers'
    rotary span, SwiGLU limits that clip, and a MoE layer (layer 0) beside a dense one.
    :data:`STEP5_REFERENCE` holds the released model's numbers.

    ``index_proxy_dim`` stays 256 because a ring row ``[index_k | index_z]`` is 1024 bytes of bf16
    (:data:`stepops.layouts.ROW_BYTES`). The indexer's groups are the KV heads (the reference's
    ``num_provider_groups == num_attention_groups``), so ``index_num_heads`` is a multiple of
    ``num_kv_heads``. ``moe_layers`` lists the layer indices whose FFN is MoE; the others are dense.

    ``swiglu_limit`` (the dense MLP's and the routed experts') and ``swiglu_limit_shared`` (the shared
    expert's) are one number for every layer or one per layer, as the reference's ``swiglu_limits`` and
    ``swiglu_limits_shared`` lists; :meth:`swiglu_limits` reads a layer's. ``moe_renormalize`` is the
    reference's ``norm_expert_weight``: whether the routed weights are divided by their sum.
    ``head_wise_attn_gate`` is its ``use_head_wise_attn_gate``: without it, no ``g_proj`` and no gate.
    ``eos_token_ids``: the end-of-sequence ids a runner's ``generate`` stops at by default (the reference's
    ``eos_token_id``; none for a config built here).

    Serving settings, not the reference's: ``num_speculative_tokens`` (a verify step's drafts),
    ``attention_keys_per_chunk`` (the keys a sliding layer's attention folds at a time) and
    ``indexer_regions_per_chunk`` (the regions the CSA indexer scores at a time). A chunk's transient memory
    grows with its size, and the compiled step unrolls ``context / size`` chunks per layer (compile time,
    and a GPU's kernel launches, grow with that count); the results do not depend on them beyond fp32
    rounding (the indexer's top-k not at all).

    Checks: every int field is an int (``TypeError``), used or not; values (``ValueError``) only where the
    layer and FFN kinds in use read them, as :class:`~stepops.models.inkling.InklingConfig` does: the
    indexer's and ``csa_*`` numbers with a CSA layer, the window and ``sliding_rope_theta`` with a sliding
    one, the experts' with a MoE layer, ``intermediate_size`` with a dense one; the SwiGLU limits always.
    """

    hidden_size: int = 64
    vocab_size: int = 128  # Step5ForCausalLM's embedding and head; the decoder stack does not read it
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    sliding_window: int = 16
    index_num_heads: int = 16
    index_proxy_dim: int = 256
    index_rope_dim: int = 32
    index_top_k: int = 2  # regions of 8 tokens selected per query and KV group, besides its own
    num_speculative_tokens: int = 3
    attention_keys_per_chunk: int = DEFAULT_KEYS_PER_CHUNK
    indexer_regions_per_chunk: int = DEFAULT_INDEXER_REGIONS_PER_CHUNK
    rms_norm_eps: float = 1e-5
    sliding_rope_theta: float = 1e4
    csa_rope_theta: float = 5e6
    csa_partial_rotary_factor: float = 1 / 3
    csa_rope_scaling: Llama3RopeScaling | None = Llama3RopeScaling(4.0, 1.0, 4.0, 64)
    swiglu_limit: float | tuple[float, ...] = 1.0  # dense MLP and routed experts (the reference's default is 7.0)
    swiglu_limit_shared: float | tuple[float, ...] = 0.75  # shared expert
    moe_layers: tuple[int, ...] = (0,)
    moe_num_experts: int = 4
    moe_top_k: int = 2
    moe_intermediate_size: int = 32
    share_expert_dim: int = 32
    moe_router_scaling_factor: float = 3.0
    moe_renormalize: bool = True
    head_wise_attn_gate: bool = True
    layer_types: tuple[str, ...] = field(default=(SLIDING, CSA))
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:
            raise ValueError("layer_types must name at least one layer")
        if any(kind not in (SLIDING, CSA) for kind in self.layer_types):
            raise ValueError(f"layer_types must be {SLIDING!r} or {CSA!r}, got {self.layer_types}")
        if not all(is_int(i) for i in self.moe_layers):  # True or 1.0 would be taken as layer 1
            raise TypeError(f"moe_layers must hold int layer indices, got {self.moe_layers}")
        if len(set(self.moe_layers)) != len(self.moe_layers) or any(
            not 0 <= i < len(self.layer_types) for i in self.moe_layers
        ):
            raise ValueError(f"moe_layers must be distinct layer indices < {len(self.layer_types)}, got {self.moe_layers}")
        # Minimums only for the numbers a layer or FFN kind in use reads (the class docstring's checks).
        kinds, has_moe = set(self.layer_types), bool(self.moe_layers)
        minimums = dict(hidden_size=1, vocab_size=1, num_heads=1, num_kv_heads=1, head_dim=1, num_speculative_tokens=0)
        if SLIDING in kinds:
            minimums.update(sliding_window=1, attention_keys_per_chunk=1)
        if CSA in kinds:
            minimums.update(
                index_num_heads=1, index_proxy_dim=1, index_top_k=1, index_rope_dim=2, indexer_regions_per_chunk=1
            )
        if len(self.moe_layers) < len(self.layer_types):
            minimums.update(intermediate_size=1)
        if has_moe:
            minimums.update(moe_num_experts=1, moe_top_k=1, moe_intermediate_size=1, share_expert_dim=1)
        for name in (f.name for f in fields(self) if f.type == "int"):
            check_int(name, getattr(self, name), minimums.get(name, INT64_MIN))  # INT64_MIN: an int, any value
        check_token_ids("eos_token_ids", self.eos_token_ids, self.output_vocab_size)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.csa_rope_scaling is not None and not isinstance(self.csa_rope_scaling, Llama3RopeScaling):
            raise TypeError(
                f"csa_rope_scaling must be a Llama3RopeScaling or None, got {type(self.csa_rope_scaling).__name__}"
            )
        if CSA in kinds:
            self._check_csa_numbers()
        if SLIDING in kinds:
            if self.head_dim % 2:
                raise ValueError(
                    f"head_dim ({self.head_dim}) must be even: sliding layers rotate the whole head in NEOX halves"
                )
            _check_rope_theta("sliding_rope_theta", self.sliding_rope_theta)
        if has_moe and self.moe_top_k > self.moe_num_experts:
            raise ValueError(f"moe_top_k ({self.moe_top_k}) exceeds moe_num_experts ({self.moe_num_experts})")
        if has_moe and not math.isfinite(self.moe_router_scaling_factor):
            raise ValueError(f"moe_router_scaling_factor must be finite, got {self.moe_router_scaling_factor}")
        if not 0 <= self.rms_norm_eps < math.inf:
            raise ValueError(f"rms_norm_eps must be finite and >= 0, got {self.rms_norm_eps}")
        for name in ("moe_renormalize", "head_wise_attn_gate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("swiglu_limit", "swiglu_limit_shared"):
            self._check_swiglu_limit(name, getattr(self, name))

    def _check_csa_numbers(self) -> None:
        """The indexer's and the CSA layers' rope numbers (checked only when a CSA layer reads them)."""
        if self.index_num_heads % self.num_kv_heads:
            raise ValueError(
                f"index_num_heads ({self.index_num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}): "
                "the indexer selects regions per KV group"
            )
        if self.index_proxy_dim != 256:
            raise ValueError(f"index_proxy_dim must be 256 (1024-byte ring rows), got {self.index_proxy_dim}")
        if self.index_rope_dim % 2 or not 2 <= self.index_rope_dim <= self.index_proxy_dim:
            raise ValueError(f"index_rope_dim must be even and in [2, 256], got {self.index_rope_dim}")
        if not 0 < self.csa_partial_rotary_factor <= 1 or self.rotary_dim(CSA) < 2:
            raise ValueError(
                f"csa_partial_rotary_factor ({self.csa_partial_rotary_factor}) must be in (0, 1] and rotate at "
                f"least 2 of head_dim {self.head_dim} dims"
            )
        _check_rope_theta("csa_rope_theta", self.csa_rope_theta)

    def _check_swiglu_limit(self, name: str, limit: object) -> None:
        """A number > 0 (``math.inf``: no clamp), or a tuple of one such number per layer."""
        limits = limit if isinstance(limit, tuple) else (limit,)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in limits):
            raise TypeError(f"{name} must be a number or a tuple of one number per layer, got {limit!r}")
        if isinstance(limit, tuple) and len(limit) != len(self.layer_types):
            raise ValueError(f"{name} has {len(limit)} per-layer limits for {len(self.layer_types)} layers")
        if not all(x > 0 for x in limits):  # NaN fails too
            raise ValueError(
                f"swiglu limits must be > 0 (math.inf for no clamp, which a 0 means in Step-3.5's configs), "
                f"got {name}={limit!r}"
            )

    def swiglu_limits(self, layer_index: int) -> tuple[float, float]:
        """Layer ``layer_index``'s SwiGLU limits: (dense MLP or routed experts, shared expert)."""

        def of_layer(limit: float | tuple[float, ...]) -> float:
            return limit[layer_index] if isinstance(limit, tuple) else limit

        return of_layer(self.swiglu_limit), of_layer(self.swiglu_limit_shared)

    @property
    def output_vocab_size(self) -> int:
        """Logits per token (``vocab_size``: the head is not padded)."""
        return self.vocab_size

    @property
    def index_heads_per_group(self) -> int:
        """Indexer query heads per KV group (the reference's ``heads_per_group``)."""
        return self.index_num_heads // self.num_kv_heads

    def rotary_dim(self, kind: str) -> int:
        """Rotated dims of a main-attention head: the whole head on sliding layers; on CSA layers
        ``round(head_dim * csa_partial_rotary_factor)`` made even (the reference's ``rotary_span``)."""
        if kind == SLIDING:
            return self.head_dim
        span = int(round(self.head_dim * self.csa_partial_rotary_factor))
        return span - span % 2

    def rope_theta(self, kind: str) -> float:
        return self.sliding_rope_theta if kind == SLIDING else self.csa_rope_theta

    def rope_scaling(self, kind: str) -> Llama3RopeScaling | None:
        return None if kind == SLIDING else self.csa_rope_scaling

    @property
    def block_size(self) -> int:
        """The attention block size: the smallest whose page (K + V of all KV heads, bf16) holds the ring."""
        bytes_per_token = self.num_kv_heads * 2 * self.head_dim * torch.bfloat16.itemsize
        return smallest_block_size(bytes_per_token=bytes_per_token, num_speculative_tokens=self.num_speculative_tokens)


# The released model's numbers, from StepFun's public reference (model.py: Step4Config defaults and the
# attention module's table; kernel.py: the indexer). Not stated there, chosen and documented in
# docs/models.md: the llama3 scaling numbers (the Step-3.5 release's config.json), which layers are MoE
# (three dense layers first, as Step-3.5, and layer 91 dense, as model.py says) and the speculative depth.
STEP5_REFERENCE = Step5Config(
    hidden_size=4096,
    vocab_size=128896,
    num_heads=64,
    num_kv_heads=4,
    head_dim=192,
    intermediate_size=13824,
    sliding_window=512,
    index_num_heads=16,
    index_top_k=512,
    num_speculative_tokens=3,
    rms_norm_eps=1e-5,
    csa_rope_scaling=Llama3RopeScaling(2.0, 1.0, 32.0, 131072),
    swiglu_limit=7.0,
    swiglu_limit_shared=7.0,
    moe_layers=tuple(range(3, 91)),
    moe_num_experts=352,
    moe_top_k=8,
    moe_intermediate_size=1536,
    share_expert_dim=1536,
    layer_types=tuple(CSA if i % 4 == 3 else SLIDING for i in range(92)),
    eos_token_ids=(1, 2),
)

"""A tiny random Step5 checkpoint in StepFun's reference names, for loading and oracle tests.

The names are spelled out here from the reference (``model.py``), not taken from the model's modules, so
loading it into :class:`~stepops.models.step5.Step5Model` checks the model's names too. Values are away
from the identities a bug could hide behind: zero-centred norm weights near 0 but not 0, LayerNorm weights
near 1 with a bias, a router bias, and routed experts quantised to e4m3 with one scale per 128 x 128 block.
"""

from __future__ import annotations

import torch

from stepops.models.step5_config import CSA, Step5Config

_FP8_BLOCK = 128


def _quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, out, in]`` fp32 -> (e4m3 weight, ``[E, ceil(out/128), ceil(in/128)]`` fp32 ``weight_scale_inv``)."""
    experts, rows, cols = weight.shape
    scale = torch.empty(experts, -(-rows // _FP8_BLOCK), -(-cols // _FP8_BLOCK), device=weight.device)
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            block = weight[:, i * _FP8_BLOCK : (i + 1) * _FP8_BLOCK, j * _FP8_BLOCK : (j + 1) * _FP8_BLOCK]
            s = block.abs().amax((1, 2)).clamp(min=1e-10) / torch.finfo(torch.float8_e4m3fn).max
            scale[:, i, j] = s
            quantized[:, i * _FP8_BLOCK : (i + 1) * _FP8_BLOCK, j * _FP8_BLOCK : (j + 1) * _FP8_BLOCK] = (
                block / s[:, None, None]
            ).to(torch.float8_e4m3fn)
    return quantized, scale


def random_step5_checkpoint(
    config: Step5Config, seed: int, *, fp8_experts: bool = True, causal_lm: bool = False
) -> dict[str, torch.Tensor]:
    """A seeded random checkpoint for ``config``: CPU tensors, also under another default device, in the
    reference's dtypes (bf16 projections, fp32 norms, router bias and indexer head weights; e4m3 + scales for
    routed experts if ``fp8_experts``). With ``causal_lm``, also the bf16 ``embed_tokens.weight`` and
    ``lm_head.weight`` of a :class:`~stepops.models.step5.Step5ForCausalLM` (drawn last: the decoder's
    weights are the same either way)."""
    c = config
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16

    def linear(out_features: int, in_features: int, dtype=bf16) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=gen, device="cpu") * in_features**-0.5).to(dtype)

    def near(value: float, *shape: int, spread: float = 0.2) -> torch.Tensor:
        return value + spread * torch.randn(*shape, generator=gen, device="cpu")

    def swiglu(prefix: str, inner: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.gate_proj.weight": linear(inner, c.hidden_size),
            f"{prefix}.up_proj.weight": linear(inner, c.hidden_size),
            f"{prefix}.down_proj.weight": linear(c.hidden_size, inner),
        }

    state = {"norm.weight": near(0.0, c.hidden_size)}
    for i, kind in enumerate(c.layer_types):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        state |= {
            p + "input_layernorm.weight": near(0.0, c.hidden_size),
            p + "post_attention_layernorm.weight": near(0.0, c.hidden_size),
            a + "q_proj.weight": linear(c.num_heads * c.head_dim, c.hidden_size),
            a + "k_proj.weight": linear(c.num_kv_heads * c.head_dim, c.hidden_size),
            a + "v_proj.weight": linear(c.num_kv_heads * c.head_dim, c.hidden_size),
            a + "o_proj.weight": linear(c.hidden_size, c.num_heads * c.head_dim),
        }
        if c.head_wise_attn_gate:
            state[a + "g_proj.weight"] = linear(c.num_heads, c.hidden_size)
        state |= {a + "q_norm.weight": near(0.0, c.head_dim), a + "k_norm.weight": near(0.0, c.head_dim)}
        if kind == CSA:
            d = c.index_proxy_dim
            state |= {
                a + "sparse_indexer_q.weight": linear(c.index_num_heads * d, c.hidden_size),
                a + "sparse_indexer_k.weight": linear(d, c.hidden_size),
                a + "sparse_indexer_z.weight": linear(d, c.hidden_size),
                a + "sparse_indexer_w.weight": linear(c.index_num_heads, c.hidden_size, torch.float32),
                a + "sparse_indexer_q_norm.weight": near(0.0, d),
                a + "sparse_indexer_k_norm.weight": near(1.0, d),
                a + "sparse_indexer_k_norm.bias": near(0.0, d, spread=0.1),
            }
        if i not in c.moe_layers:
            state |= swiglu(p + "mlp", c.intermediate_size)
            continue
        state |= swiglu(p + "share_expert", c.share_expert_dim)
        state[p + "moe.gate.weight"] = linear(c.moe_num_experts, c.hidden_size)
        state[p + "moe.router_bias"] = near(0.0, c.moe_num_experts, spread=0.1)
        shapes = {
            "gate_proj": (c.moe_intermediate_size, c.hidden_size),
            "up_proj": (c.moe_intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.moe_intermediate_size),
        }
        for name, (rows, cols) in shapes.items():
            weight = torch.randn(c.moe_num_experts, rows, cols, generator=gen, device="cpu") * cols**-0.5
            if fp8_experts:
                state[f"{p}moe.{name}.weight"], state[f"{p}moe.{name}.weight_scale_inv"] = _quantize_fp8(weight)
            else:
                state[f"{p}moe.{name}.weight"] = weight.to(bf16)
    if causal_lm:  # unit-variance embeddings, as the stack's inputs; logits of about unit scale
        state["embed_tokens.weight"] = torch.randn(c.vocab_size, c.hidden_size, generator=gen, device="cpu").to(bf16)
        state["lm_head.weight"] = linear(c.vocab_size, c.hidden_size)
    return state

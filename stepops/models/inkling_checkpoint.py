"""Load an Inkling text model from a directory written by transformers 5.23.0 (``save_pretrained``).

The directory holds ``config.json`` (``model_type`` ``"inkling_text"``, an ``InklingForCausalLM``) and its
weights as ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Only ``json`` and
``safetensors`` are read: transformers is not imported. :data:`WEIGHT_NAMES` maps every transformers
weight name to stepops' (``docs/models.md`` prints it); multi-token-prediction weights (``model.mtp.*``) are
skipped with a warning, and anything else unknown, or a weight the model needs that is missing, or a shape
that does not match, is a ``ValueError`` naming it.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from stepops.models.inkling import GLOBAL, SLIDING, InklingConfig, InklingModel

TRANSFORMERS_VERSION = "5.23.0"

# transformers name (after "model.layers.N.") -> stepops name (after "layers.N.").
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.r_proj.weight": "r_proj.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.q_norm.weight": "q_norm.weight",
    "self_attn.k_norm.weight": "k_norm.weight",
    "self_attn.rel_logits_proj.proj": "rel_proj",
    "self_attn.k_sconv.conv1d.weight": "conv_k",
    "self_attn.v_sconv.conv1d.weight": "conv_v",
    "attn_sconv.conv1d.weight": "conv_attn",
    "mlp_sconv.conv1d.weight": "conv_mlp",
    # dense MLP layers
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.global_scale": "mlp.global_scale",
    # sparse MLP layers
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.gate.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts.gate_up_proj": "mlp.experts_gate_up",
    "mlp.experts.down_proj": "mlp.experts_down",
    "mlp.shared_experts.gate_proj": "mlp.shared_gate",
    "mlp.shared_experts.up_proj": "mlp.shared_up",
    "mlp.shared_experts.down_proj": "mlp.shared_down",
}
_MODEL_NAMES = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.embed_tokens.embed_norm.weight": "embed_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
WEIGHT_NAMES: dict[str, str] = {**_MODEL_NAMES, **{f"model.layers.N.{k}": f"layers.N.{v}" for k, v in _LAYER_NAMES.items()}}
"""Every transformers weight name (``N`` = layer index) -> the stepops parameter it loads into."""

_IGNORED = re.compile(r"model\.mtp\.")  # multi-token-prediction layers: out of scope
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_TYPES = {"hybrid_sliding": SLIDING, "hybrid": GLOBAL}
_CONV_WEIGHTS = ("conv_k", "conv_v", "conv_attn", "conv_mlp")


def config_from_transformers(hf: dict[str, Any], *, block_size: int = 16) -> InklingConfig:
    """An :class:`InklingConfig` from a transformers ``InklingTextConfig`` ``config.json`` dict.

    ``ValueError`` for another model type, an activation other than SiLU, or an unknown layer type.
    ``block_size`` is the attention KV cache's declared block size (not a transformers setting).
    """
    if hf.get("model_type") != "inkling_text":
        raise ValueError(
            f"expected an Inkling text checkpoint (model_type 'inkling_text', InklingForCausalLM), got model_type "
            f"{hf.get('model_type')!r}; multimodal (inkling_mm_model) checkpoints are not supported"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (Inkling uses 'silu')")
    unknown = sorted(set(hf["layer_types"]) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (expected {sorted(_LAYER_TYPES)})")
    return InklingConfig(
        vocab_size=hf["vocab_size"],
        unpadded_vocab_size=hf.get("unpadded_vocab_size"),
        hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        swa_num_heads=hf["swa_num_attention_heads"],
        swa_num_kv_heads=hf["swa_num_key_value_heads"],
        swa_head_dim=hf["swa_head_dim"],
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        n_routed_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        n_shared_experts=hf["n_shared_experts"],
        route_scale=hf["route_scale"],
        conv_kernel_size=hf["conv_kernel_size"],
        sliding_window=hf["sliding_window_size"],
        d_rel=hf["d_rel"],
        rel_extent=hf["rel_extent"],
        log_scaling_n_floor=hf.get("log_scaling_n_floor"),
        log_scaling_alpha=hf["log_scaling_alpha"],
        logits_mup_width_multiplier=hf["logits_mup_width_multiplier"],
        rms_norm_eps=hf["rms_norm_eps"],
        block_size=block_size,
        layer_types=tuple(_LAYER_TYPES[kind] for kind in hf["layer_types"]),
        mlp_layer_types=tuple(hf["mlp_layer_types"]),
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory (one file, or the shards of its index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _stepops_name(key: str) -> str | None:
    """The stepops name of a transformers weight name, ``None`` when unknown."""
    if key in _MODEL_NAMES:
        return _MODEL_NAMES[key]
    match = _LAYER_KEY.fullmatch(key)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def load_inkling(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
) -> InklingModel:
    """Build an :class:`InklingModel` from a transformers checkpoint directory (see the module docstring).

    Weights are cast to ``dtype`` (bf16 for the cached step) except the short-conv weights, the router's
    ``global_scale`` and ``e_score_correction_bias``, which stay fp32 as transformers keeps them. The
    model's caches are not allocated (``model.allocate_caches`` or a :class:`StepRunner` does that).
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path}: no config.json (expected a directory written by save_pretrained)")
    config = config_from_transformers(json.loads(config_file.read_text()), block_size=block_size)
    model = InklingModel(config, dtype=dtype)
    expected = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    unexpected, ignored = [], []
    for key, tensor in _read_safetensors(path).items():
        name = _stepops_name(key)
        if name is None:
            (ignored if _IGNORED.match(key) else unexpected).append(key)
            continue
        if name.rsplit(".", 1)[-1] in _CONV_WEIGHTS:
            tensor = tensor.squeeze(1)  # nn.Conv1d's depthwise [C, 1, W] -> [C, W]
        if name not in expected:
            unexpected.append(key)  # e.g. a dense-MLP weight in a sparse layer
            continue
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{key}: shape {tuple(tensor.shape)} does not match the config's {tuple(expected[name].shape)} ({name})"
            )
        loaded[name] = tensor.to(expected[name].dtype)
    if unexpected:
        raise ValueError(f"{path}: unexpected weights (not part of the Inkling text decoder): {sorted(unexpected)}")
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"{path}: missing weights (stepops names): {missing}")
    if ignored:
        warnings.warn(
            f"{path}: ignoring {len(ignored)} multi-token-prediction weights (model.mtp.*): stepops runs the text "
            "decoder only",
            stacklevel=2,
        )
    model.load_state_dict(loaded)
    return model.to(device)


__all__ = ["TRANSFORMERS_VERSION", "WEIGHT_NAMES", "config_from_transformers", "load_inkling"]

"""Load a Step5 checkpoint in StepFun's reference names into :class:`~stepops.models.step5.Step5Model`.

The model's parameters carry the checkpoint's names (``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q,k,v,o,g}_proj.weight``, ``...self_attn.sparse_indexer_{q,k,z,w}.weight``,
``...mlp.*``, ``...moe.gate.weight``, ``...moe.router_bias``, ``...moe.{gate,up,down}_proj.weight``,
``...share_expert.*``, ``norm.weight``), so loading is a checked copy. Routed experts stored as
float8_e4m3fn with ``weight_scale_inv`` (one fp32 scale per 128 x 128 block, multiplied in) are
dequantised to the model's dtype here, once. A name the model lacks, or a parameter the checkpoint lacks,
is a ``ValueError`` listing them all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from stepops.models.step5 import Step5Model

FP8_BLOCK = 128  # the reference's weight-scale block, [128, 128] over (out, in)
SCALE_SUFFIX = ".weight_scale_inv"
# In the checkpoint but read by nothing: the reference registers ssmax_s at its initial value and its
# indexer scores with a weighted ReLU, which has no softmax for it to scale.
IGNORED = re.compile(r"layers\.\d+\.self_attn\.ssmax_s")


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight [..., out, in]`` float8_e4m3fn times ``scale_inv [..., ceil(out/128), ceil(in/128)]`` fp32
    (each scale covers one 128 x 128 block), in fp32, rounded once to ``dtype``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"an fp8 expert weight must be float8_e4m3fn, got {weight.dtype}")
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"weight_scale_inv must be float32, got {scale_inv.dtype}")
    out_features, in_features = weight.shape[-2:]
    blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    if scale_inv.shape != weight.shape[:-2] + blocks:
        raise ValueError(
            f"weight_scale_inv must be {tuple(weight.shape[:-2] + blocks)} for a weight of {tuple(weight.shape)}, "
            f"got {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.repeat_interleave(FP8_BLOCK, -2)[..., :out_features, :]
    scale = scale.repeat_interleave(FP8_BLOCK, -1)[..., :in_features]
    return (weight.float() * scale).to(dtype)


def load_step5_state_dict(model: Step5Model, state_dict: Mapping[str, torch.Tensor], *, prefix: str = "") -> None:
    """Copy ``state_dict`` (names ``prefix + <model name>``, e.g. ``prefix="model."`` for a whole causal-LM
    checkpoint) into ``model``'s parameters, dequantising fp8 experts. Every parameter must be given and
    every name used (``ValueError``); shapes must match (``ValueError``); dtypes must be floating
    (``TypeError``; float8 only for routed experts with a ``weight_scale_inv``)."""
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, tensor in state_dict.items():
        name = key[len(prefix) :] if key.startswith(prefix) else None
        if name is None:
            unexpected.append(key)
        elif name.endswith(SCALE_SUFFIX):
            scales[name[: -len(SCALE_SUFFIX)] + ".weight"] = tensor
        elif not IGNORED.fullmatch(name):
            tensors[name] = tensor
    unexpected += [prefix + n for n in tensors if n not in params]
    unexpected += [prefix + n[: -len(".weight")] + SCALE_SUFFIX for n in scales if n not in tensors]
    missing = [prefix + n for n in params if n not in tensors]
    if missing or unexpected:
        raise ValueError(f"Step5 checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    for name, param in params.items():
        tensor = tensors[name]
        if name in scales:
            if ".moe." not in name:
                raise ValueError(f"{prefix}{name}: only routed experts (moe.*_proj) may be fp8 with a weight_scale_inv")
            tensor = dequantize_fp8_blocks(tensor, scales[name], param.dtype)
        elif not tensor.is_floating_point() or tensor.dtype == torch.float8_e4m3fn:
            raise TypeError(f"{prefix}{name}: expected a floating-point tensor (fp8 needs a weight_scale_inv), got {tensor.dtype}")
        if tensor.shape != param.shape:
            raise ValueError(f"{prefix}{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)


def load_step5_safetensors(model: Step5Model, directory: str | Path, *, prefix: str = "") -> None:
    """:func:`load_step5_state_dict` from every ``*.safetensors`` file of ``directory`` (a name in two files
    is a ``ValueError``)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in load_file(path).items():
            if key in state_dict:
                raise ValueError(f"{key} is in more than one file of {directory}")
            state_dict[key] = tensor
    load_step5_state_dict(model, state_dict, prefix=prefix)

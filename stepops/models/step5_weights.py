"""Load a Step5 checkpoint in StepFun's reference names into :class:`~stepops.models.step5.Step5Model`.

The model's parameters carry the checkpoint's names (``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q,k,v,o,g}_proj.weight``, ``...self_attn.sparse_indexer_{q,k,z,w}.weight``,
``...mlp.*``, ``...moe.gate.weight``, ``...moe.router_bias``, ``...moe.{gate,up,down}_proj.weight``,
``...share_expert.*``, ``norm.weight``), so loading is a checked copy. Routed experts stored as
float8_e4m3fn with ``weight_scale_inv`` (one fp32 scale per 128 x 128 block, multiplied in) are held as
they are, and their GEMMs multiply them dequantised and round their inputs to e4m3 as the reference's
``fp8_gemm`` does (:class:`~stepops.models.step5.StackedExpertWeight`). A name the model lacks, or a
parameter the checkpoint lacks, is a ``ValueError`` listing them all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from stepops.models.dtypes import tensor_dtypes
from stepops.models.step5 import StackedExpertWeight, Step5Model, check_fp8_blocks

SCALE_SUFFIX = ".weight_scale_inv"
# In the checkpoint but read by nothing: the reference registers ssmax_s at its initial value and its
# indexer scores with a weighted ReLU, which has no softmax for it to scale.
IGNORED = re.compile(r"layers\.\d+\.self_attn\.ssmax_s")


def load_step5_state_dict(model: Step5Model, state_dict: Mapping[str, torch.Tensor], *, prefix: str = "") -> None:
    """Copy ``state_dict`` (names ``prefix + <model name>``, e.g. ``prefix="model."`` for decoder weights
    saved under ``model.``; the model has no embedding or head, so a checkpoint holding them must leave them
    out) into ``model``'s parameters, fp8 experts held as :class:`~stepops.models.step5.StackedExpertWeight`
    says. Every parameter must be given and
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
    experts = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, StackedExpertWeight)}
    for name, param in params.items():  # every check before the first copy: a bad checkpoint changes nothing
        tensor = tensors[name]
        if name in scales:
            if name not in experts:
                raise ValueError(f"{prefix}{name}: only routed experts (moe.*_proj) may be fp8 with a weight_scale_inv")
            check_fp8_blocks(prefix + name, tensor, scales[name])
        elif not tensor.is_floating_point() or tensor.element_size() == 1:
            raise TypeError(f"{prefix}{name}: expected a floating-point tensor (fp8 needs a weight_scale_inv), got {tensor.dtype}")
        if tensor.shape != param.shape:
            raise ValueError(f"{prefix}{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}")
    for name, param in params.items():
        tensor = tensors[name]
        if name in experts:
            expert = experts[name]
            expert.load(tensor, scales.get(name), name=prefix + name)
            module_name = name[: -len(".weight")]  # e4m3 codes and fp32 scales for an fp8 checkpoint's experts
            model.built_dtypes.update({f"{module_name}.{n}": dtype for n, dtype in tensor_dtypes(expert).items()})
        else:
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

"""Load an Inkling text model from a directory written by transformers 5.23.0 (``save_pretrained``).

The directory holds ``config.json`` and its weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Two kinds load:

- a text checkpoint (``model_type`` ``"inkling_text"``, an ``InklingForCausalLM``), weights under
  transformers' module names (``model.layers.N.self_attn.q_proj.weight`` ...);
- a multimodal checkpoint (``"inkling_mm_model"``, an ``InklingForConditionalGeneration``): the text
  decoder is built from its ``text_config``. ``save_pretrained`` writes it in the original layout by default
  (transformers reverses its conversion mapping: ``model.llm.layers.N.attn.wq_du.weight``, fused gate/up
  ``w13`` weights with interleaved rows ...), or, with ``save_original_format=False``, under module names
  (``model.language_model.layers.N.self_attn.q_proj.weight`` ...). Both are read.

The end-of-sequence ids (``InklingConfig.eos_token_ids``, where ``generate`` stops by default) are read where
transformers' ``generate`` reads them: ``generation_config.json``'s ``eos_token_id`` when that file is there
(none if it has no such key), else ``config.json``'s (a multimodal config's own, else its ``text_config``'s).

Only ``json`` and ``safetensors`` are read: transformers is not imported. :data:`WEIGHT_NAMES` and
:data:`ORIGINAL_WEIGHT_NAMES` map every weight name to stepops' (``docs/models.md`` prints them). The
vision tower, the audio tower and the multi-token-prediction layers are out of scope: their weights are
skipped with one warning that counts them. Anything else unknown, a weight the model needs that is
missing, or a shape that does not match, is a ``ValueError`` naming it. ``k_proj``/``v_proj`` and the K and
V conv weights are read as the halves of the layers' fused ``kv_proj.weight`` and ``conv_kv``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stepops.models.checkpoint_files import (
    SafetensorsCheckpoint,
    read_json_object,
    transformers_weight_files,
    with_eos_token_ids,
)
from stepops.models.inkling import GLOBAL, SLIDING, InklingConfig, InklingModel, fuse_kv, shard_inkling_state_dict
from stepops.models.paged_attention import DEFAULT_KEYS_PER_CHUNK
from stepops.models.tensor_parallel import TensorParallel
from stepops.specs import is_int

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
"""Every transformers weight name (``N`` = layer index) -> the stepops parameter it loads into; the K and V
names (``k_proj.weight``, ``v_proj.weight``, ``conv_k``, ``conv_v``) are halves of the fused ``kv_proj.weight``
and ``conv_kv``."""

# The multimodal checkpoint's original layout (what save_pretrained writes by default): original name ->
# transformers' text-model name; layer names after "model.llm.layers.N." -> after "model.layers.N.".
_ORIGINAL_MODEL_NAMES = {
    "model.llm.embed.weight": "model.embed_tokens.weight",
    "model.llm.embed_norm.weight": "model.embed_tokens.embed_norm.weight",
    "model.llm.norm.weight": "model.norm.weight",
    "model.llm.unembed.weight": "lm_head.weight",
}
_ORIGINAL_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_du.weight": "self_attn.q_proj.weight",
    "attn.wk_dv.weight": "self_attn.k_proj.weight",
    "attn.wv_dv.weight": "self_attn.v_proj.weight",
    "attn.wr_du.weight": "self_attn.r_proj.weight",
    "attn.wo_ud.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.rel_logits_proj.proj": "self_attn.rel_logits_proj.proj",
    "attn.k_sconv.weight": "self_attn.k_sconv.conv1d.weight",
    "attn.v_sconv.weight": "self_attn.v_sconv.conv1d.weight",
    "attn_sconv.weight": "attn_sconv.conv1d.weight",
    "mlp_sconv.weight": "mlp_sconv.conv1d.weight",
    "mlp.w2_md.weight": "mlp.down_proj.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.gate.bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts.w2_weight": "mlp.experts.down_proj",
    "mlp.shared_experts.shared_w2_weight": "mlp.shared_experts.down_proj",
}
# Fused gate/up weights of the original layout: rows gate_0, up_0, gate_1, up_1, ... along ``dim``
# (transformers' Interleave op). De-interleaved into gate rows then up rows, then split into the targets
# (the routed experts keep them fused, as transformers' ``gate_up_proj`` does).
_ORIGINAL_FUSED = {
    "mlp.w13_dn.weight": (0, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.experts.w13_weight": (1, ("mlp.experts.gate_up_proj",)),
    "mlp.shared_experts.shared_w13_weight": (1, ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
}
ORIGINAL_WEIGHT_NAMES: dict[str, tuple[str, ...]] = {
    **{k: (v,) for k, v in _ORIGINAL_MODEL_NAMES.items()},
    **{f"model.llm.layers.N.{k}": (f"model.layers.N.{v}",) for k, v in _ORIGINAL_LAYER_NAMES.items()},
    **{
        f"model.llm.layers.N.{k}": tuple(f"model.layers.N.{t}" for t in targets)
        for k, (_, targets) in _ORIGINAL_FUSED.items()
    },
}
"""A multimodal checkpoint's original weight name -> the transformers text-model name(s) it gives (then
:data:`WEIGHT_NAMES`); a fused ``w13`` gives its gate and up halves."""

# Parts of Inkling that stepops does not run (out of scope): (what, name prefixes in either layout).
_OUT_OF_SCOPE = (
    ("vision-tower", ("model.vision_tower.", "model.visual.")),
    ("audio-tower", ("model.audio_tower.", "model.audio.")),
    ("multi-token-prediction", ("model.mtp.",)),
)
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_ORIGINAL_LAYER_KEY = re.compile(r"model\.llm\.layers\.(\d+)\.(.+)")
_STEPOPS_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_TYPES = {"hybrid_sliding": SLIDING, "hybrid": GLOBAL}
# InklingTextConfig.attribute_map: names a release's config.json may use instead (transformers reads the alias,
# and it wins when both are given).
_CONFIG_ALIASES = {
    "sconv_kernel_size": "conv_kernel_size",
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "embedding_multiplier": "logits_mup_width_multiplier",
}
_CONV_WEIGHTS = ("conv_k", "conv_v", "conv_attn", "conv_mlp")
# The layers keep K and V fused, rows per KV head [k_h | v_h] (stepops.models.inkling.fuse_kv): the K and V
# halves of a checkpoint are read under these names, then fused.
_KV_HALVES = {"kv_proj.weight": ("k_proj.weight", "v_proj.weight"), "conv_kv": ("conv_k", "conv_v")}
_FUSED_OF_HALF = {half: fused for fused, halves in _KV_HALVES.items() for half in halves}


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config dict: ``hf`` itself, or a multimodal config's ``text_config``."""
    if hf.get("model_type") == "inkling_mm_model":
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("multimodal Inkling config (model_type 'inkling_mm_model') has no text_config")
        # transformers reads a text_config without a model_type as the Inkling text config it nests.
        if text.get("model_type", "inkling_text") != "inkling_text":
            raise ValueError(f"text_config: expected model_type 'inkling_text', got {text.get('model_type')!r}")
        return text
    if hf.get("model_type") != "inkling_text":
        raise ValueError(
            "expected an Inkling checkpoint (model_type 'inkling_text', InklingForCausalLM, or 'inkling_mm_model', "
            f"InklingForConditionalGeneration), got model_type {hf.get('model_type')!r}"
        )
    return hf


def config_from_transformers(
    hf: dict[str, Any],
    *,
    block_size: int = 16,
    num_speculative_tokens: int = 3,
    attention_keys_per_chunk: int = DEFAULT_KEYS_PER_CHUNK,
    generation_config: dict[str, Any] | None = None,
) -> InklingConfig:
    """An :class:`InklingConfig` from a transformers Inkling ``config.json`` dict (an ``InklingTextConfig``,
    or an ``InklingConfig`` whose ``text_config`` is read; its vision and audio configs are out of scope).
    transformers' aliases (``sconv_kernel_size``, ...) and ``dense_intermediate_size`` are read as it reads them.

    ``ValueError`` for another model type, an activation other than SiLU, a false ``is_causal``, an unknown
    layer type or a missing field. ``block_size`` (the attention KV cache's declared block size),
    ``num_speculative_tokens`` (the drafts a verify step carries: the attention's query tile) and
    ``attention_keys_per_chunk`` (:class:`~stepops.models.inkling.InklingConfig`) are serving settings, not
    transformers'.
    ``eos_token_ids`` are where transformers' ``generate`` reads its stop ids: ``generation_config``'s
    ``eos_token_id`` (a ``generation_config.json`` dict) when one is given, else as
    ``GenerationConfig.from_model_config`` reads them, the config's own, else its ``text_config``'s.
    """
    text = _text_config(hf)
    if generation_config is not None:
        eos_token_id, eos_source = generation_config.get("eos_token_id"), "generation_config.json"
    else:
        eos_token_id, eos_source = hf.get("eos_token_id"), "the Inkling config"
        if eos_token_id is None:
            eos_token_id = text.get("eos_token_id")
    hf = dict(text)
    for alias, name in _CONFIG_ALIASES.items():
        if alias in hf:
            hf[name] = hf.pop(alias)
    if hf.get("dense_intermediate_size") is not None:
        # As InklingTextConfig.__post_init__: intermediate_size is then the routed experts' width.
        hf["moe_intermediate_size"], hf["intermediate_size"] = hf["intermediate_size"], hf["dense_intermediate_size"]
    # transformers' ACT2FN: "swish" is nn.SiLU, the same function as "silu".
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (Inkling uses 'silu')")
    # Not an InklingTextConfig field, but transformers keeps any key and its mask builders read this one.
    if not hf.get("is_causal", True):
        raise ValueError(
            f"is_causal {hf['is_causal']!r} is not supported: transformers then attends both ways, stepops' "
            "attention is causal"
        )
    try:
        config = _inkling_config(
            hf,
            block_size=block_size,
            num_speculative_tokens=num_speculative_tokens,
            attention_keys_per_chunk=attention_keys_per_chunk,
        )
    except KeyError as missing:
        raise ValueError(
            f"the Inkling config has no {missing.args[0]!r} (a config.json written by transformers' "
            "save_pretrained has every field)"
        ) from None
    return with_eos_token_ids(config, eos_token_id, eos_source)


def _layer_types(hf: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(layer_types, mlp_layer_types)`` as ``InklingTextConfig.__post_init__`` fills them when absent or
    ``null`` (a release's config.json may give ``local_layer_ids`` and ``dense_mlp_idx`` instead): sliding
    layers are ``local_layer_ids``, else every layer ``i`` with ``(i + 1) % 6``; the first ``dense_mlp_idx``
    (default 0) MLPs are dense, the rest sparse. ``ValueError`` when the counts disagree with
    ``num_hidden_layers`` (transformers refuses those too)."""
    layer_types, mlp_layer_types = hf.get("layer_types"), hf.get("mlp_layer_types")
    count = hf.get("num_hidden_layers")
    if count is None and (layer_types is None or mlp_layer_types is None):
        raise KeyError("num_hidden_layers")  # derived types need it; the caller names the missing field
    # The types before any arithmetic on them ("3" layers said "num_hidden_layers (3) must equal ... (3)").
    if count is not None and not is_int(count):
        raise TypeError(f"num_hidden_layers must be an int, got {type(count).__name__}")
    for name in ("layer_types", "mlp_layer_types", "local_layer_ids"):
        if hf.get(name) is not None and not isinstance(hf[name], list):
            raise TypeError(f"{name} must be a list, got {type(hf[name]).__name__}")
    if layer_types is None:
        local = hf.get("local_layer_ids")
        local = set(local) if local is not None else {i for i in range(count) if (i + 1) % 6}
        layer_types = ["hybrid_sliding" if i in local else "hybrid" for i in range(count)]
    if mlp_layer_types is None:
        dense = hf.get("dense_mlp_idx", 0)
        if not is_int(dense):  # transformers fails building such a config
            raise TypeError(f"dense_mlp_idx must be an int, got {type(dense).__name__}")
        mlp_layer_types = ["dense" if i < dense else "sparse" for i in range(count)]
    for name, types in (("layer_types", layer_types), ("mlp_layer_types", mlp_layer_types)):
        if count is not None and len(types) != count:
            raise ValueError(f"num_hidden_layers ({count}) must equal the number of {name} ({len(types)})")
    return list(layer_types), list(mlp_layer_types)


def _inkling_config(hf: dict[str, Any], **serving: int) -> InklingConfig:
    """The config of transformers' fields ``hf`` and the serving settings (block size, ...)."""
    layer_types, mlp_layer_types = _layer_types(hf)
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
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
        layer_types=tuple(_LAYER_TYPES[kind] for kind in layer_types),
        mlp_layer_types=tuple(mlp_layer_types),
        **serving,
    )


def _weight_files(path: Path) -> list[Path]:
    """The files transformers reads from the checkpoint directory (a directory saved again in the other format
    keeps the old file: reading that one loaded other weights than transformers does)."""
    files = transformers_weight_files(path)
    if files is None:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return files


def _deinterleave(key: str, tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``g0, u0, g1, u1, ...`` along ``dim`` -> ``g0, g1, ..., u0, u1, ...`` (transformers' Interleave)."""
    if tensor.dim() <= dim:
        raise ValueError(f"{key}: a fused gate/up weight needs a dimension {dim}, got shape {tuple(tensor.shape)}")
    size = tensor.shape[dim]
    if size % 2:
        raise ValueError(f"{key}: fused gate/up dimension {dim} has odd size {size}")
    return tensor.unflatten(dim, (size // 2, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1)


def _multimodal_text_names(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A multimodal checkpoint's weight as transformers' text-model names (``None`` when not the text
    decoder's): ``model.language_model.*`` loses ``language_model.``; the original layout is renamed and
    its fused gate/up weights split."""
    if key == "lm_head.weight":
        return [(key, tensor)]
    if key.startswith("model.language_model."):
        return [("model." + key.removeprefix("model.language_model."), tensor)]
    if key in _ORIGINAL_MODEL_NAMES:
        return [(_ORIGINAL_MODEL_NAMES[key], tensor)]
    match = _ORIGINAL_LAYER_KEY.fullmatch(key)
    if match is None:
        return None
    prefix, name = f"model.layers.{match.group(1)}.", match.group(2)
    if name in _ORIGINAL_LAYER_NAMES:
        return [(prefix + _ORIGINAL_LAYER_NAMES[name], tensor)]
    if name in _ORIGINAL_FUSED:
        dim, targets = _ORIGINAL_FUSED[name]
        parts = _deinterleave(key, tensor, dim).chunk(len(targets), dim)
        return [(prefix + target, part) for target, part in zip(targets, parts)]
    return None


def _out_of_scope(key: str) -> tuple[str, str] | None:
    """``(part, prefix)`` when ``key`` belongs to a part stepops does not run (vision, audio, MTP)."""
    for part, prefixes in _OUT_OF_SCOPE:
        for prefix in prefixes:
            if key.startswith(prefix):
                return part, prefix
    return None


def _ignored_note(ignored: dict[tuple[str, str], int]) -> str:
    """``"3 vision-tower weights (model.visual.*), 1 multi-token-prediction weights (model.mtp.*)"``."""
    groups = []
    for part, prefixes in _OUT_OF_SCOPE:
        seen = {prefix: n for (p, prefix), n in ignored.items() if p == part}
        if seen:
            names = ", ".join(f"{prefix}*" for prefix in prefixes if prefix in seen)
            groups.append(f"{sum(seen.values())} {part} weights ({names})")
    return ", ".join(groups)


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
    num_speculative_tokens: int = 3,
    attention_keys_per_chunk: int = DEFAULT_KEYS_PER_CHUNK,
    process_group: dist.ProcessGroup | None = None,
) -> InklingModel:
    """Build an :class:`InklingModel` from a transformers checkpoint directory (see the module docstring).

    Weights are cast to ``dtype`` (bf16 for the cached step) except the short-conv weights, the router's
    ``global_scale`` and ``e_score_correction_bias``, which stay fp32 as transformers keeps them. The
    model's caches are not allocated (``model.allocate_caches`` or a :class:`StepRunner` does that).
    ``block_size``, ``num_speculative_tokens`` and ``attention_keys_per_chunk`` are the serving settings
    :func:`config_from_transformers` reads.

    ``process_group`` (``tp > 1`` ranks, ``docs/tensor-parallel.md``): this rank's shard, as
    :func:`~stepops.models.inkling.shard_inkling_state_dict` slices the whole model's weights. Every rank
    checks the whole checkpoint and reads it one tensor at a time, keeping only its own slices (allocated on
    ``device``). A config that does not shard over the group is a ``ValueError`` before any weight is read.

    The checkpoint is checked from its files' headers before anything is allocated, then copied in one
    tensor at a time (a K half until its V half is read): host memory holds the model (when ``device`` is
    the CPU) and a checkpoint tensor or two, not the whole checkpoint beside it.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path}: no config.json (expected a directory written by save_pretrained)")
    hf = read_json_object(config_file)
    multimodal = hf.get("model_type") == "inkling_mm_model"
    architectures = hf.get("architectures") or ()
    if multimodal and "InklingModel" in architectures:
        raise ValueError(
            f"{path}: an InklingModel checkpoint has no lm_head (no logits); save an InklingForConditionalGeneration"
        )
    if not multimodal and "InklingTextModel" in architectures:
        raise ValueError(f"{path}: an InklingTextModel checkpoint has no lm_head (no logits); save an InklingForCausalLM")
    generation_file = path / "generation_config.json"
    generation_config = read_json_object(generation_file) if generation_file.exists() else None
    config = config_from_transformers(
        hf,
        block_size=block_size,
        num_speculative_tokens=num_speculative_tokens,
        attention_keys_per_chunk=attention_keys_per_chunk,
        generation_config=generation_config,
    )
    # Built on the meta device, so nothing is allocated or randomly initialised until the checkpoint has been
    # checked (from the files' headers, against the whole model's shapes, whatever this rank holds); then
    # allocated once on ``device`` (same strides: the conv weights stay tap-major) and filled one checkpoint
    # tensor at a time: the load holds the model and a tensor or two of the checkpoint, never all of it,
    # and spends no time on a random init.
    tp = TensorParallel.from_group(process_group)
    with torch.device("meta"):
        model = InklingModel(config, dtype=dtype, process_group=process_group)
        whole = model if tp.size == 1 else InklingModel(config, dtype=dtype)
    expected = dict(whole.state_dict())
    for i in range(len(whole.layers)):  # a fused weight is read as its K and V halves
        for fused, halves in _KV_HALVES.items():
            both = expected.pop(f"layers.{i}.{fused}")
            for half in halves:
                # shape and dtype only: on the meta device, nothing allocated
                expected[f"layers.{i}.{half}"] = both.new_empty((both.shape[0] // 2, *both.shape[1:]), device="meta")
    with SafetensorsCheckpoint(_weight_files(path)) as checkpoint:
        keys = _check_weights(path, checkpoint, expected, multimodal)
        model.to_empty(device=device)
        _copy_weights(checkpoint, keys, model, whole, multimodal, tp)
    return model


def _text_decoder_weights(key: str, tensor: torch.Tensor, multimodal: bool) -> list[tuple[str, torch.Tensor]] | None:
    """A checkpoint tensor as the stepops weights it gives, ``[(name, tensor)]`` (two for a fused gate/up
    weight; conv weights, ``[C, 1, W]`` in the checkpoint (``ValueError`` otherwise), as ``[C, W]``; a K or V
    half under its own name, fused later); ``None`` when it is not the text decoder's. ``tensor`` may be a
    meta tensor: the loader checks the checkpoint's shapes with the mapping it then loads it with."""
    text_weights = _multimodal_text_names(key, tensor) if multimodal else [(key, tensor)]
    weights = []
    for text_key, text_tensor in text_weights or ():
        name = _stepops_name(text_key)
        if name is None:
            return None
        if name.rsplit(".", 1)[-1] in _CONV_WEIGHTS:
            if text_tensor.dim() != 3 or text_tensor.shape[1] != 1:  # transformers refuses it too
                raise ValueError(
                    f"{key}: shape {tuple(text_tensor.shape)} is not a short-conv weight, which is nn.Conv1d's "
                    "depthwise [channels, 1, kernel_size]"
                )
            text_tensor = text_tensor.squeeze(1)  # -> stepops' [C, W]
        weights.append((name, text_tensor))
    return weights or None


def _check_weights(
    path: Path, checkpoint: SafetensorsCheckpoint, expected: dict[str, torch.Tensor], multimodal: bool
) -> list[str]:
    """The checkpoint keys that hold the text decoder's weights, after checking on their metadata (the
    files' headers) that they give each of ``expected`` (stepops name -> meta tensor) exactly once,
    in its shape; ``ValueError`` naming every unexpected or missing weight, or the first misshapen one. The
    out-of-scope parts are skipped with one warning."""
    keys: list[str] = []
    source: dict[str, str] = {}  # stepops name -> the checkpoint key it is read from
    unexpected: list[str] = []
    ignored: dict[tuple[str, str], int] = {}
    for key in checkpoint.keys():
        part = _out_of_scope(key)
        if part is not None:
            ignored[part] = ignored.get(part, 0) + 1
            continue
        weights = _text_decoder_weights(key, checkpoint.metadata(key), multimodal)
        # not the text decoder's, or e.g. a dense-MLP weight in a sparse layer
        if weights is None or any(name not in expected for name, _ in weights):
            unexpected.append(key)
            continue
        for name, tensor in weights:
            if name in source:  # e.g. lm_head.weight next to the original layout's model.llm.unembed.weight
                raise ValueError(
                    f"{path}: {source[name]!r} and {key!r} are both the text decoder's {name}; keep one of them"
                )
            source[name] = key
            if tensor.shape != expected[name].shape:
                raise ValueError(
                    f"{key}: shape {tuple(tensor.shape)} does not match the config's "
                    f"{tuple(expected[name].shape)} ({name})"
                )
        keys.append(key)
    if unexpected:
        raise ValueError(f"{path}: unexpected weights (not part of the Inkling text decoder): {sorted(unexpected)}")
    missing = sorted(set(expected) - set(source))
    if missing:
        raise ValueError(f"{path}: missing weights (stepops names): {missing}")
    if ignored:
        warnings.warn(
            f"{path}: ignoring {_ignored_note(ignored)}: out of scope, stepops runs the Inkling text decoder only",
            stacklevel=3,
        )
    return keys


def _copy_weights(
    checkpoint: SafetensorsCheckpoint,
    keys: list[str],
    model: InklingModel,
    whole: InklingModel,
    multimodal: bool,
    tp: TensorParallel,
) -> None:
    """Read ``keys`` (checked by :func:`_check_weights`) one at a time into ``model``'s allocated weights:
    cast to their dtypes, K and V halves fused once both are read (as ``whole``, the checkpoint's model,
    fuses them), sliced to this rank's shard when ``tp.size > 1``."""
    weights = model.state_dict()  # this rank's tensors, aliasing its parameters and buffers
    halves: dict[str, torch.Tensor] = {}  # a K or V half whose other half is not read yet

    def copy(name: str, tensor: torch.Tensor) -> None:
        if tp.size > 1:
            tensor = shard_inkling_state_dict({name: tensor}, whole.config, tp_rank=tp.rank, tp_size=tp.size)[name]
        weights.pop(name).copy_(tensor)

    for key in keys:
        for name, tensor in _text_decoder_weights(key, checkpoint.read(key), multimodal):
            layer_weight = _STEPOPS_LAYER_KEY.fullmatch(name)
            fused = layer_weight and _FUSED_OF_HALF.get(layer_weight.group(2))
            if not fused:
                copy(name, tensor)
                continue
            halves[name] = tensor
            layer = int(layer_weight.group(1))
            k_name, v_name = (f"layers.{layer}.{half}" for half in _KV_HALVES[fused])
            if k_name in halves and v_name in halves:
                num_kv_heads = whole.layers[layer].num_kv_heads
                copy(f"layers.{layer}.{fused}", fuse_kv(halves.pop(k_name), halves.pop(v_name), num_kv_heads))
    if weights or halves:  # _check_weights found every weight: this is a bug of the loader
        raise RuntimeError(f"load_inkling left weights unloaded: {sorted(weights)} {sorted(halves)}")


__all__ = ["ORIGINAL_WEIGHT_NAMES", "WEIGHT_NAMES", "config_from_transformers", "load_inkling"]

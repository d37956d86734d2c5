"""Load a Step5 checkpoint in StepFun's reference names into :class:`~stepops.models.step5.Step5Model`.

:func:`step5_config_from_reference` reads the checkpoint's ``config.json`` (the reference's ``Step4Config``
keys) into a :class:`~stepops.models.step5_config.Step5Config`; a setting the model cannot compute is a
``ValueError`` naming it. :func:`load_step5` does both for a checkpoint directory.

The model's parameters carry the checkpoint's names (``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q,k,v,o,g}_proj.weight``, ``...self_attn.sparse_indexer_{q,k,z,w}.weight``,
``...mlp.*``, ``...moe.gate.weight``, ``...moe.router_bias``, ``...moe.{gate,up,down}_proj.weight``,
``...share_expert.*``, ``norm.weight``; a :class:`~stepops.models.step5.Step5ForCausalLM` also
``embed_tokens.weight`` and ``lm_head.weight``), so loading is a checked copy. Routed experts stored as
float8_e4m3fn with ``weight_scale_inv`` (one fp32 scale per 128 x 128 block, multiplied in) are held as
they are, and their GEMMs multiply them dequantised and round their inputs to e4m3 as the reference's
``fp8_gemm`` does (:class:`~stepops.models.step5.StackedExpertWeight`). A name the model lacks, or a
parameter the checkpoint lacks, is a ``ValueError`` listing them all.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepops.models.checkpoint_files import (
    read_json_object,
    read_safetensors_files,
    transformers_weight_files,
    with_eos_token_ids,
)
from stepops.models.dtypes import tensor_dtypes
from stepops.models.step5 import StackedExpertWeight, Step5ForCausalLM, Step5Model, check_fp8_blocks
from stepops.models.paged_attention import DEFAULT_KEYS_PER_CHUNK
from stepops.models.step5_config import (
    CSA,
    DEFAULT_INDEXER_REGIONS_PER_CHUNK,
    SLIDING,
    Llama3RopeScaling,
    Step5Config,
)
from stepops.specs import check_int

SCALE_SUFFIX = ".weight_scale_inv"
# Step4ForCausalLM keeps its head beside the decoder (``model.``): read without the prefix.
HEAD = "lm_head.weight"
# In the checkpoint but read by nothing: the reference registers ssmax_s ([num_attention_heads] fp32) on
# its sparse (CSA) layers at its initial value, and its indexer scores with a weighted ReLU, which has no
# softmax for it to scale. Dropped there only, after the same shape check a registered tensor gets.
UNUSED = re.compile(r"layers\.(\d+)\.self_attn\.ssmax_s")


def load_step5_state_dict(
    model: Step5Model,
    state_dict: Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
    device: torch.device | str | None = None,
) -> None:
    """Copy ``state_dict`` (names ``prefix + <model name>``, e.g. ``prefix="model."`` for decoder weights
    saved under ``model.``, and ``lm_head.weight`` as it is, beside them, as the reference saves it) into
    ``model``'s parameters, fp8 experts held as :class:`~stepops.models.step5.StackedExpertWeight` says. A
    :class:`~stepops.models.step5.Step5Model` has no embedding or head, so a checkpoint for it leaves them
    out; a :class:`~stepops.models.step5.Step5ForCausalLM` needs them. Every parameter must be given and
    every name used (``ValueError``); shapes must match (``ValueError``); dtypes must be floating
    (``TypeError``; float8 only for routed experts with a ``weight_scale_inv``).

    A model built on the meta device (``with torch.device("meta")``: nothing allocated, nothing randomly
    initialised) is materialised on ``device`` as it loads: each parameter is allocated once, with the
    strides and dtype it was built with (fp8 experts as their codes: never a bf16 copy first), and the
    rotary frequencies are computed there. ``device`` is required for such a model (``ValueError``) and
    refused for a model that is already allocated (``ValueError``: it is filled where it is).

    A model built with an expert-parallel ``process_group`` takes the whole checkpoint on every rank and
    keeps its own experts: each routed expert weight (and its ``weight_scale_inv``) is sliced along the
    expert dimension before the checks, as a view, so only the rank's slice is copied (and of a
    memory-mapped file, only its pages read). An expert tensor that does not hold all ``moe_num_experts``
    experts is a ``ValueError``."""
    params = dict(model.named_parameters())
    on_meta = {param.is_meta for param in params.values()}
    if on_meta == {True, False}:
        raise ValueError("the model is partly on the meta device: build it on meta, or on a real device, entirely")
    materialise = on_meta == {True}
    if materialise and device is None:
        raise ValueError("the model is on the meta device: pass device= (where to allocate its weights)")
    if not materialise and device is not None:
        raise ValueError(f"the model is already allocated (on {next(iter(params.values())).device}): device= is "
                         "only for a model built on the meta device; move the model with .to() instead")

    def key_of(name: str) -> str:
        return name if name == HEAD else prefix + name

    experts = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, StackedExpertWeight)}
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, tensor in state_dict.items():
        if key == HEAD:
            name = HEAD
        elif key.startswith(prefix) and key != prefix + HEAD:  # the head is not kept under the prefix
            name = key[len(prefix) :]
        else:
            unexpected.append(key)
            continue
        scaled = name[: -len(SCALE_SUFFIX)] + ".weight" if name.endswith(SCALE_SUFFIX) else None
        if model.ep.size > 1 and (scaled or name) in experts:  # an expert weight or its scales: keep ours
            tensor = _rank_experts(key, tensor, model.config.moe_num_experts, experts[scaled or name])
        if scaled:
            scales[scaled] = tensor
        elif not _unused(model, name, tensor, key_of(name)):
            tensors[name] = tensor
    unexpected += [key_of(n) for n in tensors if n not in params]
    unexpected += [prefix + n[: -len(".weight")] + SCALE_SUFFIX for n in scales if n not in tensors]
    missing = [key_of(n) for n in params if n not in tensors]
    if missing or unexpected:
        raise ValueError(f"Step5 checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    for name, param in params.items():  # every check before the first copy: a bad checkpoint changes nothing
        tensor = tensors[name]
        if name in scales:
            if name not in experts:
                raise ValueError(f"{prefix}{name}: only routed experts (moe.*_proj) may be fp8 with a weight_scale_inv")
            check_fp8_blocks(prefix + name, tensor, scales[name])
        elif not tensor.is_floating_point() or tensor.element_size() == 1:
            raise TypeError(f"{key_of(name)}: expected a floating-point tensor (fp8 needs a weight_scale_inv), got {tensor.dtype}")
        if tensor.shape != param.shape:
            raise ValueError(f"{key_of(name)}: shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}")
    for name, param in params.items():
        tensor = tensors[name]
        if name in experts:
            expert = experts[name]
            expert.load(tensor, scales.get(name), name=prefix + name, device=device)
            module_name = name[: -len(".weight")]  # e4m3 codes and fp32 scales for an fp8 checkpoint's experts
            model.built_dtypes.update({f"{module_name}.{n}": dtype for n, dtype in tensor_dtypes(expert).items()})
        elif materialise:
            module_name, _, leaf = name.rpartition(".")
            held = torch.empty_like(param, device=device)  # the built strides
            with torch.no_grad():
                held.copy_(tensor)
            setattr(model.get_submodule(module_name), leaf, nn.Parameter(held, requires_grad=param.requires_grad))
        else:
            with torch.no_grad():
                param.copy_(tensor)
    if materialise:
        for layer in model.layers:
            layer.self_attn.compute_rope_frequencies(model.config)


def _rank_experts(key: str, tensor: torch.Tensor, num_experts: int, held: StackedExpertWeight) -> torch.Tensor:
    """The experts ``held`` holds of a whole checkpoint's routed expert tensor ``[num_experts, ...]``: a view."""
    per_rank = held.weight.shape[0]
    if tensor.dim() == 0 or tensor.shape[0] != num_experts:
        raise ValueError(
            f"{key}: an expert-parallel rank takes the whole checkpoint, {num_experts} experts along dim 0 "
            f"(it keeps {per_rank}), got shape {tuple(tensor.shape)}"
        )
    return tensor.narrow(0, held.first_expert, per_rank)


def _unused(model: Step5Model, name: str, tensor: torch.Tensor, key: str) -> bool:
    """Whether ``name`` is a CSA layer's unused ``ssmax_s`` (then dropped), after checking its shape and dtype;
    on another layer it is left to be reported as unexpected."""
    match = UNUSED.fullmatch(name)
    if match is None:
        return False
    layer = int(match.group(1))
    if layer >= len(model.layers) or model.layers[layer].kind != CSA:
        return False
    if tensor.shape != (model.config.num_heads,) or not tensor.is_floating_point():
        raise ValueError(
            f"{key}: expected a floating-point [num_heads] = [{model.config.num_heads}] tensor, got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    return True


def load_step5_safetensors(
    model: Step5Model, directory: str | Path, *, prefix: str = "", device: torch.device | str | None = None
) -> None:
    """:func:`load_step5_state_dict` from ``directory``'s safetensors files: ``model.safetensors`` when there
    is one, else the shards ``model.safetensors.index.json`` lists (the files transformers'
    ``from_pretrained`` reads), else every ``*.safetensors`` file (a name in two files is a ``ValueError``)."""
    load_step5_state_dict(model, _read_safetensors(Path(directory)), prefix=prefix, device=device)


def load_step5(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    num_speculative_tokens: int = 3,
    attention_keys_per_chunk: int = DEFAULT_KEYS_PER_CHUNK,
    indexer_regions_per_chunk: int = DEFAULT_INDEXER_REGIONS_PER_CHUNK,
    process_group: dist.ProcessGroup | None = None,
) -> Step5ForCausalLM:
    """A :class:`~stepops.models.step5.Step5ForCausalLM` from a checkpoint directory as the reference's
    ``Step4ForCausalLM`` saves one: ``config.json`` (read by :func:`step5_config_from_reference`) and
    safetensors files (as :func:`load_step5_safetensors` picks them) holding ``model.embed_tokens``,
    ``model.layers.{i}.*``, ``model.norm`` and ``lm_head.weight``.

    The multi-token-prediction layers (``model.layers.{n}.*`` for ``num_hidden_layers <= n <
    num_hidden_layers + num_nextn_predict_layers``) are skipped with one warning, as the reference skips
    them: they only propose drafts. Any other name the model lacks is a ``ValueError``. The model is built
    on the meta device and allocated on ``device`` once the checkpoint has been read and checked, each
    weight with its checkpoint values (no random init; fp8 experts never held in bf16), so loading holds
    the checkpoint and the model at once, and nothing more. Its caches are not allocated
    (``allocate_caches`` or a :class:`~stepops.models.runner.StepRunner` does that).
    ``num_speculative_tokens``, ``attention_keys_per_chunk`` and ``indexer_regions_per_chunk`` are the
    serving settings :func:`step5_config_from_reference` takes.

    ``process_group`` (expert parallelism, ``docs/tensor-parallel.md``): this rank's model, holding its share
    of the routed experts (:class:`~stepops.models.step5.Step5Model`); every rank reads the same directory.
    Experts that do not split evenly over the group are a ``ValueError`` before any weight is read.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: no config.json (expected a Step5 checkpoint directory)")
    reference = read_json_object(config_file)
    config = step5_config_from_reference(
        reference,
        num_speculative_tokens=num_speculative_tokens,
        attention_keys_per_chunk=attention_keys_per_chunk,
        indexer_regions_per_chunk=indexer_regions_per_chunk,
    )
    with torch.device("meta"):
        model = Step5ForCausalLM(config, process_group=process_group)
    state_dict = _read_safetensors(path)
    num_layers = len(config.layer_types)
    mtp_layers = range(num_layers, num_layers + _num_mtp_layers(reference))
    mtp_prefixes = tuple(f"model.layers.{i}." for i in mtp_layers)
    skipped = [key for key in state_dict if key.startswith(mtp_prefixes)]
    for key in skipped:
        del state_dict[key]
    load_step5_state_dict(model, state_dict, prefix="model.", device=device)
    if skipped:
        warnings.warn(
            f"{path}: skipped {len(skipped)} tensors of the multi-token-prediction layers "
            f"{mtp_layers.start}..{mtp_layers.stop - 1} (draft proposers; stepops runs the main stack)",
            stacklevel=2,
        )
    return model


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the files transformers reads from ``directory`` (``model.safetensors``, else the
    index's shards), or of every ``*.safetensors`` file where it has neither; ``ValueError`` for no file, for
    a file that is not safetensors, and for a name in two files."""
    files = transformers_weight_files(directory) or sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    return read_safetensors_files(files)


# The reference's layer type names; "full_attention" layers run CSA (its sparse_config.apply_to_layer_types).
_REFERENCE_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": CSA}
# Settings the reference allows and Step5 fixes, as (where, key, the one value read, which is also the
# reference's default).
_FIXED = (
    ("", "fp32_residual_connection", True),
    ("", "use_moe_router_bias", True),
    ("", "need_fp32_gate", True),
    ("", "tp_size", 1),
    ("sparse_config.", "enabled", True),
    ("sparse_config.", "proxy_dim", 256),
    ("sparse_config.", "region_block_size", 8),
    ("sparse_config.", "sparse_indexer_num_k_heads", 1),
    ("sparse_config.", "sparse_indexer_use_rope", True),
    ("sparse_config.", "sparse_indexer_q_norm_type", "rmsnorm"),
    ("sparse_config.", "sparse_indexer_k_norm_type", "layernorm"),
    ("sparse_config.", "sparse_indexer_csa_z_norm_type", "none"),
    ("sparse_config.", "compression_method", "csa_block_compress"),
    ("sparse_config.", "attention_impl", "sparse_gqa"),
)  # fmt: skip
_DEFAULT_SWIGLU_LIMIT = 7.0  # Step4MoE / Step4DecoderLayer when swiglu_limits is empty


def step5_config_from_reference(
    config: Mapping[str, Any],
    *,
    num_speculative_tokens: int = 3,
    attention_keys_per_chunk: int = DEFAULT_KEYS_PER_CHUNK,
    indexer_regions_per_chunk: int = DEFAULT_INDEXER_REGIONS_PER_CHUNK,
) -> Step5Config:
    """A :class:`~stepops.models.step5_config.Step5Config` from a Step5 checkpoint's ``config.json`` object, read as
    the reference's ``Step4Config`` reads it (the table in ``docs/models.md``). The main stack's
    ``num_hidden_layers`` layers are built; the trailing multi-token-prediction entries of the per-layer lists
    are not read. ``num_speculative_tokens`` (the ring is sized for it), ``attention_keys_per_chunk`` and
    ``indexer_regions_per_chunk`` are serving settings (:class:`~stepops.models.step5_config.Step5Config`), not
    in the config.

    ``ValueError`` naming the key for a missing geometry key, a layer type or rope setting without a mapping
    (values that vary within a layer kind, llama3 scaling on sliding layers, another scaling type), a
    non-positive SwiGLU limit that a layer reads, and a setting the model fixes
    (``sparse_config.region_block_size`` 8 ...) set to another value."""
    c = dict(config)
    sparse = dict(c.get("sparse_config") or {})
    for where, key, value in _FIXED:
        got = (sparse if where else c).get(key, value)
        if got != value:
            raise ValueError(f"{where}{key} = {got!r} is not supported: Step5 runs with {value!r}")
    try:
        num_layers = c["num_hidden_layers"]
        check_int("num_hidden_layers", num_layers, 1)
        total = num_layers + _num_mtp_layers(c)
        kinds = _layer_kinds(c.get("layer_types") or ["full_attention"] * total, num_layers, total, sparse)
        theta, rotary, scaling = _rope_by_kind(c, kinds, total)
        moe_layers = tuple(i for i in c.get("moe_layer_list") or () if i < num_layers) if c.get("use_moe", True) else ()
        heads = dict(num_heads=c["num_attention_heads"], num_kv_heads=c["num_attention_groups"])
        if CSA in kinds:
            if sparse.get("num_provider_groups", 4) != heads["num_kv_heads"]:
                raise ValueError(
                    f"sparse_config.num_provider_groups ({sparse.get('num_provider_groups', 4)}) must equal "
                    f"num_attention_groups ({heads['num_kv_heads']}): the indexer's groups are the KV heads"
                )
            heads |= dict(index_num_heads=sparse.get("sparse_indexer_num_heads", 16),
                          index_rope_dim=sparse.get("sparse_indexer_rope_dim", 32), index_top_k=sparse.get("topk", 512))
        step5 = Step5Config(
            **heads,
            hidden_size=c["hidden_size"],
            vocab_size=c.get("vocab_size", 128896),
            head_dim=c["head_dim"],
            intermediate_size=c["intermediate_size"],
            sliding_window=c.get("sliding_window", 512) if SLIDING in kinds else Step5Config.sliding_window,
            num_speculative_tokens=num_speculative_tokens,
            attention_keys_per_chunk=attention_keys_per_chunk,
            indexer_regions_per_chunk=indexer_regions_per_chunk,
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            **theta,
            **rotary,
            csa_rope_scaling=scaling,
            swiglu_limit=_swiglu_limits(c, "swiglu_limits", range(num_layers), num_layers),
            swiglu_limit_shared=_swiglu_limits(c, "swiglu_limits_shared", moe_layers, num_layers),
            moe_layers=moe_layers,
            moe_num_experts=c["moe_num_experts"],
            moe_top_k=c["moe_top_k"],
            moe_intermediate_size=c["moe_intermediate_size"],
            share_expert_dim=c["share_expert_dim"],
            moe_router_scaling_factor=c.get("moe_router_scaling_factor", 3.0),
            moe_renormalize=c.get("norm_expert_weight", True),
            head_wise_attn_gate=c.get("use_head_wise_attn_gate", True),
            layer_types=kinds,
        )
    except KeyError as missing:
        raise ValueError(f"the Step5 config has no {missing.args[0]!r}") from None
    eos_token_id = c.get("eos_token_id")  # Step4Config: [1, 2] unless given
    return with_eos_token_ids(step5, [1, 2] if eos_token_id is None else eos_token_id, "the Step5 config")


def _num_mtp_layers(c: Mapping[str, Any]) -> int:
    """The multi-token-prediction layers after the main stack (``num_nextn_predict_layers``, default 1)."""
    num_mtp = c.get("num_nextn_predict_layers", 1)
    check_int("num_nextn_predict_layers", num_mtp, 0)
    return num_mtp


def _per_layer(c: Mapping[str, Any], key: str, default: Any, total: int) -> Sequence[Any]:
    """``c[key]`` as one value per layer (MTP layers included): a list as given, a number repeated."""
    value = c.get(key)
    if value is None:
        return [default] * total
    if not isinstance(value, (list, tuple)):
        return [value] * total
    if len(value) != total:
        raise ValueError(f"{key} has {len(value)} entries; the config has {total} layers (MTP included)")
    return value


def _layer_kinds(types: Sequence[str], num_layers: int, total: int, sparse: Mapping[str, Any]) -> tuple[str, ...]:
    if len(types) != total:
        raise ValueError(f"layer_types has {len(types)} entries; the config has {total} layers (MTP included)")
    unknown = sorted({t for t in types[:num_layers] if t not in _REFERENCE_LAYER_TYPES})
    if unknown:
        raise ValueError(f"layer_types {unknown} have no Step5 layer (sliding_attention or full_attention)")
    applied = sparse.get("apply_to_layer_types") or ["full_attention"]
    if "full_attention" in types[:num_layers] and ("full_attention" not in applied or not sparse):
        raise ValueError("full_attention layers without the sparse indexer (sparse_config) are dense: not Step5's CSA")
    if "sliding_attention" in applied:
        raise ValueError("sparse_config.apply_to_layer_types names sliding_attention: Step5's sliding layers are dense")
    return tuple(_REFERENCE_LAYER_TYPES[t] for t in types[:num_layers])


def _rope_by_kind(c: Mapping[str, Any], kinds: tuple[str, ...], total: int) -> tuple[dict, dict, Llama3RopeScaling | None]:
    """Each kind's rope theta and rotary share (one value per kind, as Step5Config holds them) and the llama3
    scaling of the CSA layers (``rope_scaling``, applied where ``yarn_only_types`` lists the layer's type)."""
    thetas = _per_layer(c, "rope_theta", 10000.0, total)
    factors = _per_layer(c, "partial_rotary_factors", 1.0, total)
    theta, rotary = {}, {}
    for kind, theta_key in ((SLIDING, "sliding_rope_theta"), (CSA, "csa_rope_theta")):
        layers = [i for i, k in enumerate(kinds) if k == kind]
        for key, values in (("rope_theta", thetas), ("partial_rotary_factors", factors)):
            if len({values[i] for i in layers}) > 1:
                raise ValueError(f"{key} varies across the {kind} layers: Step5Config holds one value per layer kind")
        if layers:
            theta[theta_key] = thetas[layers[0]]
            if kind == CSA:
                rotary["csa_partial_rotary_factor"] = factors[layers[0]]
            elif factors[layers[0]] != 1.0:
                raise ValueError(f"partial_rotary_factors {factors[layers[0]]} on sliding layers: they rotate the whole head")
    scaling = c.get("rope_scaling")
    if scaling is None:
        return theta, rotary, None
    scaled = set(c.get("yarn_only_types") or _REFERENCE_LAYER_TYPES)
    if "sliding_attention" in scaled and SLIDING in kinds:
        raise ValueError("rope_scaling applies to the sliding layers (yarn_only_types): Step5 scales only the CSA layers")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling of type {kind!r} is not supported (llama3 only)")
    if "full_attention" not in scaled:
        return theta, rotary, None
    return theta, rotary, Llama3RopeScaling(
        scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )  # fmt: skip


def _swiglu_limits(
    c: Mapping[str, Any], key: str, read_by: Sequence[int], num_layers: int
) -> float | tuple[float, ...]:
    """The main stack's limits of ``swiglu_limits`` or ``swiglu_limits_shared``: 7.0 for every layer when the
    list is empty (as the reference), else one per layer. Only the layers in ``read_by`` read theirs (every
    layer's FFN the first, a MoE layer's shared expert the second); there a limit <= 0 has no Step5 reading,
    elsewhere the entry is unread (``math.inf``)."""
    limits = c.get(key) or []
    if not limits:
        return _DEFAULT_SWIGLU_LIMIT
    if len(limits) < num_layers:
        raise ValueError(f"{key} has {len(limits)} entries for {num_layers} layers")
    bad = [(i, limits[i]) for i in read_by if not (isinstance(limits[i], (int, float)) and limits[i] > 0)]
    if bad:
        raise ValueError(
            f"{key}: layer {bad[0][0]} has {bad[0][1]!r}; Step-4's reference clamps to 0 there (the FFN's output "
            "is 0) and Step-3.5's readers skip the clamp. Edit the config to the limit you mean (math.inf: none)"
        )
    return tuple(float(limits[i]) if i in read_by else math.inf for i in range(num_layers))

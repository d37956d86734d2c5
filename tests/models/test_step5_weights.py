"""Step5 checkpoints in StepFun's reference names: loading, fp8 expert dequantisation, clear errors; the
config's checks and the released model's numbers."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from stepops.layouts import InklingStream
from stepops.models import Step5Config, Step5Model
from stepops.models.runner import ScheduledRequest, StepRunner
from stepops.models.step5 import Step5ForCausalLM, check_fp8_blocks, dequantize_fp8_blocks
from stepops.models.step5_config import CSA, SLIDING, STEP5_REFERENCE, Llama3RopeScaling
from stepops.models.step5_weights import (
    load_step5, load_step5_safetensors, load_step5_state_dict, step5_config_from_reference,
)
from stepops.testing.step5_checkpoint import random_step5_checkpoint

_CONFIG = Step5Config()  # layer 0: sliding + MoE, layer 1: CSA + dense MLP


def _dequantize_per_block(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``[E, out, in]`` e4m3 times its ``[E, ceil(out/128), ceil(in/128)]`` block scales in fp32, one block at a
    time (the reference's ``real_weight = w_fp8 * weight_scale_inv[block]``)."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for e in range(weight.shape[0]):
        for i in range(scale_inv.shape[1]):
            for j in range(scale_inv.shape[2]):
                rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
                out[e, rows, cols] = weight[e, rows, cols].float() * scale_inv[e, i, j]
    return out


def test_a_reference_named_checkpoint_loads_every_parameter():
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    model = Step5Model(_CONFIG)
    load_step5_state_dict(model, checkpoint)
    params = dict(model.named_parameters())
    for name in ("layers.1.self_attn.sparse_indexer_w.weight", "layers.1.self_attn.q_norm.weight", "norm.weight"):
        assert torch.equal(params[name], checkpoint[name].to(params[name].dtype)), name
    assert params["layers.1.self_attn.sparse_indexer_w.weight"].dtype == torch.float32
    assert params["layers.0.moe.router_bias"].dtype == torch.float32
    codes, scale = checkpoint["layers.0.moe.down_proj.weight"], checkpoint["layers.0.moe.down_proj.weight_scale_inv"]
    down = model.layers[0].moe.down_proj
    # Held as the checkpoint's codes (1 byte per weight) and scales, recorded as the model's dtypes for them;
    # each GEMM multiplies them dequantised in fp32 (bf16 would round each code x scale to 8 bits).
    assert down.fp8 and down.weight.dtype == torch.float8_e4m3fn and torch.equal(down.weight.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(down.weight_scale_inv, scale) and down.weight_scale_inv.data_ptr() != scale.data_ptr()
    assert model.built_dtypes["layers.0.moe.down_proj.weight"] == torch.float8_e4m3fn
    assert model.built_dtypes["layers.0.moe.down_proj.weight_scale_inv"] == torch.float32
    assert torch.equal(down.dequantized(), _dequantize_per_block(codes, scale))
    ids = torch.tensor([3, 0, 3])
    assert torch.equal(down.dequantized(ids), _dequantize_per_block(codes[ids], scale[ids]))


def test_an_fp8_models_state_dict_loads_into_a_fresh_model():
    """``state_dict()`` carries the codes and their scales: loading it reproduces the experts bit for bit,
    and ``load_state_dict`` into a fresh model, which has no scales to fill, refuses it."""
    model = Step5Model(_CONFIG)
    load_step5_state_dict(model, random_step5_checkpoint(_CONFIG, seed=0))
    state = model.state_dict()
    assert state["layers.0.moe.up_proj.weight_scale_inv"].dtype == torch.float32
    again = Step5Model(_CONFIG)
    load_step5_state_dict(again, state)
    for name, tensor in again.state_dict().items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8)), name
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*weight_scale_inv"):
        Step5Model(_CONFIG).load_state_dict(state)


def test_fp8_dequantisation_uses_one_scale_per_128_block():
    """Ragged blocks on both axes (200 x 300 = 2 x 3 blocks) and whole ones, against a per-block loop."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2, 200, 300, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, 3, generator=gen) + 0.5
    got = dequantize_fp8_blocks(weight, scale)
    assert torch.equal(got, _dequantize_per_block(weight, scale))
    assert torch.equal(got[1, 150, 290], weight[1, 150, 290].float() * scale[1, 1, 2])
    whole = weight[:, :128, :256]  # whole blocks (the release's shapes): no padding
    assert torch.equal(dequantize_fp8_blocks(whole, scale[:, :1, :2]), _dequantize_per_block(whole, scale[:, :1, :2]))
    with pytest.raises(ValueError, match=r"weight_scale_inv must be \(2, 2, 3\)"):
        check_fp8_blocks("fp8 weight", weight, scale[:, :1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        check_fp8_blocks("fp8 weight", weight.float(), scale)
    with pytest.raises(TypeError, match="fp8 weight: weight_scale_inv must be float32, got torch.float64"):
        check_fp8_blocks("fp8 weight", weight, scale.double())
    with pytest.raises(ValueError, match=r"fp8 weight: an fp8 weight must be \[\.\.\., out, in\], got shape \(300,\)"):
        check_fp8_blocks("fp8 weight", weight[0, 0], scale[0, 0])


def test_safetensors_directory_with_a_prefix(tmp_path):
    """A causal-LM style checkpoint (``model.`` names) split over two files, fp8 experts included."""
    checkpoint = {f"model.{k}": v for k, v in random_step5_checkpoint(_CONFIG, seed=1).items()}
    names = sorted(checkpoint)
    save_file({k: checkpoint[k] for k in names[::2]}, tmp_path / "model-00001.safetensors")
    save_file({k: checkpoint[k] for k in names[1::2]}, tmp_path / "model-00002.safetensors")
    model = Step5Model(_CONFIG)
    load_step5_safetensors(model, tmp_path, prefix="model.")
    want = Step5Model(_CONFIG)
    load_step5_state_dict(want, checkpoint, prefix="model.")
    for (name, a), (_, b) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(a, b), name


def test_a_key_in_two_files_is_an_error(tmp_path):
    checkpoint = random_step5_checkpoint(_CONFIG, seed=1)
    save_file(checkpoint, tmp_path / "a.safetensors")
    key = "layers.0.self_attn.q_proj.weight"
    save_file({key: torch.zeros_like(checkpoint[key])}, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match=rf"{key} is in more than one file of"):
        load_step5_safetensors(Step5Model(_CONFIG), tmp_path)


def test_an_unreadable_safetensors_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"not a safetensors header")
    with pytest.raises(ValueError, match=r"model-00001\.safetensors: not a readable safetensors file"):
        load_step5_safetensors(Step5Model(_CONFIG), tmp_path)


def test_a_directory_without_safetensors_is_an_error(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")  # a checkpoint in another format is not read as an empty one
    with pytest.raises(ValueError, match=r"no \*\.safetensors files in"):
        load_step5_safetensors(Step5Model(_CONFIG), tmp_path)


def test_a_foreign_prefix_of_the_same_length_is_unexpected():
    """``draft.`` is as long as ``model.``: its names must not load as the model's own."""
    checkpoint = {f"model.{k}": v for k, v in random_step5_checkpoint(_CONFIG, seed=0).items()}
    key = "layers.0.self_attn.q_proj.weight"
    checkpoint[f"draft.{key}"] = checkpoint.pop(f"model.{key}")
    with pytest.raises(ValueError, match=rf"missing \['model\.{key}'\], unexpected \['draft\.{key}'\]"):
        load_step5_state_dict(Step5Model(_CONFIG), checkpoint, prefix="model.")


def _load(checkpoint):
    load_step5_state_dict(Step5Model(_CONFIG), checkpoint)


def test_missing_and_unexpected_names_are_listed():
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    del checkpoint["layers.1.self_attn.g_proj.weight"]
    checkpoint["layers.1.self_attn.index_q_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['layers\.1\.self_attn\.g_proj\.weight'\], unexpected "
                                         r"\['layers\.1\.self_attn\.index_q_proj\.weight'\]"):
        _load(checkpoint)


def test_a_name_outside_the_prefix_is_unexpected():
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    checkpoint["lm_head.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected \['lm_head\.weight'\]"):
        _load(checkpoint)


def test_the_unused_ssmax_s_is_accepted_where_the_reference_has_it():
    """On a CSA layer (layer 1), [num_heads] fp32, as the reference registers it; anywhere else it is not the
    reference's tensor."""
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    checkpoint["layers.1.self_attn.ssmax_s"] = torch.zeros(_CONFIG.num_heads)
    _load(checkpoint)
    for key, tensor, error, match in (
        ("layers.0.self_attn.ssmax_s", torch.zeros(_CONFIG.num_heads), ValueError, r"unexpected \['layers\.0\.self_attn\.ssmax_s'\]"),
        ("layers.7.self_attn.ssmax_s", torch.zeros(_CONFIG.num_heads), ValueError, r"unexpected \['layers\.7\.self_attn\.ssmax_s'\]"),
        ("layers.1.self_attn.ssmax_s", torch.zeros(99, 3), ValueError,
         r"layers\.1\.self_attn\.ssmax_s: expected a floating-point \[num_heads\] = \[4\] tensor, got torch\.float32 of shape \(99, 3\)"),
        ("layers.1.self_attn.ssmax_s", torch.zeros(4, dtype=torch.int32), ValueError, r"got torch\.int32 of shape \(4,\)"),
    ):  # fmt: skip
        with pytest.raises(error, match=match):
            _load({**random_step5_checkpoint(_CONFIG, seed=0), key: tensor})


def test_a_scale_without_its_weight_and_fp8_without_a_scale_are_errors():
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    checkpoint["layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(ValueError, match=r"unexpected \['layers\.0\.mlp\.up_proj\.weight_scale_inv'\]"):
        _load(checkpoint)
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    del checkpoint["layers.0.moe.up_proj.weight_scale_inv"]
    with pytest.raises(TypeError, match=r"layers\.0\.moe\.up_proj\.weight: .*fp8 needs a weight_scale_inv"):
        _load(checkpoint)
    # Any 8-bit float without a scale (float8_e5m2 loaded as raw values), and a scale's errors name the tensor.
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    checkpoint["layers.0.self_attn.q_proj.weight"] = checkpoint["layers.0.self_attn.q_proj.weight"].to(torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"layers\.0\.self_attn\.q_proj\.weight: .*got torch\.float8_e5m2"):
        _load(checkpoint)
    # fp8 with a scale outside the routed experts (the shared expert here) is refused, not loaded unscaled.
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    name = "layers.0.share_expert.gate_proj.weight"
    checkpoint[name] = checkpoint[name].to(torch.float8_e4m3fn)
    checkpoint[name.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
    with pytest.raises(ValueError, match=r"share_expert\.gate_proj\.weight: only routed experts .* may be fp8"):
        _load(checkpoint)
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    checkpoint["layers.0.moe.down_proj.weight_scale_inv"] = checkpoint["layers.0.moe.down_proj.weight_scale_inv"][..., :0]
    with pytest.raises(ValueError, match=r"layers\.0\.moe\.down_proj\.weight: weight_scale_inv must be"):
        _load(checkpoint)


def test_a_wrong_shape_is_an_error():
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    checkpoint["layers.1.self_attn.sparse_indexer_q.weight"] = checkpoint["layers.1.self_attn.sparse_indexer_q.weight"][:256]
    with pytest.raises(ValueError, match=r"sparse_indexer_q\.weight: shape \(256, 64\) does not match the model's \(4096, 64\)"):
        _load(checkpoint)


def test_bf16_experts_load_as_they_are():
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0, fp8_experts=False)
    model = Step5Model(_CONFIG)
    load_step5_state_dict(model, checkpoint)
    gate = model.layers[0].moe.gate_proj
    assert not gate.fp8 and "layers.0.moe.gate_proj.weight_scale_inv" not in model.state_dict()
    assert torch.equal(gate.weight, checkpoint["layers.0.moe.gate_proj.weight"])


@pytest.mark.parametrize("trainable", [True, False])
def test_a_bf16_reload_after_fp8_gives_the_experts_back_their_requires_grad(trainable):
    """e4m3 codes are held frozen; loading the experts in their built dtype again restores the
    ``requires_grad`` they had before, as every other parameter of the model kept it."""
    model = Step5Model(_CONFIG).requires_grad_(trainable)
    load_step5_state_dict(model, random_step5_checkpoint(_CONFIG, seed=0))
    gate = model.layers[0].moe.gate_proj
    assert gate.fp8 and not gate.weight.requires_grad
    load_step5_state_dict(model, random_step5_checkpoint(_CONFIG, seed=0, fp8_experts=False))
    assert not gate.fp8 and gate.weight.dtype == gate.built_dtype
    assert {p.requires_grad for p in model.parameters()} == {trainable}

def test_the_released_models_numbers():
    c = STEP5_REFERENCE
    assert len(c.layer_types) == 92 and c.layer_types.count(CSA) == 23 and c.layer_types[91] == CSA
    assert c.layer_types[:4] == (SLIDING, SLIDING, SLIDING, CSA)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.index_num_heads, c.index_heads_per_group) == (64, 4, 192, 16, 4)
    assert (c.rotary_dim(SLIDING), c.rotary_dim(CSA), c.rope_theta(SLIDING), c.rope_theta(CSA)) == (192, 64, 1e4, 5e6)
    assert c.rope_scaling(SLIDING) is None and c.rope_scaling(CSA).factor == 2.0
    assert (c.index_top_k, c.sliding_window, c.moe_num_experts, c.moe_top_k) == (512, 512, 352, 8)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"index_num_heads": 15}, ValueError, "multiple of num_kv_heads"),
        ({"num_heads": 5}, ValueError, "multiple of num_kv_heads"),
        ({"index_proxy_dim": 128}, ValueError, "1024-byte ring rows"),
        ({"index_rope_dim": 33}, ValueError, "index_rope_dim must be even"),
        ({"csa_partial_rotary_factor": 0.05}, ValueError, "rotate at least 2"),
        ({"moe_layers": (2,)}, ValueError, "moe_layers must be distinct layer indices < 2"),
        ({"moe_layers": (True,)}, TypeError, "moe_layers must hold int layer indices"),
        ({"moe_top_k": 5}, ValueError, "exceeds moe_num_experts"),
        ({"layer_types": ("full",)}, ValueError, "layer_types must be"),
        ({"swiglu_limit": 0.0}, ValueError, "swiglu limits"),
        # per-layer limits (the reference's swiglu_limits): one per layer, each > 0 (inf: no clamp)
        ({"swiglu_limit_shared": (1.0,)}, ValueError, "swiglu_limit_shared has 1 per-layer limits for 2 layers"),
        ({"swiglu_limit": (1.0, 0.0)}, ValueError, r"math.inf for no clamp.*swiglu_limit=\(1.0, 0.0\)"),
        ({"swiglu_limit": (1.0, float("nan"))}, ValueError, "swiglu limits must be > 0"),
        ({"swiglu_limit": [1.0, 2.0]}, TypeError, "swiglu_limit must be a number or a tuple"),
        ({"swiglu_limit_shared": (1.0, None)}, TypeError, "swiglu_limit_shared must be a number or a tuple"),
        ({"swiglu_limit": True}, TypeError, "swiglu_limit must be a number"),
        ({"moe_renormalize": 1}, TypeError, "moe_renormalize must be a bool"),
        ({"head_wise_attn_gate": None}, TypeError, "head_wise_attn_gate must be a bool"),
        ({"head_dim": 16.0}, TypeError, "head_dim must be an int"),
        # an IntEnum member was taken as its value (ATTN_OUT: 2)
        ({"index_top_k": InklingStream.ATTN_OUT}, TypeError, "index_top_k must be an int, got InklingStream"),
        ({"index_top_k": 0}, ValueError, "index_top_k must be >= 1"),
        # were accepted: 256.0 passed the == 256 check, 32.0 the even-and-in-range one; k failed only when the
        # block size was asked for; a str rope dim was a TypeError from string formatting that named no field
        ({"index_proxy_dim": 256.0}, TypeError, "index_proxy_dim must be an int, got float"),
        ({"index_rope_dim": 32.0}, TypeError, "index_rope_dim must be an int, got float"),
        ({"index_rope_dim": "32"}, TypeError, "index_rope_dim must be an int, got str"),
        ({"index_rope_dim": 0}, ValueError, "index_rope_dim must be >= 2, got 0"),
        ({"num_speculative_tokens": True}, TypeError, "num_speculative_tokens must be an int, got bool"),
        ({"num_speculative_tokens": InklingStream.V}, TypeError, "num_speculative_tokens must be an int, got InklingStream"),
        ({"num_speculative_tokens": -1}, ValueError, "num_speculative_tokens must be >= 0, got -1"),
        ({"attention_keys_per_chunk": 0}, ValueError, "attention_keys_per_chunk must be >= 1, got 0"),
        ({"indexer_regions_per_chunk": 0}, ValueError, "indexer_regions_per_chunk must be >= 1, got 0"),
        ({"indexer_regions_per_chunk": 128.0}, TypeError, "indexer_regions_per_chunk must be an int, got float"),
        # a sliding layer ropes the whole head in NEOX halves: an odd head failed mid-step (shape mismatch)
        ({"head_dim": 9}, ValueError, r"head_dim \(9\) must be even"),
        ({"rms_norm_eps": -1e-6}, ValueError, r"rms_norm_eps must be finite and >= 0"),  # was accepted: NaN outputs
        ({"csa_rope_theta": float("nan")}, ValueError, "csa_rope_theta must be finite and > 1, got nan"),  # was accepted: NaN outputs
        ({"sliding_rope_theta": float("nan")}, ValueError, "sliding_rope_theta must be finite and > 1, got nan"),
        ({"sliding_rope_theta": "1e4"}, TypeError, "sliding_rope_theta must be a number, got str"),
        # were accepted: an empty stack failed only at cache allocation, a tuple of scaling numbers when the
        # model was built (AttributeError), infinities ran
        ({"layer_types": (), "moe_layers": ()}, ValueError, "layer_types must name at least one layer"),
        ({"csa_rope_scaling": (4.0, 1.0, 4.0, 64)}, TypeError, "csa_rope_scaling must be a Llama3RopeScaling or None, got tuple"),
        ({"rms_norm_eps": float("inf")}, ValueError, r"rms_norm_eps must be finite and >= 0, got inf"),
        ({"csa_rope_theta": float("inf")}, ValueError, "csa_rope_theta must be finite and > 1, got inf"),
        ({"moe_router_scaling_factor": float("nan")}, ValueError, "moe_router_scaling_factor must be finite"),
        # a stop id the model cannot emit never fires
        ({"eos_token_ids": (1, 128)}, ValueError, r"eos_token_ids: token ids must be in \[0, 128\) \(the ids the model emits\), got 128"),
        ({"eos_token_ids": (-1,)}, ValueError, "each of eos_token_ids must be >= 0, got -1"),
        ({"eos_token_ids": [1, 2]}, TypeError, "eos_token_ids must be a tuple of token ids, got list"),
        ({"eos_token_ids": (True,)}, TypeError, "each of eos_token_ids must be an int, got bool"),
    ],
)
def test_bad_configs_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Step5Config(**kwargs)


_NO_CSA = {"layer_types": (SLIDING,), "moe_layers": ()}


@pytest.mark.parametrize(
    "kwargs",
    [
        # no CSA layer, no indexer or partial rope: a third of head_dim 4 rotates 1 dim, 3 KV heads do not
        # divide 16 indexer heads (both were refused)
        {**_NO_CSA, "head_dim": 4},
        {**_NO_CSA, "num_heads": 3, "num_kv_heads": 3},
        {**_NO_CSA, "index_proxy_dim": 128, "index_rope_dim": 0, "index_top_k": 0, "csa_rope_theta": float("nan"),
         "indexer_regions_per_chunk": 0},
        # no sliding layer: no window, no sliding rope, no paged attention (an odd head_dim was already allowed)
        {"layer_types": (CSA,), "moe_layers": (), "sliding_window": 0, "sliding_rope_theta": 0.5, "head_dim": 9,
         "attention_keys_per_chunk": 0},
        # no MoE layer: no experts; only MoE layers: no dense MLP
        {"moe_layers": (), "moe_num_experts": 0, "moe_top_k": 3, "share_expert_dim": 0, "moe_router_scaling_factor": float("nan")},
        {"moe_layers": (0, 1), "intermediate_size": 0},
    ],
)
def test_numbers_only_absent_layer_kinds_read_are_not_checked(kwargs):
    Step5Model(Step5Config(**kwargs))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({**_NO_CSA, "index_proxy_dim": 256.0}, "index_proxy_dim must be an int, got float"),
        ({"moe_layers": (), "moe_top_k": True}, "moe_top_k must be an int, got bool"),
        ({"moe_layers": (0, 1), "intermediate_size": None}, "intermediate_size must be an int, got NoneType"),
    ],
)
def test_unused_int_fields_are_still_ints(kwargs, match):
    with pytest.raises(TypeError, match=match):
        Step5Config(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"low_freq_factor": 4.0, "high_freq_factor": 1.0}, ValueError, "low_freq_factor < high_freq_factor"),
        ({"low_freq_factor": 4.0, "high_freq_factor": 4.0}, ValueError, "low_freq_factor < high_freq_factor"),
        ({"factor": 0.0}, ValueError, "factor > 0"),
        ({"factor": float("inf")}, ValueError, "a finite factor > 0"),  # was accepted
        ({"high_freq_factor": float("inf")}, ValueError, "low_freq_factor < high_freq_factor, finite"),
        ({"original_max_position_embeddings": 0}, ValueError, "original_max_position_embeddings must be >= 1"),
        ({"original_max_position_embeddings": 64.5}, TypeError, "original_max_position_embeddings must be an int"),
    ],
)
def test_bad_llama3_scaling_is_an_error(kwargs, error, match):
    good = dict(factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    with pytest.raises(error, match=match):
        Llama3RopeScaling(**{**good, **kwargs})


def test_summary_cache_binding_checks():
    """The summary cache holds e4m3 codes as uint8; a float8 tensor (which the op would receive as a dtype
    view, making a compiled step copy the whole cache back) or a sliding layer is refused."""
    model = Step5Model(_CONFIG)
    sliding, csa = model.layers
    with pytest.raises(TypeError, match=r"uint8 \(float8_e4m3fn codes\), got torch.float8_e4m3fn"):
        csa.bind_summary_cache(torch.zeros(16, 256, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"must be \[num_slots, 256\]"):
        csa.bind_summary_cache(torch.zeros(16, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="only CSA layers"):
        sliding.bind_summary_cache(torch.zeros(16, 256, dtype=torch.uint8))


def reference_config(types: list[str], **overrides) -> dict:
    """A checkpoint config.json object in the reference's Step4Config keys: ``types`` per layer, the last one
    the MTP layer's; a CSA layer's rope 5e6 over a third of the head, a sliding one's 1e4 over all of it (also
    test_step5_expert_parallel's)."""
    full = [t == "full_attention" for t in types]
    return {
        "hidden_size": 64, "vocab_size": 128, "intermediate_size": 128, "num_hidden_layers": len(types) - 1,
        "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_attention_groups": 2, "head_dim": 48,
        "rms_norm_eps": 1e-6, "sliding_window": 24, "layer_types": types,
        "rope_theta": [5e6 if f else 1e4 for f in full], "partial_rotary_factors": [1 / 3 if f else 1.0 for f in full],
        "moe_layer_list": [0], "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32,
        "sparse_config": {"proxy_dim": 256, "sparse_indexer_rope_dim": 32, "sparse_indexer_num_heads": 8,
                          "num_provider_groups": 2, "topk": 3, "region_block_size": 8},
        **overrides,
    }  # fmt: skip


def released_config() -> dict:
    """The released Step5's config.json object as the reference's keys hold it (also test_plan's)."""
    types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(92)] + ["full_attention"]
    return reference_config(
        types, hidden_size=4096, vocab_size=128896, intermediate_size=13824, num_attention_heads=64, num_attention_groups=4,
        head_dim=192, rms_norm_eps=1e-5, sliding_window=512, moe_layer_list=list(range(3, 91)), moe_num_experts=352,
        moe_top_k=8, moe_intermediate_size=1536, share_expert_dim=1536, swiglu_limits=[7.0] * 93,
        swiglu_limits_shared=[7.0] * 93, yarn_only_types=["full_attention"],
        rope_scaling={"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
                      "original_max_position_embeddings": 131072},
        sparse_config={"proxy_dim": 256, "sparse_indexer_rope_dim": 32, "sparse_indexer_num_heads": 16,
                       "num_provider_groups": 4, "topk": 512, "region_block_size": 8},
    )  # fmt: skip


def test_the_released_config_reads_as_step5_reference():
    release = released_config()
    # A dense layer has no shared expert: its swiglu_limits_shared entry is unread (inf).
    shared = tuple(7.0 if i in range(3, 91) else math.inf for i in range(92))
    per_layer_7 = dict(swiglu_limit=(7.0,) * 92, swiglu_limit_shared=shared)
    assert step5_config_from_reference(release) == dataclasses.replace(STEP5_REFERENCE, **per_layer_7)


def test_a_config_reads_per_layer_settings_as_the_reference():
    """The main stack's entries of the per-layer lists (the MTP layer's last entry is not read), MoE layers of
    the main stack, the flags, the end-of-sequence ids, and a CSA stack's sliding_window left alone; empty limit
    lists are 7.0, no eos_token_id is [1, 2]. A dense layer's shared limit is unread (inf), even a 0 that a MoE
    layer would refuse."""
    types = ["sliding_attention", "full_attention", "full_attention"]
    reference = reference_config(
        types, swiglu_limits=[0.5, 3.0, 9.0], swiglu_limits_shared=[2.0, 0, 9.0], moe_layer_list=[0, 2],
        norm_expert_weight=False, use_head_wise_attn_gate=False, rope_theta=[2e4, 1e6, 1e6],
        partial_rotary_factors=[1.0, 0.5, 0.25], vocab_size=96, eos_token_id=[7, 95],
    )  # fmt: skip
    want = Step5Config(
        hidden_size=64, vocab_size=96, num_heads=4, num_kv_heads=2, head_dim=48, intermediate_size=128, sliding_window=24,
        index_num_heads=8, index_rope_dim=32, index_top_k=3, num_speculative_tokens=2, rms_norm_eps=1e-6,
        sliding_rope_theta=2e4, csa_rope_theta=1e6, csa_partial_rotary_factor=0.5, csa_rope_scaling=None,
        swiglu_limit=(0.5, 3.0), swiglu_limit_shared=(2.0, math.inf), moe_layers=(0,), moe_renormalize=False,
        head_wise_attn_gate=False, layer_types=(SLIDING, CSA), eos_token_ids=(7, 95),
    )  # fmt: skip
    assert step5_config_from_reference(reference, num_speculative_tokens=2) == want
    assert step5_config_from_reference({**reference, "eos_token_id": 3}).eos_token_ids == (3,)
    no_lists = reference_config(["full_attention", "full_attention"], sliding_window=None, use_moe=False)
    del no_lists["vocab_size"]
    config = step5_config_from_reference(no_lists)
    assert (config.swiglu_limit, config.swiglu_limit_shared, config.moe_layers) == (7.0, 7.0, ())
    assert config.vocab_size == 128896  # Step4Config's defaults
    assert config.eos_token_ids == (1, 2)
    assert config.layer_types == (CSA,) and config.sliding_window == Step5Config().sliding_window


def test_keys_a_config_leaves_out_take_the_reference_defaults():
    """Step4Config's and Step4SparseConfig's defaults for the keys a config may leave out; the last of the
    three layer types is the one MTP layer that ``num_nextn_predict_layers`` (default 1) implies."""
    reference = reference_config(["sliding_attention", "full_attention", "full_attention"])
    for key in ("sliding_window", "num_nextn_predict_layers", "rms_norm_eps", "rope_theta", "partial_rotary_factors"):
        del reference[key]
    for key in ("sparse_indexer_rope_dim", "sparse_indexer_num_heads", "topk"):
        del reference["sparse_config"][key]
    config = step5_config_from_reference(reference)
    assert config.layer_types == (SLIDING, CSA)
    assert (config.sliding_window, config.index_top_k, config.index_num_heads, config.index_rope_dim) == (512, 512, 16, 32)
    assert (config.rms_norm_eps, config.sliding_rope_theta, config.csa_rope_theta) == (1e-5, 1e4, 1e4)
    assert config.csa_partial_rotary_factor == 1.0
    assert (config.moe_router_scaling_factor, config.moe_renormalize, config.head_wise_attn_gate) == (3.0, True, True)


_LLAMA3 = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize(
    "yarn_only_types, scaled",
    [(None, True), ([], True), (["full_attention"], True), (["sliding_attention"], False)],
)
def test_rope_scaling_reaches_the_layer_types_yarn_only_types_lists(yarn_only_types, scaled):
    """Step4Config.rope_scaling_for: ``rope_scaling`` applies to a layer whose type ``yarn_only_types``
    lists, and to every layer when that list is empty or absent. A number for ``rope_theta`` is every
    layer's (Step4Config repeats it)."""
    reference = reference_config(["full_attention"] * 3, rope_theta=5e5, rope_scaling=_LLAMA3)
    if yarn_only_types is not None:
        reference["yarn_only_types"] = yarn_only_types
    config = step5_config_from_reference(reference)
    assert config.csa_rope_theta == 5e5
    assert config.csa_rope_scaling == (Llama3RopeScaling(2.0, 1.0, 4.0, 64) if scaled else None)


_TYPES = ["sliding_attention", "full_attention", "full_attention"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"tp_size": 8}, r"tp_size = 8 is not supported: Step5 runs with 1"),
        ({"fp32_residual_connection": False}, r"fp32_residual_connection = False is not supported"),
        ({"sparse_config": {"region_block_size": 16}}, r"sparse_config.region_block_size = 16 is not supported"),
        ({"sparse_config": {"sparse_indexer_num_k_heads": 2}}, r"sparse_config.sparse_indexer_num_k_heads = 2"),
        ({"sparse_config": None}, r"full_attention layers without the sparse indexer"),
        ({"sparse_config": {"apply_to_layer_types": ["sliding_attention", "full_attention"], "num_provider_groups": 2}},
         r"apply_to_layer_types names sliding_attention"),
        ({"sparse_config": {"num_provider_groups": 4}}, r"num_provider_groups \(4\) must equal num_attention_groups \(2\)"),
        ({"layer_types": _TYPES[:2]}, r"layer_types has 2 entries; the config has 3 layers"),
        ({"layer_types": ["linear_attention"] + _TYPES[1:]}, r"layer_types \['linear_attention'\] have no Step5 layer"),
        ({"layer_types": _TYPES + ["full_attention"], "num_hidden_layers": 3, "rope_theta": [1e4, 5e6, 1e6, 5e6],
          "partial_rotary_factors": [1.0, 1 / 3, 1 / 3, 1 / 3]}, r"rope_theta varies across the csa layers"),
        ({"rope_theta": [1e4, 5e6]}, r"rope_theta has 2 entries; the config has 3 layers"),
        ({"partial_rotary_factors": [0.5, 1 / 3, 1 / 3]}, r"partial_rotary_factors 0.5 on sliding layers"),
        ({"rope_scaling": _LLAMA3}, r"rope_scaling applies to the sliding layers"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "yarn_only_types": ["full_attention"]},
         r"rope_scaling of type 'yarn' is not supported"),
        ({"swiglu_limits": [1.0, 0, 1.0]}, r"swiglu_limits: layer 1 has 0; Step-4's reference clamps to 0"),
        ({"swiglu_limits_shared": [1.0]}, r"swiglu_limits_shared has 1 entries for 2 layers"),
        ({"swiglu_limits_shared": [0, 1.0, 1.0]}, r"swiglu_limits_shared: layer 0 has 0"),  # layer 0 is MoE
        ({"hidden_size": None}, r"hidden_size must be an int"),
        ({"num_hidden_layers": "2"}, r"num_hidden_layers must be an int, got str"),
    ],
)  # fmt: skip
def test_configs_without_a_step5_reading_are_refused_by_key(overrides, match):
    reference = reference_config(_TYPES, **overrides)
    if "sparse_config" in overrides and overrides["sparse_config"] is not None:
        reference["sparse_config"] = {**reference_config(_TYPES)["sparse_config"], **overrides["sparse_config"]}
    with pytest.raises((ValueError, TypeError), match=match):
        step5_config_from_reference(reference)


def test_keys_the_reference_model_does_not_read_are_ignored_as_it_ignores_them():
    """docs/models.md: StepFun's Step4Config stores these, its model never reads them (norms are fp32 and the
    head untied whatever they say; max_position_embeddings only sizes its rope tables)."""
    reference = reference_config(_TYPES)
    unread = dict(norm_dtype="bfloat16", tie_word_embeddings=True, bos_token_id=5, max_position_embeddings=8,
                  quantization_config={"modules_to_not_convert": ["model.layers.0.moe"]})  # fmt: skip
    assert step5_config_from_reference({**reference, **unread}) == step5_config_from_reference(reference)


def test_a_config_missing_a_geometry_key_names_it():
    reference = reference_config(_TYPES)
    del reference["head_dim"]
    with pytest.raises(ValueError, match=r"the Step5 config has no 'head_dim'"):
        step5_config_from_reference(reference)


def _release_layout(tmp_path, reference: dict, edit=lambda checkpoint: None) -> dict[str, torch.Tensor]:
    """A checkpoint directory as Step4ForCausalLM saves one: ``config.json``, the decoder under ``model.``
    and ``lm_head.weight`` beside it, an MTP layer after the main stack, ``ssmax_s``; over two files.
    Returns the checkpoint in stepops' names."""
    config = step5_config_from_reference(reference)
    ours = random_step5_checkpoint(config, seed=2, causal_lm=True)
    saved = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in ours.items()}
    n = reference["num_hidden_layers"]
    saved |= {f"model.layers.{n}.eh_proj.weight": torch.ones(2, 2), f"model.layers.{n}.self_attn.q_proj.weight": torch.ones(2)}
    saved["model.layers.1.self_attn.ssmax_s"] = torch.ones(4)
    edit(saved)
    names = sorted(saved)
    save_file({k: saved[k] for k in names[::2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: saved[k] for k in names[1::2]}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(reference))
    return ours


def _same_tensors(model: torch.nn.Module, want: torch.nn.Module) -> None:
    """Every parameter and buffer (the non-persistent rotary frequencies included) of ``model`` is ``want``'s:
    the same names, dtypes, strides, devices, requires_grad and bytes."""

    def tensors(m):
        return [*m.named_parameters(), *m.named_buffers()]

    def facts(t):
        return t.dtype, t.stride(), t.device, t.requires_grad

    for (name, a), (other, b) in zip(tensors(model), tensors(want), strict=True):
        assert name == other and facts(a) == facts(b), name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_a_reference_checkpoint_directory_loads_as_a_causal_lm(tmp_path):
    """load_step5 builds on the meta device and allocates each weight once, with its checkpoint values: the
    model it gives has the tensors of a model built, randomly initialised, then loaded (the rotary
    frequencies, which no checkpoint holds, computed on its device), and steps to the same logits."""
    reference = reference_config(["sliding_attention", "full_attention", "full_attention"])
    ours = _release_layout(tmp_path, reference)
    serving = dict(num_speculative_tokens=2, attention_keys_per_chunk=64, indexer_regions_per_chunk=1)
    with pytest.warns(UserWarning, match=r"skipped 2 tensors of the multi-token-prediction layers 2\.\.2"):
        model = load_step5(tmp_path, **serving)
    assert type(model) is Step5ForCausalLM
    assert model.config == step5_config_from_reference(reference, **serving)
    assert {name: getattr(model.config, name) for name in serving} == serving
    want = Step5ForCausalLM(model.config)
    load_step5_state_dict(want, ours)
    _same_tensors(model, want)
    assert model.built_dtypes == want.built_dtypes
    assert torch.equal(model.lm_head.weight, ours["lm_head.weight"])
    ids = torch.randint(0, reference["vocab_size"], (20,), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (model, want):
        runner = StepRunner(m, max_requests=1, max_model_len=24, max_tokens=20, device="cpu", inputs="tokens")
        logits.append(runner.step([ScheduledRequest(0, 0, ids)])[0])
    assert torch.equal(*logits)


@pytest.mark.parametrize("fp8_experts", [True, False])
def test_a_model_built_on_meta_is_materialised_where_asked(fp8_experts):
    """load_step5_state_dict(device=) allocates a meta-built model there: the same tensors as a model built
    on that device and loaded (fp8 experts as codes and scales, bf16 ones in bf16)."""
    checkpoint = random_step5_checkpoint(_CONFIG, seed=3, fp8_experts=fp8_experts)
    with torch.device("meta"):
        model = Step5Model(_CONFIG)
    load_step5_state_dict(model, checkpoint, device="cpu")
    want = Step5Model(_CONFIG)
    load_step5_state_dict(want, checkpoint)
    _same_tensors(model, want)
    assert model.layers[0].moe.down_proj.fp8 == fp8_experts


def test_the_device_argument_is_for_a_meta_built_model_only():
    checkpoint = random_step5_checkpoint(_CONFIG, seed=0)
    with torch.device("meta"):
        on_meta = Step5Model(_CONFIG)
    with pytest.raises(ValueError, match=r"the model is on the meta device: pass device="):
        load_step5_state_dict(on_meta, checkpoint)
    with pytest.raises(ValueError, match=r"already allocated \(on cpu\): device= is only for a model built on"):
        load_step5_state_dict(Step5Model(_CONFIG), checkpoint, device="cpu")
    part = Step5Model(_CONFIG)
    part.norm.weight = torch.nn.Parameter(torch.empty_like(part.norm.weight, device="meta"))
    with pytest.raises(ValueError, match=r"partly on the meta device"):
        load_step5_state_dict(part, checkpoint, device="cpu")
    assert all(p.is_meta for p in on_meta.parameters())  # refused before anything was allocated


def test_the_files_transformers_reads_are_the_ones_read(tmp_path):
    """With ``model.safetensors.index.json``, its shards are read and a stray file beside them is not; a
    ``model.safetensors`` beside the shards wins (``save_pretrained`` in one file over a sharded save keeps
    the old shards): the files transformers' ``from_pretrained`` reads. Before, every ``*.safetensors`` file
    was read, and these directories were "in more than one file" errors."""
    reference = reference_config(["sliding_attention", "full_attention", "full_attention"])
    ours = _release_layout(tmp_path, reference)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    weight_map = {key: shard.name for shard in shards for key in load_file(shard)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"model.norm.weight": torch.zeros_like(ours["norm.weight"])}, tmp_path / "stray.safetensors")
    with pytest.warns(UserWarning, match="multi-token-prediction"):
        assert torch.equal(load_step5(tmp_path).norm.weight, ours["norm.weight"])
    single = {key: value for shard in shards for key, value in load_file(shard).items()}
    single["model.norm.weight"] = torch.full_like(ours["norm.weight"], 3.0)
    save_file(single, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="multi-token-prediction"):
        assert torch.equal(load_step5(tmp_path).norm.weight, single["model.norm.weight"])


@pytest.mark.parametrize(
    "edit, match",
    [
        # past the one MTP layer the config declares: not skipped
        (lambda c: c.update({"model.layers.3.eh_proj.weight": torch.ones(2)}), r"unexpected \['model\.layers\.3\.eh_proj"),
        (lambda c: c.pop("lm_head.weight"), r"missing \['lm_head\.weight'\], unexpected \[\]"),
        # the head is kept beside model., not inside it
        (lambda c: c.update({"model.lm_head.weight": c.pop("lm_head.weight")}),
         r"missing \['lm_head\.weight'\], unexpected \['model\.lm_head\.weight'\]"),
        (lambda c: c.pop("model.embed_tokens.weight"), r"missing \['model\.embed_tokens\.weight'\]"),
        (lambda c: c.update({"lm_head.weight": c["lm_head.weight"][:-1]}),
         r"lm_head\.weight: shape \(127, 64\) does not match the model's \(128, 64\)"),
    ],
)  # fmt: skip
def test_a_reference_checkpoint_directory_that_does_not_match_is_refused(tmp_path, edit, match):
    _release_layout(tmp_path, reference_config(["sliding_attention", "full_attention", "full_attention"]), edit)
    with pytest.raises(ValueError, match=match):
        load_step5(tmp_path)


def test_a_directory_without_a_readable_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json \(expected a Step5 checkpoint directory\)"):
        load_step5(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_step5(tmp_path)

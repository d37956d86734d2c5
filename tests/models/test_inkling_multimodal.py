"""``load_inkling`` reads the text decoder of a multimodal Inkling checkpoint (transformers 5.23.0's
``InklingForConditionalGeneration``, ``model_type`` ``inkling_mm_model``).

``save_pretrained`` writes such a model in the original layout by default (transformers reverses its
conversion mapping: ``model.llm.*``, ``attn.wq_du``, fused gate/up ``w13`` weights with interleaved rows)
and under its module names with ``save_original_format=False`` (``model.language_model.*``). Both load;
the vision and audio towers (and MTP layers) are out of scope and skipped with one warning; anything else
unknown or missing stays an error. The text decoder is the oracle test's tiny config
(``inkling_oracle_helpers.HF_CONFIG``), so the same fp32 bound applies to the logits.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from inkling_oracle_helpers import FP32_LAYER, HF_CONFIG, VOCAB, randomize_parameters, single_file_copy
from safetensors import safe_open
from transformers import InklingConfig, InklingForConditionalGeneration  # the test extra pins 5.23.0

from stepops.models.inkling import split_kv
from stepops.models.inkling_checkpoint import ORIGINAL_WEIGHT_NAMES, WEIGHT_NAMES, load_inkling
from stepops.testing.inkling_reference import inkling_layer_reference

# The smallest towers transformers builds (4x4 patches, 2 frames, 4 encoder layers; 4 mel bins of 8).
VISION_CONFIG = dict(patch_size=4, temporal_patch_size=2, num_hidden_layers=4, num_channels=1)
AUDIO_CONFIG = dict(n_mel_bins=4, mel_vocab_size=8)
ORIGINAL, MODULE_NAMES = "original", "module_names"


@pytest.fixture(scope="module")
def hf_mm():
    """A tiny random multimodal Inkling in fp32; weights transformers sets to constants are random too."""
    torch.manual_seed(0)
    config = InklingConfig(text_config=dict(HF_CONFIG), vision_config=VISION_CONFIG, audio_config=AUDIO_CONFIG)
    model = InklingForConditionalGeneration(config).eval()
    randomize_parameters(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def saved(hf_mm, tmp_path_factory):
    """Both layouts save_pretrained writes: the default (original, sharded here) and module names."""
    original, module_names = tmp_path_factory.mktemp("original"), tmp_path_factory.mktemp("module_names")
    hf_mm.save_pretrained(original, max_shard_size="100KB")
    hf_mm.save_pretrained(module_names, save_original_format=False)
    return {ORIGINAL: original, MODULE_NAMES: module_names}


def _keys(path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def _load_quietly(path, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ignoring .* out of scope")
        return load_inkling(path, **kwargs)


def test_save_pretrained_writes_the_two_layouts(saved):
    """What the loader has to read (if transformers changes its default layout, this says so first)."""
    original, module_names = _keys(saved[ORIGINAL]), _keys(saved[MODULE_NAMES])
    assert "model.llm.layers.0.mlp.w13_dn.weight" in original and "model.llm.unembed.weight" in original
    assert {k.split(".")[1] for k in original} == {"llm", "visual", "audio"}
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in module_names and "lm_head.weight" in module_names
    assert {k.split(".")[1] for k in module_names if k.startswith("model.")} == {"language_model", "vision_tower", "audio_tower"}
    # The documented map covers every text-decoder name of the original layout, onto transformers' names.
    generic = {re.sub(r"\.layers\.\d+\.", ".layers.N.", k) for k in original if k.startswith("model.llm.")}
    assert generic == set(ORIGINAL_WEIGHT_NAMES)
    assert {t for targets in ORIGINAL_WEIGHT_NAMES.values() for t in targets} == set(WEIGHT_NAMES)


@pytest.mark.parametrize("layout", [ORIGINAL, MODULE_NAMES])
def test_text_weights_are_transformers_language_model_bitwise(hf_mm, saved, layout):
    """Every stepops parameter holds exactly its transformers text-decoder tensor (names and the fused
    gate/up split right), whichever layout was saved."""
    model = _load_quietly(saved[layout], dtype=torch.float32)
    hf = {}
    for name, tensor in hf_mm.state_dict().items():
        text_name = name.replace("model.language_model.", "model.", 1)
        generic = re.sub(r"^model\.layers\.\d+\.", "model.layers.N.", text_name)
        if generic in WEIGHT_NAMES:
            layer = re.match(r"model\.layers\.(\d+)\.", text_name)
            stepops_name = WEIGHT_NAMES[generic].replace("layers.N.", f"layers.{layer.group(1)}." if layer else "")
            hf[stepops_name] = tensor.squeeze(1) if stepops_name.split(".")[-1].startswith("conv_") else tensor
    ours = dict(model.state_dict())
    # The conv weights stay tap-major through loading (the sconv kernel's contiguous per-tap loads).
    convs = [w for layer in model.layers for w in (layer.conv_kv, layer.conv_attn, layer.conv_mlp)]
    assert all(w.stride() == (1, w.shape[0]) for w in convs)
    for i, layer in enumerate(model.layers):  # the fused K+V weights, as transformers' K and V halves
        for fused, halves in (("kv_proj.weight", ("k_proj.weight", "v_proj.weight")), ("conv_kv", ("conv_k", "conv_v"))):
            for half, tensor in zip(halves, split_kv(ours.pop(f"layers.{i}.{fused}"), layer.num_kv_heads)):
                ours[f"layers.{i}.{half}"] = tensor
    assert ours.keys() == hf.keys()
    for name in ours:
        assert torch.equal(ours[name], hf[name]), name


@pytest.mark.parametrize("layout", [ORIGINAL, MODULE_NAMES])
def test_text_logits_equal_the_multimodal_model_in_fp32(hf_mm, saved, layout):
    """Token ids only (no image, no audio): the logits of transformers' multimodal model, within the oracle
    test's fp32 bound (same layers, so the same summation-order differences)."""
    model = _load_quietly(saved[layout], dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_mm(input_ids=ids[None]).logits[0]
        x = model.embed(ids)
        for layer in model.layers:
            x = inkling_layer_reference(layer, x)
        got = model.logits(x)
    assert got.shape == want.shape == (21, HF_CONFIG["unpadded_vocab_size"])
    torch.testing.assert_close(got, want, atol=FP32_LAYER * want.abs().max(), rtol=0)


@pytest.mark.parametrize(
    "layout, vision, audio",
    [(ORIGINAL, "model.visual.", "model.audio."), (MODULE_NAMES, "model.vision_tower.", "model.audio_tower.")],
)
def test_one_warning_names_the_ignored_towers_and_mtp(saved, tmp_path, layout, vision, audio):
    path = single_file_copy(saved[layout], tmp_path, lambda t: t.update({"model.mtp.0.proj.weight": torch.zeros(2, 2)}))
    keys = _keys(saved[layout])
    n_vision, n_audio = sum(k.startswith(vision) for k in keys), sum(k.startswith(audio) for k in keys)
    assert n_vision >= 4 and n_audio == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_inkling(path)
    messages = [str(w.message) for w in caught if "ignoring" in str(w.message)]
    assert messages == [
        f"{path}: ignoring {n_vision} vision-tower weights ({vision}*), {n_audio} audio-tower weights ({audio}*), "
        "1 multi-token-prediction weights (model.mtp.*): out of scope, stepops runs the Inkling text decoder only"
    ]


@pytest.mark.parametrize(
    "layout, edit, message",
    [
        (ORIGINAL, lambda t: t.pop("model.llm.layers.1.mlp.experts.w2_weight"), r"missing weights \(stepops names\): \['layers.1.mlp.experts_down'\]"),
        (ORIGINAL, lambda t: t.pop("model.llm.layers.0.mlp.w13_dn.weight"), r"missing weights .*\['layers.0.mlp.gate_proj.weight', 'layers.0.mlp.up_proj.weight'\]"),
        (ORIGINAL, lambda t: t.pop("model.llm.unembed.weight"), r"missing weights .*\['lm_head.weight'\]"),
        (MODULE_NAMES, lambda t: t.pop("model.language_model.norm.weight"), r"missing weights .*\['norm.weight'\]"),
        (ORIGINAL, lambda t: t.update({"model.llm.layers.1.attn.wq_du.weight": torch.zeros(3, 64)}), r"model.llm.layers.1.attn.wq_du.weight: shape \(3, 64\) does not match the config's \(64, 64\)"),
        (ORIGINAL, lambda t: t.update({"model.llm.layers.0.mlp.w13_dn.weight": torch.zeros(191, 64)}), r"model.llm.layers.0.mlp.w13_dn.weight: fused gate/up dimension 0 has odd size 191"),
        (ORIGINAL, lambda t: t.update({"model.llm.layers.1.mlp.experts.w13_weight": torch.zeros(4)}), r"experts.w13_weight: a fused gate/up weight needs a dimension 1, got shape \(4,\)"),
        (ORIGINAL, lambda t: t.update({"model.llm.layers.1.mlp.experts.w13_weight": torch.zeros(4, 32, 64)}), r"experts.w13_weight: shape \(4, 32, 64\) does not match the config's \(4, 64, 64\)"),
        (ORIGINAL, lambda t: t.update({"model.llm.layers.1.attn.wx.weight": torch.zeros(1)}), r"unexpected weights .*\['model.llm.layers.1.attn.wx.weight'\]"),
        (ORIGINAL, lambda t: t.update({"model.llm.layers.1.mlp.w13_dn.weight": torch.zeros(192, 64)}), r"unexpected weights .*\['model.llm.layers.1.mlp.w13_dn.weight'\]"),
        (ORIGINAL, lambda t: t.update({"model.multi_modal_projector.weight": torch.zeros(1)}), r"unexpected weights .*\['model.multi_modal_projector.weight'\]"),
        (MODULE_NAMES, lambda t: t.update({"model.language_model.layers.0.mlp.gate.weight": torch.zeros(1)}), r"unexpected weights .*\['model.language_model.layers.0.mlp.gate.weight'\]"),
        # One weight under two names: the later in file order won, where transformers takes the other.
        (ORIGINAL, lambda t: t.update({"lm_head.weight": torch.zeros(128, 64)}), r"'lm_head.weight' and 'model.llm.unembed.weight' are both the text decoder's lm_head.weight"),
    ],
    ids=["missing_expert", "missing_fused_w13", "missing_unembed", "missing_module_name", "shape", "odd_w13", "w13_without_its_fused_dim",
         "expert_w13_shape", "unknown_llm", "dense_w13_in_sparse_layer", "projector", "sparse_in_dense_layer",
         "two_names"],
)
def test_bad_language_model_weights_are_errors(saved, tmp_path, layout, edit, message):
    with pytest.raises(ValueError, match=message):
        _load_quietly(single_file_copy(saved[layout], tmp_path, edit))


@pytest.mark.parametrize(
    "config_edit, message",
    [
        (lambda c: c.pop("text_config"), r"'inkling_mm_model'\) has no text_config"),
        (lambda c: c["text_config"].update(model_type="llama"), r"text_config: expected model_type 'inkling_text', got 'llama'"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), r"hidden_act 'gelu' is not supported"),
        (lambda c: c.update(architectures=["InklingModel"]), r"InklingModel checkpoint has no lm_head"),
    ],
    ids=["no_text_config", "text_model_type", "activation", "base_model"],
)
def test_unsupported_multimodal_configs_are_errors(saved, tmp_path, config_edit, message):
    with pytest.raises(ValueError, match=message):
        load_inkling(single_file_copy(saved[MODULE_NAMES], tmp_path, config_edit=config_edit))


def test_a_text_config_without_model_type_loads_as_transformers_loads_it(saved, tmp_path):
    """transformers reads it as the Inkling text config it nests; stepops refused it."""
    path = single_file_copy(saved[MODULE_NAMES], tmp_path, config_edit=lambda c: c["text_config"].pop("model_type"))
    want = InklingForConditionalGeneration.from_pretrained(path, dtype=torch.float32).lm_head.weight
    assert torch.equal(_load_quietly(path, dtype=torch.float32).lm_head.weight, want)

"""stepops' Inkling == transformers 5.23.0's ``InklingForCausalLM`` (the oracle), on a checkpoint it wrote.

A tiny random ``InklingTextConfig`` covers every part: sliding and global layers with different geometry
(sliding: 4 query heads / 1 KV head of 8; global: 4 / 2 of 16, GQA both), a dense and two sparse MLP
layers (4 routed experts, top-2, 2 shared), W = 4 short convs, a relative bias whose global extent (12)
is shorter than the sequences, log scaling from position 4, a muP logit divisor and a padded head
(``unpadded_vocab_size`` 120 of 128). Weights that transformers initialises to constants (norms, scales,
the router's correction bias, the convs) are randomised too, so a part that ignores one of them fails.

- fp32, no cache: every layer (stepops' modules through the no-cache recompute) vs transformers' layer on
  the same input; pieces with the same arithmetic order bitwise, the rest within ``FP32_LAYER``.
- bf16 steps (caches, chunked ragged prefill, decode, verify with rejected drafts), every layer's output
  and the logits of every committed token vs transformers on the whole sequence: the error to transformers'
  fp32 is within ``BF16_FACTOR`` times transformers' own bf16-vs-fp32 error, measured here on the same
  tokens.
- Greedy generation: two prompts of different lengths in one ragged batch, 32 new tokens, equal to
  ``generate(do_sample=False)``, eager and compiled, with speculative drafts that are partly wrong, and
  with stop tokens (``eos_token_id``): given, or the checkpoint's where transformers' ``generate`` reads them.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

from inkling_oracle_helpers import FP32_LAYER, HF_CONFIG, VOCAB, randomize_parameters, single_file_copy
from transformers import GenerationConfig, InklingForCausalLM, InklingTextConfig  # the test extra pins 5.23.0
from transformers import InklingConfig as HFInklingConfig

from stepops.layouts import InklingStream
from stepops.models.inkling import InklingConfig, InklingModel, InklingRMSNorm
from stepops.models.inkling_checkpoint import config_from_transformers, load_inkling
from stepops.testing.dense_attention import masked_attention
from stepops.testing.inkling_reference import inkling_layer_reference
from stepops.models.runner import COMPILED, EAGER, TOKENS, ScheduledRequest, StepRunner

# Two bf16 implementations round at different places (transformers: bf16 scores and bf16 expert sums;
# stepops: fp32 attention), so stepops' bf16 error to the fp32 truth is of the size of transformers' own,
# not equal to it; twice transformers' error on the same tokens bounds it (seen: <= 1.25x, max and RMS).
BF16_FACTOR = 2.0
# A routing choice closer than this in transformers' fp32 scores flipped under bf16 here (seen: a gap
# between 2**-10 and 2**-8 flipped); such rows are left out, and at most a quarter may be (seen: 52 of 288).
ROUTING_NEAR_TIE = 2**-7
MAX_NEAR_TIE_FRACTION = 1 / 4


def _hf_config(config: dict = HF_CONFIG) -> InklingTextConfig:
    return InklingTextConfig(**config)


def _save(path, correction_bias, config: dict = HF_CONFIG):
    """A tiny random transformers Inkling (``config``) saved with ``save_pretrained`` (sharded: several
    files); ``correction_bias(shape)`` gives each router's ``e_score_correction_bias``."""
    torch.manual_seed(0)
    model = InklingForCausalLM(_hf_config(config)).eval()
    randomize_parameters(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.copy_(correction_bias(buffer.shape))
    model.save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Routing that varies from token to token (some tokens are near ties, see the bf16 test)."""
    return _save(tmp_path_factory.mktemp("inkling"), lambda shape: torch.randn(shape) * 0.5)


@pytest.fixture(scope="module")
def gen_checkpoint(tmp_path_factory):
    """Routing fixed by the correction bias (sigmoid scores lie in (0, 1), so a bias 2 apart decides the
    top-2): 40 greedy steps through bf16 cannot meet a routing near tie, which two correct bf16 models
    may break either way. The router's weights, the shared experts and every other part still vary."""
    return _save(tmp_path_factory.mktemp("inkling_gen"), lambda shape: torch.arange(shape[0], 0, -1.0) * 2.0)


def _hf(checkpoint, dtype):
    return InklingForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf32(checkpoint):
    return _hf(checkpoint, torch.float32)


@pytest.fixture(scope="module")
def hf16(checkpoint):
    return _hf(checkpoint, torch.bfloat16)


def _layer_io(hf, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Each transformers decoder layer's ``(input, output)`` ``[L, hidden]`` and the logits for ``ids [L]``."""
    io, hooks = [], []
    for layer in hf.model.layers:
        hooks.append(layer.register_forward_hook(lambda m, a, k, out: io.append((k["hidden_states"] if not a else a[0], out)), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = hf(ids[None]).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return [(x[0], y[0]) for x, y in io], logits


# -- loading ---------------------------------------------------------------------------------------------


def test_a_loaded_model_has_a_built_models_layouts_and_dtypes(checkpoint):
    """load_inkling builds on the meta device and allocates once: every parameter keeps the strides a
    built model gives it (the conv weights tap-major, which the Triton kernel's vector loads rely on)."""
    loaded, built = load_inkling(checkpoint), InklingModel(config_from_transformers(json.loads((checkpoint / "config.json").read_text())))
    assert loaded.built_dtypes == built.built_dtypes
    assert [(n, p.stride()) for n, p in loaded.named_parameters()] == [(n, p.stride()) for n, p in built.named_parameters()]
    assert all(p.device.type == "cpu" for p in loaded.parameters())


def test_one_file_loads_like_the_shards(checkpoint, tmp_path):
    sharded, single = load_inkling(checkpoint).state_dict(), load_inkling(single_file_copy(checkpoint, tmp_path)).state_dict()
    assert sharded.keys() == single.keys() and all(torch.equal(sharded[k], single[k]) for k in sharded)


def _copy(checkpoint, path, edit):
    shutil.copytree(checkpoint, path)
    edit(path)
    return path


def _truncate_first_shard(path):
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:50])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: (p / "model.safetensors.index.json").write_text("{}"), r"index.json: no weight_map object"),
        (lambda p: (p / "config.json").unlink(), r"copy: no config.json \(expected a directory written by save_pretrained\)"),
        (lambda p: (p / "config.json").write_text("[]"), r"config.json: expected a JSON object, got list"),
        (lambda p: (p / "config.json").write_text("{"), r"config.json: not valid JSON"),
        (_truncate_first_shard, r"model-00001-of-\d+.safetensors: not a readable safetensors file"),
    ],
    ids=["no_weight_map", "no_config", "config_not_an_object", "config_not_json", "truncated_shard"],
)
def test_unreadable_checkpoint_files_are_errors_naming_the_file(checkpoint, tmp_path, edit, message):
    """Each was a KeyError, AttributeError, JSONDecodeError or SafetensorError naming no file."""
    with pytest.raises(ValueError, match=message):
        load_inkling(_copy(checkpoint, tmp_path / "copy", edit))


def test_a_file_next_to_stale_shards_loads_as_transformers_loads_it(checkpoint, tmp_path):
    """save_pretrained in one file over a sharded save keeps the old index and shards: transformers reads
    model.safetensors, and stepops read the stale shards (other weights, silently)."""
    path = single_file_copy(checkpoint, tmp_path, lambda t: t["model.norm.weight"].fill_(3.0))
    for stale in (*checkpoint.glob("model-*.safetensors"), checkpoint / "model.safetensors.index.json"):
        shutil.copy(stale, path)
    want = InklingForCausalLM.from_pretrained(path, dtype=torch.float32).model.norm.weight
    assert torch.equal(want, torch.full_like(want, 3.0))
    assert torch.equal(load_inkling(path, dtype=torch.float32).norm.weight, want)


def test_multi_token_prediction_and_tower_weights_are_ignored_with_a_warning(checkpoint, tmp_path):
    extra = {"model.mtp.0.proj.weight": torch.zeros(2, 2), "model.vision_tower.patch.weight": torch.zeros(1)}
    path = single_file_copy(checkpoint, tmp_path, lambda t: t.update(extra))
    with pytest.warns(UserWarning, match=r"ignoring 1 vision-tower weights \(model.vision_tower.\*\), 1 multi-token-prediction weights \(model.mtp.\*\): out of scope"):
        load_inkling(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.down_proj"), r"missing weights \(stepops names\): \['layers.1.mlp.experts_down'\]"),
        (lambda t: t.update({"model.projector.weight": torch.zeros(1)}), r"unexpected weights .*'model.projector.weight'"),
        (lambda t: t.update({"model.layers.1.mlp.gate_proj.weight": torch.zeros(1)}), r"unexpected weights .*'model.layers.1.mlp.gate_proj.weight'"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), r"model.norm.weight: shape \(3,\) does not match the config's \(64,\)"),
    ],
    ids=["missing", "unknown", "dense_weight_in_a_sparse_layer", "shape"],
)
def test_bad_weights_are_errors_that_name_them(checkpoint, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_inkling(single_file_copy(checkpoint, tmp_path, edit))


@pytest.mark.parametrize(
    "config_edit, message",
    [
        (lambda c: c.update(model_type="llama"), r"model_type 'inkling_text'.*got model_type 'llama'"),
        (lambda c: c.update(hidden_act="gelu"), r"hidden_act 'gelu' is not supported"),
        # transformers' mask builders read it (getattr(config, "is_causal", True)) and attend both ways.
        (lambda c: c.update(is_causal=False), r"is_causal False is not supported"),
        (lambda c: c.update(layer_types=["hybrid", "linear", "hybrid"]), r"layer_types \['linear'\] are not supported"),
        (lambda c: c.update(swa_num_key_value_heads=3), r"sliding layers: query heads \(4\) must be a multiple of KV heads \(3\)"),
        (lambda c: c.pop("log_scaling_alpha"), r"the Inkling config has no 'log_scaling_alpha'"),
        (lambda c: c.update(num_hidden_layers=4), r"num_hidden_layers \(4\) must equal the number of layer_types \(3\)"),
        (lambda c: c.update(num_hidden_layers=2), r"num_hidden_layers \(2\) must equal the number of layer_types \(3\)"),
        # A long list of every weight as "unexpected" before (an InklingTextModel's names lack "model.").
        (lambda c: c.update(architectures=["InklingTextModel"]), r"an InklingTextModel checkpoint has no lm_head"),
    ],
    ids=["model_type", "activation", "bidirectional", "layer_type", "geometry", "missing_field", "layer_count", "layer_count_below", "base_model"],
)
def test_unsupported_configs_are_errors(checkpoint, tmp_path, config_edit, message):
    with pytest.raises(ValueError, match=message):
        load_inkling(single_file_copy(checkpoint, tmp_path, config_edit=config_edit))


@pytest.mark.parametrize(
    "config_edit, message",
    [
        (lambda c: c.update(num_hidden_layers="3"), r"num_hidden_layers must be an int, got str"),
        (lambda c: (c.pop("layer_types"), c.update(local_layer_ids=3)), r"local_layer_ids must be a list, got int"),
        (lambda c: c.update(mlp_layer_types="dense"), r"mlp_layer_types must be a list, got str"),
        # Was read as 0 (every layer sparse) where transformers fails to build the config.
        (lambda c: c.update(mlp_layer_types=None, dense_mlp_idx=None), r"dense_mlp_idx must be an int, got NoneType"),
    ],
    ids=["layer_count_str", "local_ids_int", "mlp_types_str", "dense_idx_null"],
)
def test_mistyped_layer_fields_are_type_errors(checkpoint, tmp_path, config_edit, message):
    """Were "num_hidden_layers (3) must equal the number of layer_types (3)", "'int' object is not
    iterable", or a string taken as a list of one-letter types."""
    with pytest.raises(TypeError, match=message):
        load_inkling(single_file_copy(checkpoint, tmp_path, config_edit=config_edit))


def _release_style_config(config: dict) -> None:
    """The names a release's config.json may use: transformers' attribute-map aliases, and
    ``intermediate_size`` as the routed experts' width with the dense MLP's in ``dense_intermediate_size``."""
    for alias, name in (("sconv_kernel_size", "conv_kernel_size"), ("sliding_window", "sliding_window_size"),
                        ("num_local_experts", "n_routed_experts"), ("embedding_multiplier", "logits_mup_width_multiplier")):
        config[alias] = config.pop(name)
    config["dense_intermediate_size"] = config["intermediate_size"]
    config["intermediate_size"] = config.pop("moe_intermediate_size")


def _aliases_next_to_their_names(config: dict) -> None:
    """Both names of each aliased field, with different values: transformers reads the alias."""
    config.update(sconv_kernel_size=3, sliding_window=5, num_local_experts=3, embedding_multiplier=4.0)


def _derived_layer_types(config: dict) -> None:
    """No layer_types / mlp_layer_types (absent, or null): transformers derives them from local_layer_ids
    and dense_mlp_idx; "swish" is transformers' other name for SiLU."""
    del config["layer_types"]
    config["mlp_layer_types"] = None
    config.update(local_layer_ids=[0, 2], dense_mlp_idx=1, hidden_act="swish")


def test_layer_kinds_absent_everywhere_default_as_in_transformers():
    """No layer_types, mlp_layer_types, local_layer_ids or dense_mlp_idx: transformers' defaults (every
    sixth layer global, every MLP sparse) over 7 layers."""
    fields = ("layer_types", "mlp_layer_types", "local_layer_ids", "dense_mlp_idx")
    hf_config = _hf_config({k: v for k, v in HF_CONFIG.items() if k not in fields} | {"num_hidden_layers": 7})
    saved = {k: v for k, v in hf_config.to_dict().items() if k not in fields}
    config = config_from_transformers(saved)
    kinds = {"hybrid_sliding": "sliding", "hybrid": "global"}
    assert list(config.layer_types) == [kinds[t] for t in hf_config.layer_types]
    assert list(config.mlp_layer_types) == list(hf_config.mlp_layer_types)
    assert config.layer_types.count("global") == 1 and set(config.mlp_layer_types) == {"sparse"}


def test_layer_kinds_to_derive_need_num_hidden_layers():
    fields = ("layer_types", "num_hidden_layers")
    saved = {k: v for k, v in _hf_config(HF_CONFIG).to_dict().items() if k not in fields}
    with pytest.raises(ValueError, match="the Inkling config has no 'num_hidden_layers'"):
        config_from_transformers(saved)


def test_derived_layer_types_load_as_transformers_reads_them(checkpoint, tmp_path):
    path = single_file_copy(checkpoint, tmp_path, config_edit=_derived_layer_types)
    hf_config = InklingTextConfig.from_pretrained(path)
    assert hf_config.layer_types == HF_CONFIG["layer_types"] and hf_config.mlp_layer_types == HF_CONFIG["mlp_layer_types"]
    assert load_inkling(path).config == load_inkling(checkpoint).config


def test_release_style_config_names_load_as_transformers_reads_them(checkpoint, tmp_path):
    path = single_file_copy(checkpoint, tmp_path, config_edit=_release_style_config)
    hf_config = InklingTextConfig.from_pretrained(path)
    assert (hf_config.conv_kernel_size, hf_config.sliding_window_size, hf_config.intermediate_size) == (4, 8, 96)
    assert (hf_config.moe_intermediate_size, hf_config.n_routed_experts, hf_config.logits_mup_width_multiplier) == (32, 4, 2.0)
    assert load_inkling(path).config == load_inkling(checkpoint).config


def test_an_alias_next_to_its_name_wins_as_in_transformers(checkpoint, tmp_path):
    path = single_file_copy(checkpoint, tmp_path, config_edit=_aliases_next_to_their_names)
    hf_config = InklingTextConfig.from_pretrained(path)
    config = config_from_transformers(json.loads((path / "config.json").read_text()))
    want = (hf_config.conv_kernel_size, hf_config.sliding_window_size, hf_config.n_routed_experts,
            hf_config.logits_mup_width_multiplier)  # fmt: skip
    assert want == (3, 5, 3, 4.0)
    assert (config.conv_kernel_size, config.sliding_window, config.n_routed_experts, config.logits_mup_width_multiplier) == want


@pytest.mark.parametrize("top, text", [(None, 5), (7, 5), (None, None), (7, None)])
def test_end_of_sequence_ids_are_read_as_transformers_generate_reads_them(top, text):
    """The ids ``generate`` stops at by default (without a generation_config.json): a text config's
    ``eos_token_id``; a multimodal config's own, else its text config's (transformers'
    ``GenerationConfig.from_model_config``)."""
    text_config = _hf_config({**HF_CONFIG, "eos_token_id": text})
    multimodal = HFInklingConfig(text_config=text_config.to_dict(), eos_token_id=top)
    for hf in (text_config, multimodal):
        want = GenerationConfig.from_model_config(hf).eos_token_id
        assert config_from_transformers(hf.to_dict()).eos_token_ids == (() if want is None else (want,))


def test_end_of_sequence_ids_the_model_cannot_emit_are_warned_about_and_ignored():
    """transformers warns about an id outside the vocabulary and keeps it (it never fires); an id in the head's
    padding (120..127 here) is never emitted either."""
    config = _hf_config().to_dict()
    with pytest.warns(UserWarning, match=r"the Inkling config: eos_token_id \[120, 500\] outside \[0, 120\)"):
        assert config_from_transformers({**config, "eos_token_id": [3, 120, 500]}).eos_token_ids == (3,)
    for bad in ("2", 2.0, True, [1, None]):
        with pytest.raises(TypeError, match="eos_token_id must be null, a token id or a list of them"):
            config_from_transformers({**config, "eos_token_id": bad})


def test_a_generation_configs_end_of_sequence_ids_replace_the_configs_unread():
    """With a generation_config.json, its ``eos_token_id`` is the one ``generate`` reads (none if it has
    none); config.json's is not read at all, so an id there that the model cannot emit draws no warning."""
    config = {**_hf_config().to_dict(), "eos_token_id": [3, 500]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_transformers(config, generation_config={"eos_token_id": 4}).eos_token_ids == (4,)
        assert config_from_transformers(config, generation_config={}).eos_token_ids == ()
    with pytest.warns(UserWarning, match=r"generation_config.json: eos_token_id \[120\] outside \[0, 120\)"):
        assert config_from_transformers(config, generation_config={"eos_token_id": [120, 5]}).eos_token_ids == (5,)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mlp_layer_types=("dense",)), r"mlp_layer_types must give 'dense' or 'sparse' for each of the 2 layers"),
        (dict(layer_types=("sliding", "local")), r"layer_types must be 'sliding' or 'global'"),
        # was accepted: the runner failed in the allocator ("no layer with get_kv_cache_spec()")
        (dict(layer_types=()), r"layer_types must name at least one layer \(num_hidden_layers >= 1\)"),
        (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) must be in 0..n_routed_experts \(4\)"),
        (dict(num_experts_per_tok=-1), r"num_experts_per_tok \(-1\) must be in 0..n_routed_experts \(4\)"),
        # transformers cannot run that either (its router's histogram needs a bin)
        (dict(n_routed_experts=0, num_experts_per_tok=0), r"n_routed_experts must be >= 1, got 0"),
        (dict(n_shared_experts=0), r"sparse MLP layers need n_shared_experts >= 1"),
        (dict(unpadded_vocab_size=0), r"unpadded_vocab_size must be None or >= 1, got 0"),
        (dict(num_heads=3), r"global layers: query heads \(3\) must be a multiple of KV heads \(2\)"),
        # were accepted: a ZeroDivisionError, a failure mid-step, NaN outputs ((pos + 1) / 0 scaling)
        (dict(num_kv_heads=0), r"num_kv_heads must be >= 1, got 0"),
        (dict(rel_extent=0), r"rel_extent must be >= 1, got 0"),
        (dict(num_speculative_tokens=-1), r"num_speculative_tokens must be >= 0, got -1"),
        (dict(log_scaling_n_floor=0), r"log_scaling_n_floor must be None \(no log scaling\) or nonzero, got 0"),
        (dict(rms_norm_eps=-1e-6), r"rms_norm_eps must be >= 0"),
        # were accepted: transformers cannot build a negative width either (a RuntimeError at model build)
        (dict(d_rel=-1), r"d_rel must be >= 0, got -1"),
        (dict(mlp_layer_types=("dense", "sparse"), intermediate_size=-1), r"^intermediate_size must be >= 0, got -1"),
        (dict(moe_intermediate_size=-1), r"moe_intermediate_size must be >= 0, got -1"),
        # a stop id in the head's padding is never emitted
        (dict(unpadded_vocab_size=120, eos_token_ids=(3, 120)), r"eos_token_ids: token ids must be in \[0, 120\)"),
    ],
)
def test_bad_inkling_configs_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        InklingConfig(**kwargs)


INT_FIELDS = (
    "vocab_size", "unpadded_vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "swa_num_heads",
    "swa_num_kv_heads", "swa_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "conv_kernel_size", "sliding_window", "d_rel", "rel_extent",
    "log_scaling_n_floor", "block_size", "num_speculative_tokens",
)


@pytest.mark.parametrize(
    "name, value",
    # An int-valued float in every int field (used or not: transformers' strict config refuses it anywhere);
    # were accepted: the value checks passed 2.0, and an unused field was never read. Then each other kind.
    [(name, 2.0) for name in INT_FIELDS]
    + [(name, value) for name in ("hidden_size", "unpadded_vocab_size", "intermediate_size")
       for value in (True, "2", InklingStream.ATTN_OUT)],
    ids=lambda arg: arg if isinstance(arg, str) and arg in INT_FIELDS else type(arg).__name__,
)
def test_inkling_int_fields_refuse_other_types(name, value):
    with pytest.raises(TypeError, match=rf"^{name} must be an int( or None)?, got {type(value).__name__}$"):
        InklingConfig(**{name: value})


@pytest.mark.parametrize("name", ["route_scale", "log_scaling_alpha", "logits_mup_width_multiplier", "rms_norm_eps"])
@pytest.mark.parametrize("value", [None, "2.0", True, float("nan"), float("inf")], ids=["none", "str", "bool", "nan", "inf"])
def test_inkling_float_fields_refuse_other_types_and_non_finite_values(name, value):
    """A config.json's null or string in a float field loaded, and failed only in the first forward
    (transformers' strict config refuses them); NaN and inf never failed."""
    error = ValueError if type(value) is float else TypeError
    with pytest.raises(error, match=rf"^{name} must be (a float, got|finite, got)"):
        InklingConfig(**{name: value})


def test_inkling_float_fields_refuse_an_int_past_float_and_a_zero_logits_multiplier():
    with pytest.raises(ValueError, match="route_scale must be finite"):
        InklingConfig(route_scale=10**400)  # an OverflowError from math.isfinite before
    with pytest.raises(ValueError, match="logits_mup_width_multiplier divides the logits"):
        InklingConfig(logits_mup_width_multiplier=0)


# -- fp32, no cache -----------------------------------------------------------------------------------


def test_checkpoint_is_sharded_and_keeps_sconv_weights_fp32(checkpoint, hf16):
    assert (checkpoint / "model.safetensors.index.json").exists()
    assert len(set(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    model = load_inkling(checkpoint)
    layer = model.layers[1]
    assert {p.dtype for name, p in model.named_parameters() if name.split(".")[-1].startswith("conv_")} == {torch.float32}
    assert layer.mlp.gate.global_scale.dtype == layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.q_proj.weight.dtype == torch.bfloat16
    # Loaded, not initialised: the same bits as transformers' bf16 model (whose sconv weights are fp32 too).
    assert hf16.model.layers[1].attn_sconv.conv1d.weight.dtype == torch.float32
    assert torch.equal(layer.conv_attn, hf16.model.layers[1].attn_sconv.conv1d.weight[:, 0])
    assert torch.equal(layer.mlp.experts_down, hf16.model.layers[1].mlp.experts.down_proj)


def test_every_layer_equals_transformers_in_fp32(checkpoint, hf32):
    _every_layer_equals_transformers_in_fp32(checkpoint, hf32)


def _every_layer_equals_transformers_in_fp32(checkpoint, hf32, length: int = 21) -> None:
    model = load_inkling(checkpoint, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (length,))
    io, want_logits = _layer_io(hf32, ids)
    with torch.no_grad():
        assert torch.equal(model.embed(ids), io[0][0])  # the normed embedding, bitwise
        x = io[0][0]
        for index, (layer, (hf_in, hf_out)) in enumerate(zip(model.layers, io)):
            got = inkling_layer_reference(layer, hf_in)
            err = (got - hf_out).abs().max() / hf_out.abs().max()
            assert err <= FP32_LAYER, f"layer {index} ({layer.kind}, {layer.mlp_kind}): relative error {err:.3g}"
            x = inkling_layer_reference(layer, x)
        logits = model.logits(x)
    assert logits.shape == want_logits.shape == (length, model.config.output_vocab_size)
    torch.testing.assert_close(logits, want_logits, atol=FP32_LAYER * want_logits.abs().max(), rtol=0)


def test_parts_with_the_same_arithmetic_are_bitwise_in_fp32(checkpoint, hf32):
    """RMSNorm, the dense MLP, the router, the shared experts, the relative bias with log scaling and the
    attention itself: bitwise against transformers' modules on the same inputs."""
    model = load_inkling(checkpoint, dtype=torch.float32)
    x = torch.randn(13, 64)
    with torch.no_grad():
        norm = InklingRMSNorm(64, 1e-6, torch.float32)
        norm.weight.copy_(hf32.model.norm.weight)
        assert torch.equal(norm(x), hf32.model.norm(x))
        assert torch.equal(model.layers[0].mlp(x), hf32.model.layers[0].mlp(x[None])[0])
        router, hf_moe = model.layers[1].mlp.gate, hf32.model.layers[1].mlp
        weights, gammas = router(x)
        _, hf_weights, hf_chosen, hf_gammas = hf_moe.gate(x[None])
        assert torch.equal(weights, torch.zeros_like(weights).scatter(1, hf_chosen, hf_weights))
        assert torch.equal(gammas, hf_gammas)
        assert torch.equal(model.layers[1].mlp._shared(x, gammas), hf_moe.shared_experts(x[None], gammas=hf_gammas)[0])
        for index in (0, 1):  # sliding (extent = window) and global (extent 12, log-scaled from position 4)
            layer, attn = model.layers[index], hf32.model.layers[index].self_attn
            _attention_is_bitwise(layer, attn, x)


@pytest.mark.parametrize("experts, top_k", [(16, 4), (9, 5), (8, 8)])
def test_router_is_bitwise_for_other_expert_counts(experts, top_k):
    """The router against transformers' ``InklingTopkRouter`` where k > 2: the softmax sums the chosen
    logits in ``topk(sorted=False)``'s order, which a sorted top-k changes (seen: 16 experts, top-4)."""
    from transformers.models.inkling.modeling_inkling import InklingTopkRouter

    edit = {"n_routed_experts": experts, "num_experts_per_tok": top_k}
    hf_router = InklingTopkRouter(_hf_config({**HF_CONFIG, **edit}))
    router = InklingModel(config_from_transformers(_hf_config({**HF_CONFIG, **edit}).to_dict()), dtype=torch.float32)
    router = router.layers[1].mlp.gate
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=gen))
        hf_router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
        router.load_state_dict(hf_router.state_dict())
        x = torch.randn(64, HF_CONFIG["hidden_size"], generator=gen) * 0.1
        weights, gammas = router(x)
        _, hf_weights, hf_chosen, hf_gammas = hf_router(x[None])
    assert torch.equal(weights, torch.zeros_like(weights).scatter(1, hf_chosen, hf_weights))
    assert torch.equal(gammas, hf_gammas)


def test_parts_with_the_same_arithmetic_are_bitwise_in_bf16(checkpoint, hf16):
    """The same pieces in bf16, where the rounding order shows: transformers' RMSNorm rounds the normed
    input to bf16 before the bf16 weight multiply, the dense MLP multiplies by ``global_scale`` in bf16, and
    the log scaling of the query and the bias is fp32 rounded once. An fp32 layer cannot tell these orders
    apart, and the bf16 step test's tolerance (twice transformers' own bf16 error) is far wider than the one
    ulp they move (seen: an fp32 norm weight multiply, a bf16 log-scale multiply and an fp32 MLP scale all
    passed every other oracle test)."""
    model = load_inkling(checkpoint)
    x = torch.randn(13, 64).to(torch.bfloat16)
    with torch.no_grad():
        for norm, hf_norm in ((model.norm, hf16.model.norm), (model.embed_norm, hf16.model.embed_tokens.embed_norm)):
            assert torch.equal(norm(x), hf_norm(x))
        assert torch.equal(model.layers[0].mlp(x), hf16.model.layers[0].mlp(x[None])[0])
        assert torch.equal(model.layers[1].mlp(x), hf16.model.layers[1].mlp(x[None])[0])  # router, experts, shared
        for index in (0, 1):
            _attention_is_bitwise(model.layers[index], hf16.model.layers[index].self_attn, x, compare_output=False)
        # Past log_scaling_n_floor (4) the global layer's query and bias are scaled: positions up to 12 here.
        assert model.layers[1].log_scaling


def _attention_is_bitwise(layer, attn, x: torch.Tensor, compare_output: bool = True) -> None:
    """Transformers' attention forward (no cache, eager) vs stepops' pieces on the same projections
    (``compare_output``: the attention output too, within ``FP32_LAYER``; fp32 only)."""
    from transformers.models.inkling import modeling_inkling as hf_module

    length = x.shape[0]
    position = torch.arange(length)
    captured = {}

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, position_bias=None, **kwargs):
        captured.update(query=query, key=key, value=value, bias=position_bias, scaling=scaling)
        return hf_module.eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, position_bias)

    mask = torch.full((length, length), float("-inf")).triu(1)
    if layer.sliding_window is not None:
        mask = mask.masked_fill(torch.ones(length, length, dtype=torch.bool).tril(-layer.sliding_window), float("-inf"))
    original = hf_module.ALL_ATTENTION_FUNCTIONS.get_interface
    hf_module.ALL_ATTENTION_FUNCTIONS.get_interface = lambda *a: eager
    try:
        want = attn(x[None], attention_mask=mask[None, None])[0][0]
    finally:
        hf_module.ALL_ATTENTION_FUNCTIONS.get_interface = original
    assert captured["scaling"] == 1.0 / layer.head_dim
    q = layer.scaled_query(layer.q_norm(layer.q_proj(x).view(length, layer.num_heads, -1)), position)
    assert torch.equal(q, captured["query"][0].transpose(0, 1))
    table = layer.relative_bias_table(x, position)
    # The dense bias transformers built, read back from the table: entry d at distance d, 0 elsewhere.
    distance = position[:, None] - position[None, :]
    dense = table.gather(-1, distance.clamp(0, table.shape[-1] - 1)[:, None, :].expand(-1, layer.num_heads, -1))
    dense = dense.masked_fill(((distance < 0) | (distance >= table.shape[-1]))[:, None], 0.0)
    assert torch.equal(dense.transpose(0, 1), captured["bias"][0])
    if not compare_output:
        return
    key = captured["key"][0].transpose(0, 1)[None].expand(length, -1, -1, -1)
    value = captured["value"][0].transpose(0, 1)[None].expand(length, -1, -1, -1)
    allowed = mask == 0
    got = masked_attention(q, key, value, allowed, 1.0 / layer.head_dim, rel_bias=table, position=position)
    # Both compute matmul * scale + bias and a softmax in fp32; the weighted sums reduce in another order.
    torch.testing.assert_close(layer.o_proj(got.flatten(1)), want, atol=FP32_LAYER * want.abs().max(), rtol=0)


# -- bf16 steps through the caches ------------------------------------------------------------------------


class _LayerTap:
    """Record every stepops decoder layer's output rows during steps."""

    def __init__(self, model) -> None:
        self.outputs: list[torch.Tensor] = []
        self.hooks = [layer.register_forward_hook(lambda m, a, out: self.outputs.append(out.clone())) for layer in model.layers]

    def take(self) -> list[torch.Tensor]:
        taken, self.outputs = self.outputs, []
        return taken


def test_steps_equal_transformers_in_bf16(checkpoint, hf16, hf32):
    """Ragged chunked prefill, decode and verify steps with rejected drafts: every committed token's layer
    outputs and logits vs transformers on the whole sequence."""
    _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32)


def _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32) -> None:
    model = load_inkling(checkpoint)
    runner = StepRunner(model, max_requests=3, max_model_len=40, max_tokens=16, device="cpu", inputs=TOKENS)
    tap = _LayerTap(model)
    rng = random.Random(0)
    lengths = (31, 17, 24)
    truth = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    layers = len(model.layers)
    widths = [model.config.hidden_size] * layers + [model.config.output_vocab_size]
    got = [[torch.full((n, width), float("nan")) for width in widths] for n in lengths]
    committed, rejected = [0, 0, 0], 0
    prompt = (20, 5, 11)
    while any(c < n for c, n in zip(committed, lengths)):
        batch, plans, room = [], [], 16
        for i, c in enumerate(committed):
            if c >= lengths[i] or room == 0:
                continue
            if c < prompt[i]:
                count = min(prompt[i] - c, room, 7)  # chunks of up to 7: prompts take 1-3 steps
                rows, commit = truth[i][c : c + count], count
            else:
                drafts = min(3, room - 1) if (c + i) % 2 else 0
                accept = rng.randint(0, drafts)
                commit = min(1 + accept, lengths[i] - c)
                wrong = [(t + 1 + rng.randrange(VOCAB - 1)) % VOCAB for t in truth[i][c : c + 1 + drafts]]
                rows = (truth[i][c : c + 1 + accept] + wrong)[: 1 + drafts]
                rows += wrong[len(rows) :]
                rows = rows + [0] * (1 + drafts - len(rows))
                rejected += len(rows) - commit
            room -= len(rows)
            batch.append(ScheduledRequest(i, c, torch.tensor(rows)))
            plans.append((i, c, commit))
        logits = runner.step(batch)
        outs = tap.take()
        start = 0
        for (i, c, commit), scheduled, row_logits in zip(plans, batch, logits):
            for j, out in enumerate(outs):
                got[i][j][c : c + commit] = out[start : start + commit].float()
            got[i][layers][c : c + commit] = row_logits[:commit].float()
            start += len(scheduled.inputs)
            committed[i] = c + commit
    assert rejected > 0
    excluded = compared = 0
    for i, tokens in enumerate(truth):
        ids = torch.tensor(tokens)
        io32, logits32 = _layer_io(hf32, ids)
        io16, logits16 = _layer_io(hf16, ids)
        wants = [y for _, y in io32] + [logits32]
        hf16s = [y.float() for _, y in io16] + [logits16.float()]
        keep = _rows_without_routing_near_ties(hf32, ids)
        for j, (mine, want, hf) in enumerate(zip(got[i], wants, hf16s)):
            what = f"request {i} " + (f"layer {j}" if j < layers else "logits")
            rows = keep[min(j, layers - 1)]
            excluded += int((~rows).sum())
            compared += len(rows)
            mine, want, hf = mine[rows], want[rows], hf[rows]
            for name, norm in (("max", lambda e: e.abs().max()), ("rms", lambda e: e.pow(2).mean().sqrt())):
                err, hf_err = norm(mine - want), norm(hf - want)
                assert err <= BF16_FACTOR * hf_err, f"{what}: {name} error {err:.3g}, transformers' bf16 {hf_err:.3g}"
    assert excluded <= MAX_NEAR_TIE_FRACTION * compared, f"{excluded} of {compared} rows left out"


def _rows_without_routing_near_ties(hf32, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, ``[L]`` bool: the rows whose output cannot depend on a routing near tie.

    A token whose k-th and (k + 1)-th expert choice scores (transformers' fp32) are within
    ``ROUTING_NEAR_TIE`` may be routed either way by two correct bf16 models, and the other expert changes
    its MLP output by O(1). That reaches its own row and the next ``W - 1`` (the MLP-output conv) in that
    layer, and every later row of the request in later layers (their attention reads it).
    """
    scores, hooks = {}, []
    for j, layer in enumerate(hf32.model.layers):
        if hasattr(layer.mlp, "gate"):
            def record(module, args, out, j=j):
                logits = torch.nn.functional.linear(args[0][0].float(), module.weight.float())
                scores[j] = logits.sigmoid()[:, : module.num_experts] + module.e_score_correction_bias
            hooks.append(layer.mlp.gate.register_forward_hook(record))
    try:
        with torch.no_grad():
            hf32(ids[None])
    finally:
        for hook in hooks:
            hook.remove()
    length, width, top_k = len(ids), hf32.config.conv_kernel_size, hf32.config.num_experts_per_tok
    later = torch.zeros(length, dtype=torch.bool)
    keep = []
    for j in range(len(hf32.model.layers)):
        here = torch.zeros(length, dtype=torch.bool)
        if j in scores and 0 < top_k < scores[j].shape[-1]:  # (k = 0 or k = n_routed_experts: no choice to flip)
            ranked = scores[j].sort(-1, descending=True).values
            near = ranked[:, top_k - 1] - ranked[:, top_k] < ROUTING_NEAR_TIE
            for t in near.nonzero().flatten().tolist():
                here[t : t + width] = True
            keep.append(~(here | later))
            later |= near.cumsum(0) > 0
        else:
            keep.append(~later)
    return keep


# -- other configurations ---------------------------------------------------------------------------------

# Configs transformers accepts that differ from HF_CONFIG where stepops once refused them: only the layer kinds
# in use are validated (transformers builds no others), and an unpadded_vocab_size above vocab_size keeps
# every logit (transformers slices only below). Each also varies the geometry: MQA and GQA 4, k = E, k = 1 and
# k = 0 routing, W = 3 and W = 2, no log scaling, a window of 3, no muP divisor.
CONFIG_VARIANTS = {
    "all_global_unused_swa_geometry": dict(
        layer_types=["hybrid", "hybrid"], mlp_layer_types=["sparse", "dense"], num_hidden_layers=2,
        num_key_value_heads=1, swa_num_attention_heads=4, swa_num_key_value_heads=3, sliding_window_size=0,
        n_routed_experts=3, num_experts_per_tok=3, conv_kernel_size=3, log_scaling_n_floor=None,
        unpadded_vocab_size=200,
    ),
    "all_sliding_unused_global_geometry": dict(
        layer_types=["hybrid_sliding", "hybrid_sliding"], mlp_layer_types=["dense", "sparse"], num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=3, rel_extent=0, log_scaling_n_floor=0,
        swa_num_attention_heads=8, swa_num_key_value_heads=2, sliding_window_size=3,
        num_experts_per_tok=1, conv_kernel_size=2, logits_mup_width_multiplier=1.0,
    ),
    # hidden 64 over 3 sliding KV heads: chunks of 22, the last one padded by 2 zero channels.
    "hidden_not_divisible_by_kv_heads": dict(swa_num_attention_heads=6, swa_num_key_value_heads=3),
    # top-0 routing: every token gets only the shared experts (stepops refused it; transformers runs it).
    "shared_experts_only": dict(num_experts_per_tok=0),
}


@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_config_variants_equal_transformers(variant, tmp_path):
    config = {**HF_CONFIG, **CONFIG_VARIANTS[variant]}
    checkpoint = _save(tmp_path, lambda shape: torch.randn(shape) * 0.5, config)
    hf32, hf16 = _hf(checkpoint, torch.float32), _hf(checkpoint, torch.bfloat16)
    _every_layer_equals_transformers_in_fp32(checkpoint, hf32)
    _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32)


def test_a_negative_log_scaling_floor_scales_by_one_as_in_transformers(tmp_path):
    """transformers' ``clamp(min=1)`` makes a negative floor scale the global layers by exactly 1 (it was
    refused); fp32 layer by layer, the bf16 steps being no different from HF_CONFIG's."""
    config = {**HF_CONFIG, "log_scaling_n_floor": -3}
    checkpoint = _save(tmp_path, lambda shape: torch.randn(shape) * 0.5, config)
    assert load_inkling(checkpoint).layers[1].log_scaling
    _every_layer_equals_transformers_in_fp32(checkpoint, _hf(checkpoint, torch.float32))


# 16 routed experts, top-2: steps of up to 7 tokens run only the chosen experts (``T * k < E``), so the
# decode and verify steps here (padded to 2 or 4) take that path and the prefill steps (8, 16) the
# all-experts one, both against transformers. With 16 scores the k-th and next lie closer than with 4: a
# correction bias of std 0.5 left 26% of the rows out as routing near ties, std 1.25 leaves 10% (30 of
# 288) while tokens still pick different pairs (5 experts in 4 pairs over 40 random inputs of layer 2).
SMALL_STEP_CONFIG = dict(n_routed_experts=16)
SMALL_STEP_BIAS_STD = 1.25


def test_small_steps_run_only_the_chosen_experts_and_equal_transformers(tmp_path, monkeypatch):
    from stepops.models.inkling import InklingMoE

    taken = []
    chosen = InklingMoE.chosen_experts
    monkeypatch.setattr(InklingMoE, "chosen_experts", lambda self, *a: (taken.append(a[0].shape[0]), chosen(self, *a))[1])
    checkpoint = _save(tmp_path, lambda shape: torch.randn(shape) * SMALL_STEP_BIAS_STD, {**HF_CONFIG, **SMALL_STEP_CONFIG})
    hf32, hf16 = _hf(checkpoint, torch.float32), _hf(checkpoint, torch.bfloat16)
    _every_layer_equals_transformers_in_fp32(checkpoint, hf32, length=5)  # no cache: T = 5 per layer
    assert taken == [5, 5, 5, 5], taken  # each sparse layer twice (its own input, then the stack's)
    taken.clear()
    _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32)
    assert taken and set(taken) <= {2, 4}, taken  # (T = 1 never: the runner pads a lone token to 2)
    assert len(taken) >= 2 * 4, f"{len(taken) // 2} small steps (two sparse layers each)"


# Configs transformers builds at the edges of stepops' value checks: zero-width relative states and MLPs (which
# transformers also runs; its grouped-GEMM experts refuse zero width on CPU, its eager ones do not), and any
# int in the fields of an MLP kind no layer uses.
EDGE_CONFIGS = {
    "zero_widths": dict(d_rel=0, intermediate_size=0, moe_intermediate_size=0),
    "all_sparse_unused_dense_width": dict(mlp_layer_types=["sparse"] * 3, intermediate_size=-5),
    "all_dense_unused_experts": dict(
        mlp_layer_types=["dense"] * 3, moe_intermediate_size=-5, n_routed_experts=-1, num_experts_per_tok=-2,
        n_shared_experts=-1,
    ),
}


@pytest.mark.parametrize(
    "edit",
    [{}, *CONFIG_VARIANTS.values(), SMALL_STEP_CONFIG, *EDGE_CONFIGS.values()],
    ids=["oracle", *CONFIG_VARIANTS, "small_step", *EDGE_CONFIGS],
)
def test_configs_transformers_builds_stepops_builds(edit):
    """The oracle tests' configs and the edge cases above: transformers builds the model, and so does stepops
    from transformers' config dict (what ``save_pretrained`` writes)."""
    hf_config = _hf_config({**HF_CONFIG, **edit})
    InklingForCausalLM(hf_config)
    InklingModel(config_from_transformers(hf_config.to_dict()))


# -- greedy generation ------------------------------------------------------------------------------------

# Two prompts whose greedy continuations have no near tie: at every one of the 32 steps transformers'
# fp32 top logit leads the next by >= GREEDY_MARGIN (checked below), several times the bf16 logit error
# (~0.05 here). Two correct bf16 models may break a closer tie either way, and on random weights one in a
# few 32-token runs meets one; these prompts were picked from seeded random ones for their margin.
PROMPTS = ([79, 24, 51, 104, 85, 48, 112, 81, 117, 1, 40, 59], [88, 13, 3, 79, 84, 60, 99])
NEW_TOKENS = 32
GREEDY_MARGIN = 0.15


@pytest.fixture(scope="module")
def hf_gen16(gen_checkpoint):
    return _hf(gen_checkpoint, torch.bfloat16)


def _hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    """transformers' greedy new tokens for one prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_tokens(gen_checkpoint, hf_gen16):
    """transformers' greedy tokens for each prompt (bf16), after checking their margins in fp32."""
    hf32 = _hf(gen_checkpoint, torch.float32)
    out = []
    for prompt in PROMPTS:
        tokens = _hf_generate(hf_gen16, prompt)
        with torch.no_grad():
            logits = hf32(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        top = logits.topk(2, dim=-1).values
        assert logits.argmax(-1).tolist() == tokens, "transformers' fp32 and bf16 greedy tokens differ"
        assert (top[:, 0] - top[:, 1]).min() >= GREEDY_MARGIN, "a greedy step of the test prompts is a near tie"
        out.append(tokens)
    return out


def _generate(path, mode=EAGER, backend="aot_eager", draft=None, stop_tokens=None):
    """Greedy tokens from stepops and the number of steps taken."""
    model = load_inkling(path)
    runner = StepRunner(
        model, max_requests=2, max_model_len=64, max_tokens=16, device="cpu", mode=mode, compile_backend=backend, inputs=TOKENS
    )
    return runner.generate(PROMPTS, NEW_TOKENS, draft=draft, stop_tokens=stop_tokens), runner.steps


def test_greedy_generation_equals_transformers(gen_checkpoint, hf_tokens):
    assert len(set(map(len, PROMPTS))) == 2 and all(len(t) == NEW_TOKENS for t in hf_tokens)
    tokens, steps = _generate(gen_checkpoint)
    assert tokens == hf_tokens
    # 19 prompt tokens, 16 per step: the second prompt's prefill is split over two steps (the second also
    # decodes the first prompt's second token), then one step per token.
    assert steps == NEW_TOKENS + 1


def test_compiled_generation_equals_transformers_one_graph(gen_checkpoint, hf_tokens):
    counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    assert _generate(gen_checkpoint, COMPILED, backend)[0] == hf_tokens
    assert backend.frame_count == 1, f"{backend.frame_count} graphs"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_speculative_generation_with_rejections_emits_the_same_tokens(gen_checkpoint, hf_tokens):
    """Drafts of 3 from the true continuation, one in three corrupted: verify steps reject the rest and the
    next step overwrites the rejected rows in both caches."""
    corrupted = []

    def draft(i: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(PROMPTS[i])
        proposal = hf_tokens[i][done : done + 3]
        if (done + i) % 3 == 1 and proposal:
            proposal[len(proposal) // 2] = (proposal[len(proposal) // 2] + 1) % 120
            corrupted.append(i)
        return proposal

    tokens, steps = _generate(gen_checkpoint, draft=draft)
    assert tokens == hf_tokens
    assert len(corrupted) >= 4 and steps < NEW_TOKENS // 2  # drafts were rejected, and many accepted


def test_generation_stops_at_a_stop_token_as_transformers_stops_at_eos(gen_checkpoint, hf_gen16, hf_tokens):
    """Each prompt's continuation holds one of two stop tokens partway (transformers' ``eos_token_id``):
    that request ends with it and the other goes on. With drafts from the true continuation, a verify step
    accepts the stop token and drafts after it, and those are not emitted."""
    stops = [hf_tokens[0][9], hf_tokens[1][20]]
    want = [_hf_generate(hf_gen16, prompt, eos_token_id=stops) for prompt in PROMPTS]
    assert len(want[0]) != len(want[1]) and max(map(len, want)) < NEW_TOKENS

    def draft(i: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(PROMPTS[i])
        return hf_tokens[i][done : done + 3]

    assert _generate(gen_checkpoint, stop_tokens=stops)[0] == want
    assert _generate(gen_checkpoint, draft=draft, stop_tokens=stops)[0] == want


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_generation_stops_at_the_checkpoints_eos_by_default_as_transformers_does(gen_checkpoint, hf_tokens, tmp_path, where):
    """Without ``stop_tokens``, ``generate`` stops where transformers' ``generate`` stops by default: at
    config.json's ``eos_token_id``, or at generation_config.json's when that file is there (it wins over
    config.json's, here an id neither continuation emits). ``stop_tokens=()`` runs to ``max_new_tokens``."""
    never = min(set(range(HF_CONFIG["unpadded_vocab_size"])) - set(hf_tokens[0] + hf_tokens[1]))
    in_config = hf_tokens[0][9] if where == "config.json" else never
    path = single_file_copy(gen_checkpoint, tmp_path, config_edit=lambda config: config.update(eos_token_id=in_config))
    if where == "generation_config.json":
        (path / where).write_text(json.dumps({"eos_token_id": [never, hf_tokens[1][20]]}))
    hf = _hf(path, torch.bfloat16)
    want = [_hf_generate(hf, prompt) for prompt in PROMPTS]
    assert min(map(len, want)) < NEW_TOKENS
    assert _generate(path)[0] == want
    assert _generate(path, stop_tokens=())[0] == hf_tokens

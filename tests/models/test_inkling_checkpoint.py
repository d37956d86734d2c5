"""Loading a transformers Inkling checkpoint, and the config checks, against what transformers reads.

The checkpoint is a tiny random ``InklingForCausalLM`` that transformers 5.23.0 saved (sharded), as in
``test_inkling_oracle``, which checks the loaded model's numbers; here, what ``load_inkling`` and
``config_from_transformers`` read from it: the weights (one file or shards, stale shards, ignored towers),
the config's names, aliases and derived layer kinds as ``InklingTextConfig`` reads them, the end-of-sequence
ids as ``generate`` reads them, and the errors for what stepops cannot run (each naming the file, weight or
field). ``InklingConfig``'s own checks end the module.
"""

from __future__ import annotations

import json
import shutil
import warnings
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from inkling_oracle_helpers import HF_CONFIG, VOCAB, save_random_inkling, single_file_copy
from transformers import GenerationConfig, InklingForCausalLM, InklingTextConfig  # the test extra pins 5.23.0
from transformers import InklingConfig as HFInklingConfig

from stepops.layouts import InklingStream
from stepops.models.checkpoint_files import SafetensorsCheckpoint
from stepops.models.inkling import InklingConfig, InklingModel, shard_inkling_state_dict
from stepops.models.inkling_checkpoint import config_from_transformers, load_inkling
from stepops.models.runner import ScheduledRequest, StepRunner
from stepops.models.tensor_parallel import spawn_ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_inkling(tmp_path_factory.mktemp("inkling"))


# -- loading ---------------------------------------------------------------------------------------------


def test_the_checkpoint_is_read_and_cast_one_tensor_at_a_time(checkpoint, monkeypatch):
    """load_inkling read every tensor, cast it to the model's dtype and fused the K and V halves before it
    allocated the model: host memory held that copy of the checkpoint beside the model (in a probe, an fp32
    checkpoint loaded in bf16 peaked at 2.2x the model's size in anonymous memory; 1.2x now). Each tensor is now read as it is copied:
    when one is read, the only earlier ones still held are K halves (a layer's k_proj, k_sconv) waiting
    for their V halves, which come after them in the files."""
    read, keys, held, most_held = SafetensorsCheckpoint.read, [], [], 0

    def counted_read(self, key):
        nonlocal most_held
        tensor = read(self, key)
        keys.append(key)
        held.append(weakref.ref(tensor))
        most_held = max(most_held, sum(ref() is not None for ref in held))
        return tensor

    monkeypatch.setattr(SafetensorsCheckpoint, "read", counted_read)
    load_inkling(checkpoint)
    weight_map = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(keys)) == sorted(weight_map)
    assert most_held <= 3


def test_a_loaded_model_has_a_built_models_layouts_and_dtypes(checkpoint):
    """load_inkling builds on the meta device and allocates once: every parameter keeps the strides a
    built model gives it (the conv weights tap-major, which the Triton kernel's vector loads rely on)."""
    loaded, built = load_inkling(checkpoint), InklingModel(config_from_transformers(json.loads((checkpoint / "config.json").read_text())))
    assert loaded.built_dtypes == built.built_dtypes
    assert [(n, p.stride()) for n, p in loaded.named_parameters()] == [(n, p.stride()) for n, p in built.named_parameters()]
    assert all(p.device.type == "cpu" for p in loaded.parameters())


def test_the_serving_settings_reach_the_loaded_model_and_leave_its_outputs(checkpoint):
    """num_speculative_tokens sets the attention's query tile (load_step5 takes it too; load_inkling had no
    way to set it): a verify step of 1 + 7 tokens gives the same bits with either tile (and with either
    chunk size: these 12 keys are one chunk with both)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (12,))
    logits = []
    for kwargs in (dict(), dict(block_size=32, num_speculative_tokens=7, attention_keys_per_chunk=32)):
        model = load_inkling(checkpoint, **kwargs)
        settings = (model.config.block_size, model.config.num_speculative_tokens, model.config.attention_keys_per_chunk)
        assert settings == (
            kwargs.get("block_size", 16), kwargs.get("num_speculative_tokens", 3), kwargs.get("attention_keys_per_chunk", 1024)
        )
        runner = StepRunner(model, max_requests=1, max_model_len=16, max_tokens=8, device="cpu", inputs="tokens")
        runner.step([ScheduledRequest(0, 0, ids[:4])])
        logits.append(runner.step([ScheduledRequest(0, 4, ids[4:])])[0])
    assert torch.equal(*logits)


def test_one_file_loads_like_the_shards(checkpoint, tmp_path):
    sharded, single = load_inkling(checkpoint).state_dict(), load_inkling(single_file_copy(checkpoint, tmp_path)).state_dict()
    assert sharded.keys() == single.keys() and all(torch.equal(sharded[k], single[k]) for k in sharded)


def _load_this_ranks_shard(rank: int, tp_size: int, sharding: Path, one_kv_head: Path) -> None:
    """One rank of the test below (asserts raise in the parent through ``spawn_ranks``)."""
    torch.set_num_threads(1)  # two ranks on two shared cores
    group = dist.group.WORLD
    got = load_inkling(sharding, process_group=group)
    whole = load_inkling(sharding)
    want = shard_inkling_state_dict(whole.state_dict(), whole.config, tp_rank=rank, tp_size=tp_size)
    # The documented way to shard (docs/tensor-parallel.md), which test_tensor_parallel checks against tp = 1:
    # its built strides, and below the same step gives the same bits (the collectives run on both ranks).
    sharded = InklingModel(whole.config, process_group=group)
    sharded.load_state_dict(want)
    strides = {name: t.stride() for name, t in sharded.state_dict().items()}
    state = got.state_dict()
    assert state.keys() == want.keys()
    for name, tensor in state.items():
        assert tensor.device.type == "cpu" and tensor.dtype == want[name].dtype, name
        assert torch.equal(tensor, want[name]) and tensor.stride() == strides[name], name
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (got, sharded):
        runner = StepRunner(model, max_requests=1, max_model_len=16, max_tokens=16, device="cpu", inputs="tokens")
        logits.append(runner.step([ScheduledRequest(0, 0, ids)])[0])
    assert torch.equal(*logits)
    with pytest.raises(ValueError, match=r"tp_size <= num_kv_heads \(1\), got 2"):
        load_inkling(one_kv_head, process_group=group)  # it has no weights: refused before they are read


def test_each_rank_loads_its_shard_of_a_checkpoint(checkpoint, tmp_path):
    """``load_inkling(process_group=)`` on two gloo ranks: each holds exactly ``shard_inkling_state_dict``'s
    slice of the whole load (values, dtypes, the built strides) and steps to the same logits as a model sharded
    by hand from it; a config that does not shard (1 sliding KV head over 2 ranks) is refused before any
    weight is read."""
    sharding = save_random_inkling(tmp_path / "two_kv_heads", {**HF_CONFIG, "swa_num_key_value_heads": 2})
    one_kv_head = tmp_path / "one_kv_head"
    one_kv_head.mkdir()
    shutil.copy(checkpoint / "config.json", one_kv_head / "config.json")  # no weights at all
    spawn_ranks(_load_this_ranks_shard, 2, sharding, one_kv_head, timeout=timedelta(seconds=120))


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
        # was pathlib's TypeError "unsupported operand type(s) for /", naming no file
        (lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": 1}}'),
         r"index.json: weight_map\['model.norm.weight'\] must name a safetensors file, got 1"),
        (lambda p: (p / "config.json").unlink(), r"copy: no config.json \(expected a directory written by save_pretrained\)"),
        (lambda p: (p / "config.json").write_text("[]"), r"config.json: expected a JSON object, got list"),
        (lambda p: (p / "config.json").write_text("{"), r"config.json: not valid JSON"),
        (_truncate_first_shard, r"model-00001-of-\d+.safetensors: not a readable safetensors file"),
        (lambda p: [f.unlink() for f in p.glob("model*.safetensors*")],
         r"copy: no model.safetensors or model.safetensors.index.json"),
    ],
    ids=["no_weight_map", "weight_map_not_names", "no_config", "config_not_an_object", "config_not_json", "truncated_shard",
         "no_weights"],
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
        # [C, W] holds the same numbers, but transformers refuses it (its load checks nn.Conv1d's shape)
        (
            lambda t: t.update({"model.layers.1.attn_sconv.conv1d.weight": t["model.layers.1.attn_sconv.conv1d.weight"][:, 0]}),
            r"model.layers.1.attn_sconv.conv1d.weight: shape \(64, 4\) is not a short-conv weight, which is nn.Conv1d's depthwise \[channels, 1, kernel_size\]",
        ),
    ],
    ids=["missing", "unknown", "dense_weight_in_a_sparse_layer", "shape", "conv_weight_without_its_channel_dim"],
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
    hf_config = InklingTextConfig(**{k: v for k, v in HF_CONFIG.items() if k not in fields} | {"num_hidden_layers": 7})
    saved = {k: v for k, v in hf_config.to_dict().items() if k not in fields}
    config = config_from_transformers(saved)
    kinds = {"hybrid_sliding": "sliding", "hybrid": "global"}
    assert list(config.layer_types) == [kinds[t] for t in hf_config.layer_types]
    assert list(config.mlp_layer_types) == list(hf_config.mlp_layer_types)
    assert config.layer_types.count("global") == 1 and set(config.mlp_layer_types) == {"sparse"}


def test_layer_kinds_to_derive_need_num_hidden_layers():
    fields = ("layer_types", "num_hidden_layers")
    saved = {k: v for k, v in InklingTextConfig(**HF_CONFIG).to_dict().items() if k not in fields}
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


def test_a_zero_dense_intermediate_size_is_read_as_transformers_reads_it():
    """transformers swaps the widths whenever ``dense_intermediate_size`` is not None, a 0 included (every MLP
    sparse: no dense width is read)."""
    saved = InklingTextConfig(**HF_CONFIG).to_dict() | {"dense_intermediate_size": 0}
    saved["mlp_layer_types"] = ["sparse"] * HF_CONFIG["num_hidden_layers"]
    hf_config = InklingTextConfig(**saved)
    config = config_from_transformers(saved)
    assert (hf_config.intermediate_size, hf_config.moe_intermediate_size) == (0, HF_CONFIG["intermediate_size"])
    assert (config.intermediate_size, config.moe_intermediate_size) == (0, HF_CONFIG["intermediate_size"])


def test_an_alias_next_to_its_name_wins_as_in_transformers(checkpoint, tmp_path):
    path = single_file_copy(checkpoint, tmp_path, config_edit=_aliases_next_to_their_names)
    hf_config = InklingTextConfig.from_pretrained(path)
    config = config_from_transformers(json.loads((path / "config.json").read_text()))
    want = (hf_config.conv_kernel_size, hf_config.sliding_window_size, hf_config.n_routed_experts,
            hf_config.logits_mup_width_multiplier)  # fmt: skip
    assert want == (3, 5, 3, 4.0)
    assert (config.conv_kernel_size, config.sliding_window, config.n_routed_experts, config.logits_mup_width_multiplier) == want


# -- end-of-sequence ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("top, text", [(None, 5), (7, 5), (None, None), (7, None)])
def test_end_of_sequence_ids_are_read_as_transformers_generate_reads_them(top, text):
    """The ids ``generate`` stops at by default (without a generation_config.json): a text config's
    ``eos_token_id``; a multimodal config's own, else its text config's (transformers'
    ``GenerationConfig.from_model_config``)."""
    text_config = InklingTextConfig(**{**HF_CONFIG, "eos_token_id": text})
    multimodal = HFInklingConfig(text_config=text_config.to_dict(), eos_token_id=top)
    for hf in (text_config, multimodal):
        want = GenerationConfig.from_model_config(hf).eos_token_id
        assert config_from_transformers(hf.to_dict()).eos_token_ids == (() if want is None else (want,))


def test_end_of_sequence_ids_the_model_cannot_emit_are_warned_about_and_ignored():
    """transformers warns about an id outside the vocabulary and keeps it (it never fires); an id in the head's
    padding (120..127 here) is never emitted either."""
    config = InklingTextConfig(**HF_CONFIG).to_dict()
    with pytest.warns(UserWarning, match=r"the Inkling config: eos_token_id \[120, 500\] outside \[0, 120\)"):
        assert config_from_transformers({**config, "eos_token_id": [3, 120, 500]}).eos_token_ids == (3,)
    for bad in ("2", 2.0, True, [1, None]):
        with pytest.raises(TypeError, match="eos_token_id must be null, a token id or a list of them"):
            config_from_transformers({**config, "eos_token_id": bad})


def test_a_generation_configs_end_of_sequence_ids_replace_the_configs_unread():
    """With a generation_config.json, its ``eos_token_id`` is the one ``generate`` reads (none if it has
    none); config.json's is not read at all, so an id there that the model cannot emit draws no warning."""
    config = {**InklingTextConfig(**HF_CONFIG).to_dict(), "eos_token_id": [3, 500]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_transformers(config, generation_config={"eos_token_id": 4}).eos_token_ids == (4,)
        assert config_from_transformers(config, generation_config={}).eos_token_ids == ()
    with pytest.warns(UserWarning, match=r"generation_config.json: eos_token_id \[120\] outside \[0, 120\)"):
        assert config_from_transformers(config, generation_config={"eos_token_id": [120, 5]}).eos_token_ids == (5,)


# -- InklingConfig's checks ----------------------------------------------------------------------------


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
        (dict(attention_keys_per_chunk=0), r"attention_keys_per_chunk must be >= 1, got 0"),
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
    "log_scaling_n_floor", "block_size", "num_speculative_tokens", "attention_keys_per_chunk",
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

"""Helpers shared by the Inkling test modules that check against transformers (``test_inkling_oracle``,
``test_inkling_checkpoint``, ``test_inkling_multimodal``): the tiny transformers text config, the fp32 layer
bound, random weights, a random model saved by transformers and loaded back, a one-file copy of a checkpoint.
Not a test module (pytest collects ``test_*.py`` only); the test modules import it by name, as they import
``conftest``."""

from __future__ import annotations

import json

import torch

from safetensors.torch import load_file, save_file
from transformers import InklingForCausalLM, InklingTextConfig  # the test extra pins 5.23.0

VOCAB = 128
HF_CONFIG = dict(
    vocab_size=VOCAB,
    unpadded_vocab_size=120,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=1,
    swa_head_dim=8,
    sliding_window_size=8,
    d_rel=4,
    rel_extent=12,
    log_scaling_n_floor=4,
    log_scaling_alpha=0.3,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=2,
    route_scale=2.0,
    logits_mup_width_multiplier=2.0,
    conv_kernel_size=4,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)
# fp32 layers that differ from transformers only in summation order: GEMMs blocked differently for a
# different number of rows (each routed expert runs on all tokens here, on its chosen ones there) and the
# recompute's one-pass attention (weights divided after P V) vs transformers' matmul attention. Each rounds a sum of <= 96 terms a few fp32 ulps (2**-24 relative) differently,
# and the layer's norms and softmax pass that on; seen over 5 input seeds: <= 2**-20.6 of the layer's (or
# the logits') largest value, so 2**-18 leaves 5x. A wrong part is off by >= 1e-2 of it.
FP32_LAYER = 2**-18


def randomize_parameters(model: torch.nn.Module) -> None:
    """Random weights for a transformers Inkling (text or multimodal), including those it sets to constants."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "global_scale" in name:
                param.normal_(1.0, 0.2)
            elif "sconv" in name:
                param.normal_(0.0, 0.3)
            elif name == "lm_head.weight" or "rel_logits_proj" in name:
                param.normal_(0.0, 1.0)  # peaked logits (greedy choices bf16 cannot flip); an O(1) bias
            else:
                # Unit-gain projections (transformers' std 0.02 makes every sublayer a small correction to
                # the residual, too small next to bf16 rounding for the bf16 test to see a wrong part).
                param.normal_(0.0, param.shape[-1] ** -0.5)


def _random_correction_bias(shape: torch.Size) -> torch.Tensor:
    """Routing that varies from token to token (some tokens are near ties, see the bf16 oracle test)."""
    return torch.randn(shape) * 0.5


def save_random_inkling(path, config: dict = HF_CONFIG, correction_bias=_random_correction_bias):
    """A tiny random transformers Inkling (``config``) saved with ``save_pretrained`` (sharded: several
    files) at ``path``; ``correction_bias(shape)`` gives each router's ``e_score_correction_bias``."""
    torch.manual_seed(0)
    model = InklingForCausalLM(InklingTextConfig(**config)).eval()
    randomize_parameters(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.copy_(correction_bias(buffer.shape))
    model.save_pretrained(path, max_shard_size="40KB")
    return path


def load_transformers_inkling(checkpoint, dtype: torch.dtype) -> InklingForCausalLM:
    """transformers' model of ``checkpoint`` in ``dtype``, with its eager attention, in eval mode."""
    return InklingForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager").eval()


def single_file_copy(checkpoint, tmp_path, edit=None, config_edit=None):
    """The checkpoint (sharded or not) as one ``model.safetensors`` (``edit`` may change its tensors,
    ``config_edit`` its config)."""
    index = checkpoint / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(checkpoint / name))
    if edit:
        edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path
